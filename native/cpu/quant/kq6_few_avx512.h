/* The Q6_K product of a few columns (a batched decode's rows, KQ6_FEW .. KQ_GEMV_COLS) at the AVX-512
 * VNNI level: "lanes = halves". Included by kq_tile_avx512.h after kq_gemm_avx512.h (kq_unpack,
 * kq_row_scales, kq_half_lane, kq_order, kqx_reduce8).
 *
 * A super-block's 16 halves (16 values each, one int8 scale sc_L each) are the 16 dword lanes: half
 * L = 4j + h in lane 4h + j, and vector t (t < 4) holds dword t (values 4t .. 4t + 3) of every half.
 * kq_unpack's four value-order vectors (dword 4h + t of vector j: dword t of half 4j + h) become these
 * by a 4 x 4 dword transpose within each 128-bit lane (eight unpack instructions), once per row and
 * super-block for all the columns; a column's activations are arranged alike once per thread and
 * activations. Per (row, column, super-block) four vpdpbusd then leave S_L - 32 s_L in lane 4h + j
 * (started from -32 s_L) and one vpmulld scales them; two columns' block integers I_i (block i = halves
 * 2i, 2i + 1: 128-bit lanes 0 + 1 hold blocks 0, 2, 4, 6 and lanes 2 + 3 blocks 1, 3, 5, 7, KQ_ORDER[1])
 * come from one pair of 128-bit shuffles and an add, and one f64 multiply and FMA per column add the
 * terms: no unpack and no transpose-add per column.
 *
 * Exactness: I_i = sum over halves h of sc_h (S_h - 32 s_h) is the exact int32 of kquants.h (|I_i| <
 * 2^25); acc_l += (d da_i) I_i, block i = KQ_ORDER[1][l], with d da_i the f64 product of two f16
 * values (exact) and the FMA of an exact product rounding once, as kq_row_pair does, in super-block
 * order; the lanes, put back in block order, are reduced by kqx_reduce8 (dd_kq_tile's tree). So every
 * output has the bits of the GEMV.
 */
#ifndef DELTADESK_KQ6_FEW_AVX512_H
#define DELTADESK_KQ6_FEW_AVX512_H

/* The fewest columns kq6_few takes (KQ_GEMM; below, kq_gemv) */
#define KQ6_FEW 2

typedef struct {
    __m512i v[4];     /* vector t: dword t of each half, half 4j + h in lane 4h + j */
    __m512i seed;     /* lane 4h + j: -32 times the sum of half 4j + h */
    __m512d da;       /* lane l: the scale of block KQ_ORDER[1][l] */
} kq6_col;            /* one super-block of a column */

/* Four value-order vectors (dword 4h + t of x[j]: dword t of half 4j + h) into the lane layout, in place:
 * a 4 x 4 dword transpose within each 128-bit lane. */
DD_INLINE void kq6_transpose(__m512i x[4])
{
    const __m512i lo01 = _mm512_unpacklo_epi32(x[0], x[1]), hi01 = _mm512_unpackhi_epi32(x[0], x[1]);
    const __m512i lo23 = _mm512_unpacklo_epi32(x[2], x[3]), hi23 = _mm512_unpackhi_epi32(x[2], x[3]);
    x[0] = _mm512_unpacklo_epi64(lo01, lo23);
    x[1] = _mm512_unpackhi_epi64(lo01, lo23);
    x[2] = _mm512_unpacklo_epi64(hi01, hi23);
    x[3] = _mm512_unpackhi_epi64(hi01, hi23);
}

