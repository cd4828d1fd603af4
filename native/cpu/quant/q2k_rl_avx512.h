/* The AVX-512 VNNI products of Q2_K and Q3_K matrices in the 4-row rows-as-lanes layouts (dd_q2_k_rl_pack and
 * dd_q3_k_rl_pack in deltadesk_cpu.h), a GEMV run column by column, included by kernels_avx512vnni.c after
 * lowbit_avx512.h (its row-major gemm_q2_K and gemm_q3_K).
 *
 * Chunk c (64 bytes) of a group's super-block holds in lane 4 g + r row r's qs dword 4 g + c: bytes 16 g + 4 c
 * .. + 3, whose field f (bits 2 f, 2 f + 1) are values 128 n + 32 f + 16 t + 4 c + i (g = 2 n + t, i < 4). So
 * chunk_c & (3 << 2 f) against the column's matching activation dwords (rl_col.a[f][c], permuted once per
 * activations) is step c of accumulator f, whose lane 4 g + r sums the 16 values of half 8 n + 2 f + t of row
 * r (block 4 n + f) at the uniform factor 4^f: |sum| <= 16 * 192 * 127 < 2^22, and the arithmetic shift by 2 f
 * is exact. The half sums then fit int16 (16 * 3 * 127), so one 2-source word permute pairs each block's two
 * halves in a dword and one vpmaddwd by the pairs' scales (the layout's scale bytes, widened) gives the
 * lowbit.h block integers I_b, another by the mins against the activations' half sums M_b, with (block, row)
 * as the lanes: f64 accumulator j holds block j (lanes 0-3, rows 0-3) and block j + 4 (lanes 4-7). Each lane
 * gets lowbit_avx512.h's operations on the same values in the same order (the product da d, then the f64 product
 * by I_b added, the one by M_b subtracted), super-block after super-block, and a group's end sums
 * accumulators 0 + 1, 2 + 3, those two, then lanes l and l + 4: its tree ((s0 + s1) + (s2 + s3)) + ((s4 + s5) +
 * (s6 + s7)) for the 4 rows at once, rounded once. Hence the row-major kernel's bits. The product da d is taken in
 * f64 of the widened halves (da a Q8_0 scale, d an f16): two 11-bit significands, so the f32 product the
 * row-major kernel widens is exact and the same value (0 times infinity the same default NaN, a NaN operand
 * the same payload, da's first); it saves the f32 multiply and a conversion per term.
 *
 * Q3_K in its layout (dd_q3_k_rl_pack) runs the same steps on the same activations (rl_col): its qs chunks are Q2_K's,
 * and hmask chunk c (32 bytes, broadcast to both 256-bit halves) holds in lane 4 g + r row r's hmask dword 4 t + c,
 * whose bit 4 n + f is the third bit of the value field f of qs lane 4 g + r holds (lowbit.h). Step c of accumulator
 * f meets u = low + 4 high in 0..7 at the factor 4^f (f < 3: qs & (3 << 2 f), plus 4^(f + 1) where vptestmb finds the
 * bit: at most 7 * 16 = 112 < 256) or 16 (f = 3: (qs >> 2) & (3 << 4), plus 64); the exact arithmetic shifts by 0, 2,
 * 4, 4 give the half sums of u (|.| <= 16 * 7 * 127, int16), minus 4 s16 (lowbit.h's offset, int16: the sum of
 * (u - 4) a), then one vpmaddwd by the 6-bit scales minus 32 (taken from the layout's nibble and two-bit bytes in the
 * pairs' order) gives the block integers I_b, and each lane adds (da d) I_b as lowbit_avx512.h does: the row-major
 * Q3_K kernel's integers, f64 operations and tree, so its bits.
 */
#ifndef DELTADESK_Q2K_RL_AVX512_H
#define DELTADESK_Q2K_RL_AVX512_H

#define RL_SB_BYTES (4 * DD_Q2_K_BYTES)

/* How far ahead of the super-block it reads the GEMV prefetches (one forward stream, the 6 lines a super-block's
 * 336 bytes can touch): DD_PREFETCH_BYTES ran ~2 % faster than twice or four times that, and as fast as half, at
 * k = 512 and 2048 from DRAM. */
#define RL_PREFETCH_BYTES DD_PREFETCH_BYTES

