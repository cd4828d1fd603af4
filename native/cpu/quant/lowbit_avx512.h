/* Q2_K and Q3_K tiles at the AVX-512 VNNI level, reading the stored super-blocks in registers. Included
 * once by kernels_avx512vnni.c (after kq_transpose_add, gemm_tiles.h and kernels.h) in place of lowbit.h,
 * whose layouts and exactness note it follows: the same integers I_b and M_b, the same f64 operations in
 * the same order, so the same bits as every other level and the numpy twin.
 *
 * The 64 qs bytes are one vector; shifted right by 2j and masked to 2 bits they are values 32j .. 32j + 31
 * (low 256 bits) and 128 + 32j .. 128 + 32j + 31 (high 256 bits): vector j holds blocks j and 4 + j, and
 * meets the column's activation vector [a 32j .. 32j + 31 | a 128 + 32j ..] (lb_col). Q3_K adds 4 where bit
 * j (low half) or 4 + j (high half) of hmask[l] is set (vptestmb of [hmask | hmask]). vpdpbusd gives 4-value
 * sums; the transpose-add puts 128-bit lane k of vector j (the 16-value half k & 1 of block j, or of block
 * 4 + j for k >= 2) in lane 4k + j; a permute puts the 16 half sums in order, they narrow to int16 and
 * one vpmaddwd by the halves' int16 scales gives the 8 block integers in order, taken to f64.
 */
#ifndef DELTADESK_LOWBIT_AVX512_H
#define DELTADESK_LOWBIT_AVX512_H

/* half h <- lane 4k + j of the transpose-add: the lane holding half h */
static const int32_t lb_lane_of_half[16] = { 0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15 };
/* Q3_K's 6-bit scale of half i: low nibble from byte i % 8 shifted by 4 (i / 8), high two bits from byte
 * 8 + i % 4 shifted by 2 (i / 4) */
static const int16_t lb_q3_lo_byte[16] = { 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7 };
static const int16_t lb_q3_lo_shift[16] = { 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4 };
static const int16_t lb_q3_hi_byte[16] = { 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11 };
static const int16_t lb_q3_hi_shift[16] = { 0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6 };

/* One row's super-block in registers: the 4 unsigned value vectors, the int16 scales and mins of the 16
 * halves in order, the f32 scales. */
typedef struct {
    __m512i w[4];
    __m256i sc, mn;
    float d, dmin;
} lb_row;

/* One column's activations of a super-block: the 4 value vectors, the int16 half sums in order (|s| <=
 * 16 * 127), the 8 block scales. */
typedef struct {
    __m512i v[4];
    __m256i s16;
    __m256 da;
} lb_col;

DD_INLINE float lb_f16(const uint8_t *p)
{
    return _mm512_cvtss_f32(_mm512_cvtph_ps(_mm256_set1_epi16((short)dd_load_u16(p))));
}

DD_INLINE void lb_load_row(const uint8_t *blk, int wtype, lb_row *u)
{
    const __m512i three = _mm512_set1_epi8(3);
    const __m512i qs = _mm512_loadu_si512(blk + (wtype == DD_Q2_K ? 16 : 32));
    for (int j = 0; j < 4; j++)
        u->w[j] = _mm512_and_si512(_mm512_srli_epi16(qs, 2 * j), three);
    if (wtype == DD_Q2_K) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)blk));
        u->sc = _mm256_and_si256(b, _mm256_set1_epi16(15));
        u->mn = _mm256_srli_epi16(b, 4);
        u->d = lb_f16(blk + 80);
        u->dmin = lb_f16(blk + 82);
        return;
    }
    const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)blk)), four = _mm512_set1_epi8(4);
    for (int j = 0; j < 4; j++) {
        const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << j)), _mm256_set1_epi8((char)(16 << j)), 1);
        u->w[j] = _mm512_mask_add_epi8(u->w[j], _mm512_test_epi8_mask(hm, bit), u->w[j], four);
    }
    const __m256i b = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(0x0fff, blk + 96));
    const __m256i lo = _mm256_srlv_epi16(_mm256_permutexvar_epi16(_mm256_loadu_si256((const __m256i *)lb_q3_lo_byte), b),
                                         _mm256_loadu_si256((const __m256i *)lb_q3_lo_shift));
    const __m256i hi = _mm256_srlv_epi16(_mm256_permutexvar_epi16(_mm256_loadu_si256((const __m256i *)lb_q3_hi_byte), b),
                                         _mm256_loadu_si256((const __m256i *)lb_q3_hi_shift));
    const __m256i s = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi16(15)),
                                      _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi16(3)), 4));
    u->sc = _mm256_sub_epi16(s, _mm256_set1_epi16(32));
    u->d = lb_f16(blk + 108);
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

/* acc += row u against column p, in lowbit.h's f64 order (each product exact, then one add). The half
 * sums fit int16 (|sum (u - off) a| <= 16 * 4 * 127), so one vpmaddwd by the int16 scales (mins) gives
 * the 8 block integers in order. */
DD_INLINE void lb_terms(const lb_row *u, const lb_col *p, int wtype, __m512d *acc)
{
    __m512i d[4];
    for (int j = 0; j < 4; j++)
        d[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u->w[j], p->v[j]);
    __m256i h = _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(_mm512_loadu_si512(lb_lane_of_half), kq_transpose_add(d)));
    if (wtype == DD_Q3_K)
        h = _mm256_sub_epi16(h, _mm256_slli_epi16(p->s16, 2));
    const __m512d ints = _mm512_cvtepi32_pd(_mm256_madd_epi16(h, u->sc));
    *acc = _mm512_add_pd(*acc, _mm512_mul_pd(_mm512_cvtps_pd(_mm256_mul_ps(p->da, _mm256_set1_ps(u->d))), ints));
    if (wtype == DD_Q2_K) {
        const __m512d mins = _mm512_cvtepi32_pd(_mm256_madd_epi16(p->s16, u->mn));
        *acc = _mm512_sub_pd(*acc, _mm512_mul_pd(_mm512_cvtps_pd(_mm256_mul_ps(p->da, _mm256_set1_ps(u->dmin))), mins));
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
            lb_load_row(w + r * rb + sb * bytes, wtype, &u[r]);
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
DD_DEFINE_GEMM(gemm_q2_K, LB_TILE_Q2_K)
DD_DEFINE_GEMM(gemm_q3_K, LB_TILE_Q3_K)

/* The kernel table's entries for these types, in enum order (DD_Q2_K, DD_Q3_K). */
#define DD_LB_GEMMS gemm_q2_K, gemm_q3_K

#endif