/* Column super-block b0 (its first 32-value block in the acts' numbering) arranged into *p. */
DD_INLINE void kq6_col_prep(const dd_acts *a, size_t b0, kq6_col *p)
{
    for (int j = 0; j < 4; j++)
        p->v[j] = _mm512_loadu_si512(a->q + b0 * DD_QK + 64 * j);
    kq6_transpose(p->v);
    const __m512i s = _mm512_permutexvar_epi32(_mm512_loadu_si512(kq_half_lane), _mm512_loadu_si512(a->s16 + 2 * b0));
    p->seed = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, 5));
    const __m256i order = _mm256_loadu_si256((const __m256i *)kq_order[1]);
    p->da = _mm512_cvtps_pd(_mm256_permutexvar_ps(order, _mm256_loadu_ps(a->bd + b0)));
}

/* A stored super-block as four vectors of unsigned quants in the lane layout, its 16 scales (lane 4h + j
 * = sc of half 4j + h) and its d broadcast to 8 f64 lanes. */
DD_INLINE void kq6_expand(const uint8_t *blk, __m512i w[4], __m512i *sc, __m512d *d)
{
    __m512d unused;
    kq_unpack(blk, DD_Q6_K, w);
    kq6_transpose(w);
    const __m128i order = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);   /* kq_half_lane */
    *sc = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(blk + 192)), order));
    kq_row_scales(blk, DD_Q6_K, d, &unused);
}

/* Lane 4h + j = sc_L (S_L - 32 s_L), L = 4j + h, of a row's super-block (wv, sc) against column p's
 * arranged vectors v and seed. */
DD_INLINE __m512i kq6_scaled(const __m512i wv[4], __m512i sc, const __m512i v[4], __m512i seed)
{
    __m512i x = seed;
    for (int t = 0; t < 4; t++)
        x = _mm512_dpbusd_epi32(x, wv[t], v[t]);
    return _mm512_mullo_epi32(x, sc);
}

/* acc[c], acc[c + 1] (when two) += the f64 terms of two columns' scaled halves x0, x1 (one row; row
 * scale d, the columns' block scales da0, da1): their block integers from one pair of 128-bit shuffles. */
DD_INLINE void kq6_terms(__m512i x0, __m512i x1, __m512d d, __m512d da0, __m512d da1, __m512d *acc, const int two)
{
    const __m512i ints = _mm512_add_epi32(_mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                                          _mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
    acc[0] = _mm512_fmadd_pd(_mm512_mul_pd(da0, d), _mm512_cvtepi32_pd(_mm512_castsi512_si256(ints)), acc[0]);
    if (two)
        acc[1] = _mm512_fmadd_pd(_mm512_mul_pd(da1, d), _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(ints, 1)),
                                 acc[1]);
}

/* Rows [0, R) (R <= 2, row r at w + r * rb) x columns [0, C) (C <= 8; R * C <= 8: the accumulators stay
 * in registers; column c's super-block sb at cols[c * nsb + sb]) into y[c * ldy + r]; pf: the rows to
 * prefetch while these are read (kq_tile's prefetches). Each column's vectors are loaded once for the R
 * rows. */