/* Word 2 D + t of a pair (D = 4 q + r): the low word of lane 4 (g0 + t) + r of the first source (q < 2) or the
 * second (q >= 2), g0 = 0 for q even, 2 for q odd: the two halves of block f or 4 + f of accumulator f. */
static const int16_t rl_pair_words[32] = { 0,  8,  2,  10, 4,  12, 6,  14, 16, 24, 18, 26, 20, 28, 22, 30,
                                           32, 40, 34, 42, 36, 44, 38, 46, 48, 56, 50, 58, 52, 60, 54, 62 };
/* The block whose two scales (and half sums) the pair q of word pair p holds: 2 p + {0, 4, 1, 5}[q]. */
static const uint8_t rl_pair_block[2][4] = { { 0, 4, 1, 5 }, { 2, 6, 3, 7 } };

/* A column's super-block as the GEMV meets it. */
typedef struct {
    __m512i a[4][4];   /* a[f][c], lane 4 g + r: activation dword 32 (g / 2) + 8 f + 4 (g % 2) + c of the super-block */
    __m512i s16[2];    /* s16[p], words 2 (4 q + r) + t: the half sum of half 2 rl_pair_block[p][q] + t */
    __m512d da[4];     /* da[j]: the scale of block j in lanes 0-3, of block j + 4 in lanes 4-7, as f64 */
} rl_col;

/* Columns whose prepared activations a thread keeps (a batched decode step, an expert's share of a prompt: kept
 * between a product's chunks under the activations' id); a product of more columns prepares them RL_COLS at a
 * time for each chunk. */
#define RL_COLS 8

/* A thread's last columns (DD_SCRATCH_Q2RL_COL; a new buffer is zeroed, and id 0 matches no activations): the
 * activations' id (0 while it holds a block of a larger product's columns), then from byte 64 the rl_col of each
 * super-block of each column (column c's at c * nsb). */
typedef struct {
    uint64_t id;
} rl_state;

DD_INLINE rl_col *rl_cols(rl_state *st)
{
    return (rl_col *)((uint8_t *)st + 64);
}

/* The super-block of a's activations whose first block is b0 (c * nbp + 8 sb for column c's super-block sb) into p. */
DD_INLINE void rl_col_prep(const dd_acts *a, size_t b0, rl_col *p)
{
    const int8_t *q = a->q + b0 * DD_QK;
    const __m512i z0 = _mm512_loadu_si512(q), z1 = _mm512_loadu_si512(q + 64);
    const __m512i z2 = _mm512_loadu_si512(q + 128), z3 = _mm512_loadu_si512(q + 192);
    const __m512i base = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
    for (int f = 0; f < 4; f++)
        for (int c = 0; c < 4; c++) {
            const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(8 * f + c));
            p->a[f][c] = _mm512_mask_blend_epi32(0xff00, _mm512_permutex2var_epi32(z0, idx, z1),
                                                 _mm512_permutex2var_epi32(z2, idx, z3));
        }
    int16_t s16[2][32];
    double da[4][8];
    for (int pp = 0; pp < 2; pp++)
        for (int qq = 0; qq < 4; qq++)
            for (int r = 0; r < 4; r++)
                for (int t = 0; t < 2; t++)
                    s16[pp][2 * (4 * qq + r) + t] = (int16_t)a->s16[2 * (b0 + rl_pair_block[pp][qq]) + t];
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 8; l++)
            da[j][l] = (double)a->bd[b0 + j + 4 * (l / 4)];
    for (int pp = 0; pp < 2; pp++)
        p->s16[pp] = _mm512_loadu_si512(s16[pp]);
    for (int j = 0; j < 4; j++)
        p->da[j] = _mm512_loadu_pd(da[j]);
}

/* acc[j] += the f64 terms of one super-block's I (blocks j, j + 4 in the int32 lanes of half h of pair p, j =
 * 2 p + h) and M, in lowbit_avx512.h's lb_terms order. */
