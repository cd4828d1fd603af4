/* Q2_K and Q3_K tiles at the AVX-512 VNNI level, reading the stored super-blocks in registers. Included
 * once by kernels_avx512vnni.c (after kq_transpose_add, gemm_tiles.h and kernels.h) in place of lowbit.h,
 * whose layouts and exactness note it follows: the same integers I_b and M_b, the same f64 operations in
 * the same order, so the same bits as every other level and the numpy twin.
 *
 * Vector j of a row holds values 32j .. 32j + 31 (low 256 bits) and 128 + 32j .. 128 + 32j + 31 (high 256
 * bits), blocks j and 4 + j, and meets the column's activation vector [a 32j .. | a 128 + 32j ..] (lb_col).
 * Q2_K's vectors are the 64 qs bytes masked, unshifted where the mask allows: qs & 3, qs & 12, (qs >> 4) & 3,
 * (qs >> 4) & 12, so vectors 1 and 3 hold 4 times the values and their sums are divided by 4 later (exact: a
 * multiple of 4). Q3_K's are (qs >> 2j) & 3 plus 4 where bit j (low half) or 4 + j (high half) of hmask[l]
 * is set (vptestmb of [hmask | hmask]). vpdpbusd gives 4-value sums; the transpose-add puts 128-bit lane k
 * of vector j (the 16-value half k & 1 of block j, or of block 4 + j for k >= 2) in lane 4k + j; one vpermw
 * takes the low 16 bits of each lane (the half sums fit int16) into half order, and one vpmaddwd by the
 * halves' int16 scales gives the 8 block integers in order, taken to f64.
 */
#ifndef DELTADESK_LOWBIT_AVX512_H
#define DELTADESK_LOWBIT_AVX512_H

/* half h <- the low 16 bits of lane 4k + j of the transpose-add (int16 index 2 (4k + j)) */
static const int16_t lb_word_of_half[32] = { 0, 8, 2, 10, 4, 12, 6, 14, 16, 24, 18, 26, 20, 28, 22, 30 };
/* Q2_K: log2 of the factor of half h's sums (4 for blocks 1, 3, 5, 7: vectors 1 and 3) */
static const int16_t lb_q2_shift[16] = { 0, 0, 2, 2, 0, 0, 2, 2, 0, 0, 2, 2, 0, 0, 2, 2 };
/* Q3_K's high-bit masks of vector j: bit j of hmask[l] (low half), bit 4 + j (high half) */
#define LB_X8(x) x, x, x, x, x, x, x, x
#define LB_X32(x) LB_X8(x), LB_X8(x), LB_X8(x), LB_X8(x)
static const uint8_t lb_q3_hbit[4][64] = { { LB_X32(1), LB_X32(16) }, { LB_X32(2), LB_X32(32) },
                                           { LB_X32(4), LB_X32(64) }, { LB_X32(8), LB_X32(128) } };
#undef LB_X32
#undef LB_X8
/* Q3_K's 6-bit scale of half i: low nibble from byte i % 8 shifted by 4 (i / 8), high two bits from byte
 * 8 + i % 4 shifted by 2 (i / 4) */
static const int16_t lb_q3_lo_byte[16] = { 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7 };
static const int16_t lb_q3_lo_shift[16] = { 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4 };
static const int16_t lb_q3_hi_byte[16] = { 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11 };
static const int16_t lb_q3_hi_shift[16] = { 0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6 };

/* One row's super-block in registers: the 4 unsigned value vectors, the int16 scales and mins of the 16
 * halves in order, d and dmin in every lane. */
typedef struct {
    __m512i w[4];
    __m256i sc, mn;
    __m256 d, dmin;
} lb_row;

/* One column's activations of a super-block: the 4 value vectors, the int16 half sums in order (|s| <=
 * 16 * 127), the 8 block scales. */
typedef struct {
    __m512i v[4];
    __m256i s16;
    __m256 da;
} lb_col;

/* The f16 at p in all 8 lanes (exact). */
DD_INLINE __m256 lb_f16x8(const uint8_t *p)
{
    return _mm256_maskz_cvtph_ps(0xff, _mm_set1_epi16((short)dd_load_u16(p)));
}

DD_INLINE void lb_load_q2(const uint8_t *blk, lb_row *u)
{
    const __m512i three = _mm512_set1_epi8(3), twelve = _mm512_set1_epi8(12);
    const __m512i qs = _mm512_loadu_si512(blk + 16), hi = _mm512_srli_epi16(qs, 4);
    u->w[0] = _mm512_and_si512(qs, three);
    u->w[1] = _mm512_and_si512(qs, twelve);
    u->w[2] = _mm512_and_si512(hi, three);
    u->w[3] = _mm512_and_si512(hi, twelve);
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)blk));
    u->sc = _mm256_and_si256(b, _mm256_set1_epi16(15));
    u->mn = _mm256_srli_epi16(b, 4);
    u->d = lb_f16x8(blk + 80);
    u->dmin = lb_f16x8(blk + 82);
}

