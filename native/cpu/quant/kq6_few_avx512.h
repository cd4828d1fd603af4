/* The Q6_K product of a few columns (a batched decode's rows, 1 .. KQ_GEMV_COLS) at the AVX-512 VNNI
 * level: "lanes = halves". Included by kq_tile_avx512.h after kq_gemm_avx512.h (kq_unpack, kq_row_scales,
 * kqx_reduce8).
 *
 * A super-block's 16 halves (16 values each, one int8 scale sc_L each) are the 16 dword lanes: half L in
 * lane P(L) = L / 2 + 8 (L % 2), so block i's two halves are lanes i and 8 + i. Vector t (t < 4) holds
 * dword t (values 4t .. 4t + 3) of every half. kq_unpack's four value-order vectors become these by two
 * stages of vpermt2d per row and super-block, shared by all the columns; a column's activations are
 * arranged alike once per thread and activations. Per (row, column, super-block) four vpdpbusd then
 * leave S_L - 32 s_L in lane P(L) (started from -32 s_L), one vpmulld by the scales, one add of the
 * two 256-bit halves gives the block integers I_i in lane i, and one f64 multiply and FMA add the
 * terms: no unpack and no transpose-add per column.
 *
 * Exactness: I_i = sum over halves h of sc_h (S_h - 32 s_h) is the exact int32 of kquants.h (|I_i| <
 * 2^25); acc_i += (d da_i) I_i with d da_i the f64 product of two f16 values (exact) and the FMA of an
 * exact product rounding once, as kq_row_pair does, into acc lane i = block i, in super-block order; the
 * lanes are reduced by kqx_reduce8, dd_kq_tile's tree. So every output has the bits of the GEMV.
 */
#ifndef DELTADESK_KQ6_FEW_AVX512_H
#define DELTADESK_KQ6_FEW_AVX512_H

/* Stage 1, pair s of vectors (2s, 2s + 1) into vector g: lane 8u + 4j + h = dword 2g + u of lane 4h of
 * source j (half 4(2s + j) + h). Stage 2, vector t = 2g + u from stage 1's pair (s = 0, 1) of vector g:
 * lane P(L) = lane 8u + L % 8 of source L / 8. */
static const int32_t kq6_stage1[2][16] = {
    { 0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29 },
    { 2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31 },
};
static const int32_t kq6_stage2[2][16] = {
    { 0, 2, 4, 6, 16, 18, 20, 22, 1, 3, 5, 7, 17, 19, 21, 23 },
    { 8, 10, 12, 14, 24, 26, 28, 30, 9, 11, 13, 15, 25, 27, 29, 31 },
};
/* lane P(L) <- lane L, for dwords (the activation half sums) and bytes (the scales) */
static const int32_t kq6_halves[16] = { 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15 };

/* The fewest columns kq6_few takes (KQ_GEMM; below, kq_gemv) */
#define KQ6_FEW 2

typedef struct {
    __m512i v[4];     /* vector t: dword t of each half, half L in lane P(L) */
    __m512i seed;     /* lane P(L): -32 times the sum of half L */
    __m512d da;       /* lane i: block i's scale */
} kq6_col;            /* one super-block of a column */

/* Four value-order vectors (dword 4h + t of x[j]: dword t of half 4j + h) into the lane layout, in place. */
DD_INLINE void kq6_transpose(__m512i x[4])
{
    __m512i s[2][2];
    for (int p = 0; p < 2; p++)
        for (int g = 0; g < 2; g++)
            s[p][g] = _mm512_permutex2var_epi32(x[2 * p], _mm512_loadu_si512(kq6_stage1[g]), x[2 * p + 1]);
    for (int g = 0; g < 2; g++)
        for (int u = 0; u < 2; u++)
            x[2 * g + u] = _mm512_permutex2var_epi32(s[0][g], _mm512_loadu_si512(kq6_stage2[u]), s[1][g]);
}

/* Column super-block b0 (its first 32-value block in the acts' numbering) arranged into *p. */
DD_INLINE void kq6_col_prep(const dd_acts *a, size_t b0, kq6_col *p)
{
    for (int j = 0; j < 4; j++)
        p->v[j] = _mm512_loadu_si512(a->q + b0 * DD_QK + 64 * j);
    kq6_transpose(p->v);
    const __m512i s = _mm512_permutexvar_epi32(_mm512_loadu_si512(kq6_halves), _mm512_loadu_si512(a->s16 + 2 * b0));
    p->seed = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, 5));
    p->da = _mm512_cvtps_pd(_mm256_loadu_ps(a->bd + b0));
}

/* A stored super-block as four vectors of unsigned quants in the lane layout, its 16 scales (lane P(L)
 * = sc_L) and its d broadcast to 8 f64 lanes. */