DD_INLINE void rl_terms(__m512i i_pair[2], __m512i m_pair[2], const rl_col *p, __m512d d8, __m512d dmin8,
                        __m512d acc[4])
{
    for (int j = 0; j < 4; j++) {
        const __m512i iv = i_pair[j / 2], mv = m_pair[j / 2];
        const __m256i ih = j % 2 ? _mm512_extracti64x4_epi64(iv, 1) : _mm512_castsi512_si256(iv);
        const __m256i mh = j % 2 ? _mm512_extracti64x4_epi64(mv, 1) : _mm512_castsi512_si256(mv);
        acc[j] = _mm512_add_pd(acc[j], _mm512_mul_pd(_mm512_mul_pd(p->da[j], d8), _mm512_cvtepi32_pd(ih)));
        acc[j] = _mm512_sub_pd(acc[j], _mm512_mul_pd(_mm512_mul_pd(p->da[j], dmin8), _mm512_cvtepi32_pd(mh)));
    }
}

/* One super-block of a group (336 bytes at g) against its column p into acc. */
DD_INLINE void rl_super_block(const uint8_t *g, const rl_col *p, __m512d acc[4])
{
    __m512i s[4];
    for (int f = 0; f < 4; f++) {
        const __m512i mask = _mm512_set1_epi8((char)(3 << (2 * f)));
        s[f] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++)
            s[f] = _mm512_dpbusd_epi32(s[f], _mm512_and_si512(_mm512_loadu_si512(g + 64 * c), mask), p->a[f][c]);
    }
    const __m512i idx = _mm512_loadu_si512(rl_pair_words);
    const __m512i pa = _mm512_permutex2var_epi16(s[0], idx, _mm512_srai_epi32(s[1], 2));
    const __m512i pb = _mm512_permutex2var_epi16(_mm512_srai_epi32(s[2], 4), idx, _mm512_srai_epi32(s[3], 6));
    const __m512i bytes_a = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(g + 256)));
    const __m512i bytes_b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(g + 288)));
    const __m512i low = _mm512_set1_epi16(15);
    __m512i i_pair[2] = { _mm512_madd_epi16(pa, _mm512_and_si512(bytes_a, low)),
                          _mm512_madd_epi16(pb, _mm512_and_si512(bytes_b, low)) };
    __m512i m_pair[2] = { _mm512_madd_epi16(p->s16[0], _mm512_srli_epi16(bytes_a, 4)),
                          _mm512_madd_epi16(p->s16[1], _mm512_srli_epi16(bytes_b, 4)) };
    const __m512d dm = _mm512_cvtps_pd(_mm256_maskz_cvtph_ps(0xff, _mm_loadu_si128((const __m128i *)(g + 320))));
    const __m512d d8 = _mm512_shuffle_f64x2(dm, dm, 0x44), dmin8 = _mm512_shuffle_f64x2(dm, dm, 0xee);
    rl_terms(i_pair, m_pair, p, d8, dmin8, acc);
}

/* Q3_K's word shifts that bring the top 2 bits of a pair's scales (the layout's byte 8 u + 2 r + t widened, field
 * 2 p + w / 16 for word w) to bits 4 and 5: pair 0 left by 4 or 2, pair 1 right by 0 or 2. */
static const int16_t rl3_hi_shift[2][32] = { { 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
                                               2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2 },
                                             { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                               2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2 } };
/* log2 of the factor at which Q3_K's accumulator f sums its values */
static const int rl3_factor[4] = { 0, 2, 4, 4 };