DD_INLINE void lb_load_q3(const uint8_t *blk, lb_row *u)
{
    const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    const __m512i qs = _mm512_loadu_si512(blk + 32);
    const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)blk));
    for (int j = 0; j < 4; j++) {
        const __m512i bit = _mm512_loadu_si512(lb_q3_hbit[j]);
        const __m512i low = _mm512_and_si512(_mm512_srli_epi16(qs, 2 * j), three);
        u->w[j] = _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(hm, bit), low, four);
    }
    const __m256i b = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(0x0fff, blk + 96));
    const __m256i lo = _mm256_srlv_epi16(_mm256_permutexvar_epi16(_mm256_loadu_si256((const __m256i *)lb_q3_lo_byte), b),
                                         _mm256_loadu_si256((const __m256i *)lb_q3_lo_shift));
    const __m256i hi = _mm256_srlv_epi16(_mm256_permutexvar_epi16(_mm256_loadu_si256((const __m256i *)lb_q3_hi_byte), b),
                                         _mm256_loadu_si256((const __m256i *)lb_q3_hi_shift));
    const __m256i s = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi16(15)),
                                      _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi16(3)), 4));
    u->sc = _mm256_sub_epi16(s, _mm256_set1_epi16(32));
    u->d = lb_f16x8(blk + 108);
}

DD_INLINE void lb_load_col(const dd_acts *a, size_t b0, lb_col *p)
{
    const int8_t *q = a->q + b0 * DD_QK;
    for (int j = 0; j < 4; j++)
        p->v[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(q + 32 * j))),
                                     _mm256_load_si256((const __m256i *)(q + 128 + 32 * j)), 1);
    p->s16 = _mm512_cvtepi32_epi16(_mm512_loadu_si512(a->s16 + 2 * b0));
    p->da = _mm256_loadu_ps(a->bd + b0);
}

/* acc += row u against column p, in lowbit.h's f64 order (each product exact, then one add). The half sums fit int16 (|sum (u - off) a| <= 16 * 4 * 127; Q2_K's
 * 4-fold ones <= 16 * 12 * 127), so one vpmaddwd by the int16 scales (mins) gives the 8 block integers. */
DD_INLINE void lb_terms(const lb_row *u, const lb_col *p, int wtype, __m512d *acc)
{
    __m512i d[4];
    for (int j = 0; j < 4; j++)
        d[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u->w[j], p->v[j]);
    const __m512i words = _mm512_permutexvar_epi16(_mm512_loadu_si512(lb_word_of_half), kq_transpose_add(d));
    __m256i h = _mm512_castsi512_si256(words);
    if (wtype == DD_Q2_K)
        h = _mm256_srav_epi16(h, _mm256_loadu_si256((const __m256i *)lb_q2_shift));
    else
        h = _mm256_sub_epi16(h, _mm256_slli_epi16(p->s16, 2));
    const __m512d ints = _mm512_cvtepi32_pd(_mm256_madd_epi16(h, u->sc));
    *acc = _mm512_add_pd(*acc, _mm512_mul_pd(_mm512_cvtps_pd(_mm256_mul_ps(p->da, u->d)), ints));
    if (wtype == DD_Q2_K) {
        const __m512d mins = _mm512_cvtepi32_pd(_mm256_madd_epi16(p->s16, u->mn));
        *acc = _mm512_sub_pd(*acc, _mm512_mul_pd(_mm512_cvtps_pd(_mm256_mul_ps(p->da, u->dmin)), mins));
    }
}

DD_INLINE void lb_tile(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, int wtype, size_t c0,
                       float *y, size_t ldy, const int R, const int C)
{
    const size_t bytes = wtype == DD_Q2_K ? DD_Q2_K_BYTES : DD_Q3_K_BYTES, nsb = a->nb / 8;
    __m512d acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = _mm512_setzero_pd();
    for (size_t sb = 0; sb < nsb; sb++) {
        lb_row u[4];
        for (int r = 0; r < R; r++) {
            const uint8_t *q = pf + r * rb + sb * bytes;   /* every line: 84 or 110 bytes may span three */
            for (size_t at = 0; at < bytes; at += 64)
                dd_prefetch_weight(q + at);
            dd_prefetch_weight(q + bytes - 1);
            if (wtype == DD_Q2_K)
                lb_load_q2(w + r * rb + sb * bytes, &u[r]);
            else
                lb_load_q3(w + r * rb + sb * bytes, &u[r]);
        }
        for (int c = 0; c < C; c++) {
            lb_col p;
            lb_load_col(a, (c0 + c) * a->nbp + 8 * sb, &p);
            for (int r = 0; r < R; r++)
                lb_terms(&u[r], &p, wtype, &acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            double s[8];
            _mm512_storeu_pd(s, acc[r][c]);
            y[(c0 + c) * ldy + r] = (float)(((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));
        }
}

#define LB_TILE_Q2_K(w, pf, rb, a, c0, y, ldy, R, C) lb_tile(w, pf, rb, a, DD_Q2_K, c0, y, ldy, R, C)
#define LB_TILE_Q3_K(w, pf, rb, a, c0, y, ldy, R, C) lb_tile(w, pf, rb, a, DD_Q3_K, c0, y, ldy, R, C)
DD_DEFINE_GEMM(tiles_q2_K, LB_TILE_Q2_K)
DD_DEFINE_GEMM(tiles_q3_K, LB_TILE_Q3_K)

/* From 6 columns the rows expand once per call for the K-quant walk (kq_gemm_avx512.h; lowbit.h's
 * dd_lb_expand_row), the same bits; below, these tiles were as fast (6) or faster (2-4). */
KQX_GEMM_FROM(gemm_q2_K, DD_Q2_K, 6, tiles_q2_K)
KQX_GEMM_FROM(gemm_q3_K, DD_Q3_K, 6, tiles_q3_K)

/* The kernel table's entries for these types, in enum order (DD_Q2_K, DD_Q3_K). */
#define DD_LB_GEMMS gemm_q2_K, gemm_q3_K

#endif