DD_INLINE void kq6_expand(const uint8_t *blk, __m512i w[4], __m512i *sc, __m512d *d)
{
    __m512d unused;
    kq_unpack(blk, DD_Q6_K, w);
    kq6_transpose(w);
    const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);   /* kq6_halves */
    *sc = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(blk + 192)), order));
    kq_row_scales(blk, DD_Q6_K, d, &unused);
}

/* One row (w) x columns [0, C) (C <= 8, column c's super-block sb at cols[c * nsb + sb]) into y[c * ldy];
 * pf: the row to prefetch while this one is read (kq_tile's prefetches). */
DD_INLINE void kq6_tile(const uint8_t *w, const uint8_t *pf, const kq6_col *cols, size_t nsb, float *y, size_t ldy,
                        const int C)
{
    __m512d acc[8];
    for (int c = 0; c < 8; c++)
        acc[c] = _mm512_setzero_pd();
    for (size_t sb = 0; sb < nsb; sb++) {
        const uint8_t *q = pf + sb * DD_Q6_K_BYTES;
        for (size_t at = 0; at < DD_Q6_K_BYTES; at += 64)
            dd_prefetch_weight(q + at);
        dd_prefetch_weight(q + DD_Q6_K_BYTES - 1);
        __m512i wv[4], sc;
        __m512d d;
        kq6_expand(w + sb * DD_Q6_K_BYTES, wv, &sc, &d);
        for (int c = 0; c < C; c++) {
            const kq6_col *p = cols + c * nsb + sb;
            __m512i x = p->seed;
            for (int t = 0; t < 4; t++)
                x = _mm512_dpbusd_epi32(x, wv[t], p->v[t]);
            x = _mm512_mullo_epi32(x, sc);
            const __m256i ints = _mm256_add_epi32(_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64(x, 1));
            acc[c] = _mm512_fmadd_pd(_mm512_mul_pd(p->da, d), _mm512_cvtepi32_pd(ints), acc[c]);
        }
    }
    float out[8];
    _mm256_storeu_ps(out, kqx_reduce8(acc));
    for (int c = 0; c < C; c++)
        y[c * ldy] = out[c];
}

/* A thread's last columns (kq6_col_prep of each super-block, column c's super-block sb at c * nsb + sb)
 * and the activations (dd_acts.id) they were arranged for, in its scratch (DD_SCRATCH_KQ6_COL; a new
 * buffer is zeroed, and id 0 matches no activations). */
typedef struct {
    uint64_t id;
    kq6_col cols[KQ_GEMV_COLS * KQ_GEMV_SB];
} kq6_few_state;

/* A Q6_K product of a->m <= KQ_GEMV_COLS columns with rows of nb / 8 <= KQ_GEMV_SB super-blocks, as
 * DD_DEFINE_GEMM's GEMV walk (row by row here; the same prefetches), the columns arranged
 * at most once per thread and activations, in st. The bits are the GEMV's (see above). */
DD_INLINE void kq6_few(const uint8_t *w, size_t rb, size_t nrows, size_t rows_avail, const dd_acts *a, float *y,
                       size_t ldy, kq6_few_state *st)
{
    const size_t nsb = a->nb / 8;
    if (a->id == 0 || st->id != a->id) {
        for (size_t c = 0; c < a->m; c++)
            for (size_t sb = 0; sb < nsb; sb++)
                kq6_col_prep(a, c * a->nbp + 8 * sb, &st->cols[c * nsb + sb]);
        st->id = a->id;
    }
    const size_t ahead = dd_gemv_ahead(rb);
    dd_gemv_prefetch_start(w, rb, nrows, rows_avail, ahead);
    for (size_t r = 0; r < nrows; r++) {
        const uint8_t *pf = DD_PREFETCH_AHEAD(w, rb, r, 1, rows_avail, ahead);
        switch (a->m) {
        case 8: kq6_tile(w + r * rb, pf, st->cols, nsb, y + r, ldy, 8); break;
        case 7: kq6_tile(w + r * rb, pf, st->cols, nsb, y + r, ldy, 7); break;
        case 6: kq6_tile(w + r * rb, pf, st->cols, nsb, y + r, ldy, 6); break;
        case 5: kq6_tile(w + r * rb, pf, st->cols, nsb, y + r, ldy, 5); break;
        case 4: kq6_tile(w + r * rb, pf, st->cols, nsb, y + r, ldy, 4); break;
        case 3: kq6_tile(w + r * rb, pf, st->cols, nsb, y + r, ldy, 3); break;
        case 2: kq6_tile(w + r * rb, pf, st->cols, nsb, y + r, ldy, 2); break;
        default: kq6_tile(w + r * rb, pf, st->cols, nsb, y + r, ldy, 1); break;
        }
    }
}

#endif