/* One Q3_K super-block of a group (440 bytes at g) against its column p into acc. */
DD_INLINE void rl3_super_block(const uint8_t *g, const rl_col *p, __m512d acc[4])
{
    __m512i s[4];
    for (int f = 0; f < 4; f++)
        s[f] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        const __m512i qs = _mm512_loadu_si512(g + 64 * c);
        const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(g + 256 + 32 * c)));
        const __m512i low[4] = { _mm512_and_si512(qs, _mm512_set1_epi8(3)), _mm512_and_si512(qs, _mm512_set1_epi8(12)),
                                 _mm512_and_si512(qs, _mm512_set1_epi8(48)),
                                 _mm512_and_si512(_mm512_srli_epi16(qs, 2), _mm512_set1_epi8(48)) };
        for (int f = 0; f < 4; f++) {
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << f)), _mm256_set1_epi8((char)(16 << f)),
                                                   1);
            const __m512i u = _mm512_mask_add_epi8(low[f], _mm512_test_epi8_mask(hm, bit), low[f],
                                                   _mm512_set1_epi8((char)(4 << rl3_factor[f])));
            s[f] = _mm512_dpbusd_epi32(s[f], u, p->a[f][c]);
        }
    }
    const __m512i idx = _mm512_loadu_si512(rl_pair_words);
    const __m512i pa = _mm512_permutex2var_epi16(s[0], idx, _mm512_srai_epi32(s[1], rl3_factor[1]));
    const __m512i pb = _mm512_permutex2var_epi16(_mm512_srai_epi32(s[2], rl3_factor[2]), idx,
                                                 _mm512_srai_epi32(s[3], rl3_factor[3]));
    const __m512i lo = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(g + 384)));
    const __m512i hi = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(g + 416))));
    const __m512i top = _mm512_set1_epi16(48), k32 = _mm512_set1_epi16(32);
    const __m512i sc_a = _mm512_sub_epi16(
        _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi16(15)),
                        _mm512_and_si512(_mm512_sllv_epi16(hi, _mm512_loadu_si512(rl3_hi_shift[0])), top)), k32);
    const __m512i sc_b = _mm512_sub_epi16(
        _mm512_or_si512(_mm512_srli_epi16(lo, 4),
                        _mm512_and_si512(_mm512_srlv_epi16(hi, _mm512_loadu_si512(rl3_hi_shift[1])), top)), k32);
    const __m512i i_pair[2] = { _mm512_madd_epi16(_mm512_sub_epi16(pa, _mm512_slli_epi16(p->s16[0], 2)), sc_a),
                                _mm512_madd_epi16(_mm512_sub_epi16(pb, _mm512_slli_epi16(p->s16[1], 2)), sc_b) };
    const __m512d dm = _mm512_cvtps_pd(_mm256_maskz_cvtph_ps(0xff, _mm_loadl_epi64((const __m128i *)(g + 432))));
    const __m512d d8 = _mm512_shuffle_f64x2(dm, dm, 0x44);
    for (int j = 0; j < 4; j++) {
        const __m512i iv = i_pair[j / 2];
        const __m256i ih = j % 2 ? _mm512_extracti64x4_epi64(iv, 1) : _mm512_castsi512_si256(iv);
        acc[j] = _mm512_add_pd(acc[j], _mm512_mul_pd(_mm512_mul_pd(p->da[j], d8), _mm512_cvtepi32_pd(ih)));
    }
}

/* `groups` groups of wtype (DD_Q2_K or DD_Q3_K) at w (4 * row_bytes each) -> y[0 .. 4 * groups), prefetching up to
 * end (the lines a super-block can touch: 6 of 336 bytes, 7 of 440). */
DD_INLINE void rl_gemv(const int wtype, const uint8_t *w, size_t row_bytes, size_t groups, const uint8_t *end,
                       const rl_col *cols, size_t nsb, float *y)
{
    const size_t sb_bytes = wtype == DD_Q2_K ? RL_SB_BYTES : 4 * DD_Q3_K_BYTES;
    const int lines = wtype == DD_Q2_K ? 6 : 7;
    for (size_t s = 0; s < groups; s++) {
        const uint8_t *g = w + s * 4 * row_bytes;
        __m512d acc[4];
        for (int j = 0; j < 4; j++)
            acc[j] = _mm512_setzero_pd();
        for (size_t sb = 0; sb < nsb; sb++) {
            const uint8_t *blk = g + sb * sb_bytes;
            const uint8_t *pf = blk + RL_PREFETCH_BYTES;
            if (pf + 64 * lines <= end)
                for (int l = 0; l < lines; l++)
                    dd_prefetch_weight(pf + 64 * l);
            if (wtype == DD_Q2_K)
                rl_super_block(blk, cols + sb, acc);
            else
                rl3_super_block(blk, cols + sb, acc);
        }
        const __m512d z = _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3]));
        const __m256d rows = _mm256_add_pd(_mm512_castpd512_pd256(z), _mm512_extractf64x4_pd(z, 1));
        _mm_storeu_ps(y + 4 * s, _mm256_cvtpd_ps(rows));
    }
}

static void rl_gemv_q2(const uint8_t *w, size_t row_bytes, size_t groups, const uint8_t *end, const rl_col *cols,
                       size_t nsb, float *y)
{
    rl_gemv(DD_Q2_K, w, row_bytes, groups, end, cols, nsb, y);
}

static void rl_gemv_q3(const uint8_t *w, size_t row_bytes, size_t groups, const uint8_t *end, const rl_col *cols,
                       size_t nsb, float *y)
{
    rl_gemv(DD_Q3_K, w, row_bytes, groups, end, cols, nsb, y);
}