DD_INLINE void kq6_tile(const uint8_t *w, const uint8_t *pf, size_t rb, const kq6_col *cols, size_t nsb, float *y,
                        size_t ldy, const int R, const int C)
{
    __m512d acc[2][8];
    for (int r = 0; r < 2; r++)
        for (int c = 0; c < 8; c++)
            acc[r][c] = _mm512_setzero_pd();
    for (size_t sb = 0; sb < nsb; sb++) {
        __m512i wv[2][4], sc[2];
        __m512d d[2];
        for (int r = 0; r < R; r++) {
            const uint8_t *q = pf + r * rb + sb * DD_Q6_K_BYTES;
            for (size_t at = 0; at < DD_Q6_K_BYTES; at += 64)
                dd_prefetch_weight(q + at);
            dd_prefetch_weight(q + DD_Q6_K_BYTES - 1);
            kq6_expand(w + r * rb + sb * DD_Q6_K_BYTES, wv[r], &sc[r], &d[r]);
        }
        for (int c = 0; c < C; c += 2) {
            const int two = c + 1 < C;
            const kq6_col *p0 = cols + c * nsb + sb, *p1 = two ? p0 + nsb : p0;
            __m512i v0[4], v1[4];
            for (int t = 0; t < 4; t++) {
                v0[t] = _mm512_load_si512(&p0->v[t]);
                v1[t] = _mm512_load_si512(&p1->v[t]);
            }
            const __m512i seed0 = _mm512_load_si512(&p0->seed), seed1 = _mm512_load_si512(&p1->seed);
            for (int r = 0; r < R; r++) {
                const __m512i x0 = kq6_scaled(wv[r], sc[r], v0, seed0);
                const __m512i x1 = two ? kq6_scaled(wv[r], sc[r], v1, seed1) : x0;
                kq6_terms(x0, x1, d[r], p0->da, p1->da, &acc[r][c], two);
            }
        }
    }
    const __m512i blocks = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);   /* lane b <- the lane of block b */
    for (int r = 0; r < R; r++) {
        for (int c = 0; c < C; c++)
            acc[r][c] = _mm512_permutexvar_pd(blocks, acc[r][c]);
        float out[8];
        _mm256_storeu_ps(out, kqx_reduce8(acc[r]));
        for (int c = 0; c < C; c++)
            y[c * ldy + r] = out[c];
    }
}

/* A thread's last columns (kq6_col_prep of each super-block, column c's super-block sb at c * nsb + sb)
 * and the activations (dd_acts.id) they were arranged for, in its scratch (DD_SCRATCH_KQ6_COL; a new
 * buffer is zeroed, and id 0 matches no activations). */
typedef struct {
    uint64_t id;
    kq6_col cols[KQ_GEMV_COLS * KQ_GEMV_SB];
} kq6_few_state;

/* A Q6_K product of a->m <= KQ_GEMV_COLS columns with rows of nb / 8 <= KQ_GEMV_SB super-blocks, as
 * DD_DEFINE_GEMM's GEMV walk (the same prefetches; row pairs up to 4 columns, then single rows), the
 * columns arranged at most once per thread and activations, in st. The bits are the GEMV's (see above). */
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
    const int pair = a->m <= 4;
    size_t r = 0;
    for (; pair && r + 2 <= nrows; r += 2) {
        const uint8_t *pf = DD_PREFETCH_AHEAD(w, rb, r, 2, rows_avail, ahead);
        switch (a->m) {
        case 4: kq6_tile(w + r * rb, pf, rb, st->cols, nsb, y + r, ldy, 2, 4); break;
        case 3: kq6_tile(w + r * rb, pf, rb, st->cols, nsb, y + r, ldy, 2, 3); break;
        default: kq6_tile(w + r * rb, pf, rb, st->cols, nsb, y + r, ldy, 2, 2); break;
        }
    }
    for (; r < nrows; r++) {
        const uint8_t *pf = DD_PREFETCH_AHEAD(w, rb, r, 1, rows_avail, ahead);
        switch (a->m) {
        case 8: kq6_tile(w + r * rb, pf, rb, st->cols, nsb, y + r, ldy, 1, 8); break;
        case 7: kq6_tile(w + r * rb, pf, rb, st->cols, nsb, y + r, ldy, 1, 7); break;
        case 6: kq6_tile(w + r * rb, pf, rb, st->cols, nsb, y + r, ldy, 1, 6); break;
        case 5: kq6_tile(w + r * rb, pf, rb, st->cols, nsb, y + r, ldy, 1, 5); break;
        case 4: kq6_tile(w + r * rb, pf, rb, st->cols, nsb, y + r, ldy, 1, 4); break;
        case 3: kq6_tile(w + r * rb, pf, rb, st->cols, nsb, y + r, ldy, 1, 3); break;
        default: kq6_tile(w + r * rb, pf, rb, st->cols, nsb, y + r, ldy, 1, 2); break;
        }
    }
}

#endif