/* Columns [c0, c0 + n) of a through the wtype's GEMV on the groups (the columns prepared in st, column c - c0 at
 * (c - c0) * nsb), column by column: a chunk's rows stay in L2 for the next column. */
DD_INLINE void rl_columns(const int wtype, const uint8_t *w, size_t row_bytes, size_t groups, const uint8_t *end,
                          const dd_acts *a, rl_state *st, size_t c0, size_t n, float *y, size_t ldy)
{
    const size_t nsb = a->nb / 8;
    for (size_t c = 0; c < n; c++)
        (wtype == DD_Q2_K ? rl_gemv_q2 : rl_gemv_q3)(w, row_bytes, groups, end, rl_cols(st) + c * nsb, nsb,
                                                     y + (c0 + c) * ldy);
}

/* Columns [c0, c0 + n) of a prepared into st. */
DD_INLINE void rl_prepare(const dd_acts *a, rl_state *st, size_t c0, size_t n)
{
    const size_t nsb = a->nb / 8;
    for (size_t c = 0; c < n; c++)
        for (size_t sb = 0; sb < nsb; sb++)
            rl_col_prep(a, (c0 + c) * a->nbp + 8 * sb, rl_cols(st) + c * nsb + sb);
}

/* gemm[DD_Q2_K_RL] (wtype DD_Q2_K) or gemm[DD_Q3_K_RL] (DD_Q3_K) of this level: the groups by the rows-as-lanes
 * GEMV, column by column (each column the bits of its one-column product), and the row-major kernel (gemm_q2_K,
 * gemm_q3_K) on the row-major tail; more than RL_COLS columns of rows the row-major kernel's expanded-row GEMM
 * takes (KQX_FITS), or without the columns' scratch, dd_gemm_unpacked (the groups de-interleaved for that kernel,
 * which outran the column-by-column GEMV there). */
DD_INLINE void rl_gemm(const int wtype, const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail,
                       const dd_acts *a, float *y, size_t ldy)
{
    const size_t groups = nrows / 4, r0 = 4 * groups, nsb = a->nb / 8, kept = a->m < RL_COLS ? a->m : RL_COLS;
    const dd_gemm_fn row_major = wtype == DD_Q2_K ? gemm_q2_K : gemm_q3_K;
    const int deinterleave = a->m > RL_COLS && KQX_FITS(a);
    rl_state *st = groups > 0 && !deinterleave ? dd_scratch(DD_SCRATCH_Q2RL_COL, 64 + kept * nsb * sizeof(rl_col))
                                               : NULL;
    if (st == NULL) {
        dd_gemm_unpacked(row_major, wtype == DD_Q2_K ? dd_q2_k_rl_unpack_groups : dd_q3_k_rl_unpack_groups, 4, w,
                         row_bytes, nrows, rows_avail, a, y, ldy);
        return;
    }
    const uint8_t *end = w + rows_avail / 4 * 4 * row_bytes;
    if (a->m <= RL_COLS) {
        if (a->id == 0 || st->id != a->id) {   /* id 0: activations not from acts_place */
            rl_prepare(a, st, 0, a->m);
            st->id = a->id;
        }
        rl_columns(wtype, w, row_bytes, groups, end, a, st, 0, a->m, y, ldy);
    } else {
        st->id = 0;
        for (size_t c0 = 0; c0 < a->m; c0 += RL_COLS) {
            const size_t n = a->m - c0 < RL_COLS ? a->m - c0 : RL_COLS;
            rl_prepare(a, st, c0, n);
            rl_columns(wtype, w, row_bytes, groups, end, a, st, c0, n, y, ldy);
        }
    }
    if (nrows > r0)
        row_major(w + r0 * row_bytes, row_bytes, nrows - r0, rows_avail - r0, a, y + r0, ldy);
}

static void gemm_q2_k_rl(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a,
                         float *y, size_t ldy)
{
    rl_gemm(DD_Q2_K, w, row_bytes, nrows, rows_avail, a, y, ldy);
}

static void gemm_q3_k_rl(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a,
                         float *y, size_t ldy)
{
    rl_gemm(DD_Q3_K, w, row_bytes, nrows, rows_avail, a, y, ldy);
}

#endif
