/* K-quant products (Q4_K, Q5_K, Q6_K) of a few columns (a batched decode's rows, KQH_FEW ..
 * KQ_GEMV_COLS) at the AVX-512 VNNI level: "lanes = halves". Included by kq_tile_avx512.h after
 * kq_gemm_avx512.h (kq_unpack, kq_pair, kq_row_scales, kq_half_lane, kq_order, kqx_reduce8).
 *
 * A super-block's 16 halves (16 values each) are the 16 dword lanes and vector t (t < 4) holds dword t
 * (values 4t .. 4t + 3) of every half, so four vpdpbusd accumulate a half's whole sum in one lane. The
 * layout is a 4 x 4 dword transpose within each 128-bit lane (eight unpack instructions) of kq_unpack's
 * four vectors, whose 128-bit lanes are halves: Q6_K value order (lane h of vector j: half 4j + h), Q4_K /
 * Q5_K kq_col's order (vector j's lanes 0, 1: the halves of block (0, 1, 4, 5)[j], lanes 2, 3: of block
 * (2, 3, 6, 7)[j]); the 16 bytes of lane h of vector j end in dword lanes 4h + j. This is done once per
 * row and super-block for all the columns, in registers; a column's activations are arranged alike once
 * per thread and activations. Per (row, column, super-block): four vpdpbusd (Q6_K: from -32 s_L, then one
 * vpmulld by the half scales); one pair of 128-bit shuffles and an add for two columns, adding each
 * block's two halves (128-bit lanes 0 + 1 and 2 + 3), which leaves the blocks in KQ_ORDER (Q4_K / Q5_K:
 * then one vpmulld by the block scales for the two columns); one f64 multiply and FMA (Q4_K / Q5_K: and
 * the min term's multiply and FNMA). No unpack and no transpose-add per column.
 *
 * Exactness: the block integer (Q6_K: I_i = sum over halves h of sc_h (S_h - 32 s_h); Q4_K / Q5_K:
 * sc_i S_i) is kquants.h's exact int32, and the f64 terms are kq_row_pair's, the same products of exact
 * factors into lane l = block KQ_ORDER[t][l], super-block by super-block, each FMA of an exact product
 * rounding once; the lanes, put back in block order, are reduced by kqx_reduce8 (dd_kq_tile's tree). So
 * every output has the bits of the GEMV.
 */
#ifndef DELTADESK_KQH_FEW_AVX512_H
#define DELTADESK_KQH_FEW_AVX512_H

/* The fewest columns kqh_few takes (KQ_GEMM; below, kq_gemv) */
#define KQH_FEW 2

typedef struct {
    __m512i v[4];     /* vector t: dword t of each half, half 4j + h in lane 4h + j */
    __m512i seed;     /* lane 4h + j: -32 times the sum of half 4j + h */
    __m512d da;       /* lane l: the scale of block KQ_ORDER[t][l] (t = 1: Q6_K, 0: Q4_K / Q5_K) */
    __m512d dab;      /* Q4_K / Q5_K: da times the block's activation sum, same lanes */
} kqh_col;            /* one super-block of a column */

/* A 4 x 4 dword transpose within each 128-bit lane, in place: dword t of lane j of x[k] goes to dword k of
 * lane j of x[t]. Here it takes four value-order vectors (dword 4h + t of x[j]: dword t of half 4j + h) into
 * the lane layout; the interleaved Q4_0 prefill (q4_gemm_avx512.h) uses it too. */
DD_INLINE void dd_lane_transpose4(__m512i x[4])
{
    const __m512i lo01 = _mm512_unpacklo_epi32(x[0], x[1]), hi01 = _mm512_unpackhi_epi32(x[0], x[1]);
    const __m512i lo23 = _mm512_unpacklo_epi32(x[2], x[3]), hi23 = _mm512_unpackhi_epi32(x[2], x[3]);
    x[0] = _mm512_unpacklo_epi64(lo01, lo23);
    x[1] = _mm512_unpackhi_epi64(lo01, lo23);
    x[2] = _mm512_unpacklo_epi64(hi01, hi23);
    x[3] = _mm512_unpackhi_epi64(hi01, hi23);
}

/* Column super-block b0 (its first 32-value block in the acts' numbering) arranged into *p. */
DD_INLINE void kqh_col_prep(const dd_acts *a, size_t b0, int wtype, kqh_col *p)
{
    kq_col_vectors(a, b0, wtype, p->v, &p->da, &p->dab);
    p->seed = _mm512_setzero_si512();
    if (wtype == DD_Q6_K) {
        const __m512i s = _mm512_permutexvar_epi32(_mm512_loadu_si512(kq_half_lane),
                                                   _mm512_loadu_si512(a->s16 + 2 * b0));
        p->seed = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, 5));
    }
    dd_lane_transpose4(p->v);
}

/* A stored super-block as four vectors of unsigned quants in the lane layout and its scales: Q6_K, sc lane
 * 4h + j = the scale of half 4j + h; Q4_K / Q5_K, sc lanes l and 8 + l = the scale of block KQ_ORDER[0][l],
 * m lane l its min (f64); d and dmin broadcast to 8 f64 lanes. */
DD_INLINE void kqh_expand(const uint8_t *blk, int wtype, __m512i w[4], __m512i *sc, __m512d *m, __m512d *d,
                          __m512d *dmin)
{
    kq_unpack(blk, wtype, w);
    dd_lane_transpose4(w);
    kq_row_scales(blk, wtype, d, dmin);
    if (wtype == DD_Q6_K) {
        const __m128i order = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);   /* kq_half_lane */
        *sc = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(blk + 192)), order));
        *m = _mm512_setzero_pd();
        return;
    }
    uint32_t words[4];   /* bytes 0-7: the blocks' scales, 8-15: their mins */
    dd_kq_scale_words(blk, words);
    const __m128i sm = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)words),
                                        _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15));
    *sc = _mm512_broadcast_i64x4(_mm256_cvtepu8_epi32(sm));
    *m = _mm512_cvtepi32_pd(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
}

/* seed plus the four vpdpbusd of a row's super-block wv against a column's vectors v. */
DD_INLINE __m512i kqh_dots(const __m512i wv[4], const __m512i v[4], __m512i seed)
{
    __m512i x = seed;
    for (int t = 0; t < 4; t++)
        x = _mm512_dpbusd_epi32(x, wv[t], v[t]);
    return x;
}

/* Lane 4h + j = sc_L (S_L - 32 s_L), L = 4j + h, of a row's super-block (wv, sc) against column p's
 * arranged vectors v and seed. */
DD_INLINE __m512i kqh_scaled(const __m512i wv[4], __m512i sc, const __m512i v[4], __m512i seed)
{
    return _mm512_mullo_epi32(kqh_dots(wv, v, seed), sc);
}

/* The block integers of two columns' lanes x0, x1 (one row): block KQ_ORDER[t][l] of x0 in lane l, of
 * x1 in lane 8 + l (the two 128-bit lanes of a block added by one pair of shuffles). */
DD_INLINE __m512i kqh_blocks(__m512i x0, __m512i x1)
{
    return _mm512_add_epi32(_mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* *acc += the f64 terms of one column's block integers ints (Q4_K / Q5_K: sc_i S_i, then the min term
 * of kq_row_pair) with the row's d, dmin and mins m and the column's p. */
DD_INLINE void kqh_term(__m256i ints, const kqh_col *p, __m512d d, __m512d dmin, __m512d m, int wtype, __m512d *acc)
{
    *acc = _mm512_fmadd_pd(_mm512_mul_pd(p->da, d), _mm512_cvtepi32_pd(ints), *acc);
    if (wtype != DD_Q6_K)
        *acc = _mm512_fnmadd_pd(_mm512_mul_pd(p->dab, dmin), m, *acc);
}

/* Rows [0, R) (R <= 2, row r at w + r * rb) x columns [0, C) (C <= 8; column c's super-block sb at
 * cols[c * nsb + sb]) into y[c * ldy + r]; pf: the rows to prefetch while these are read (kq_tile's
 * prefetches). Each column's vectors are loaded once for the R rows; at R * C > 8 the compiler keeps a few
 * accumulators on the stack, which costs less than loading every column's vectors once per row. */
DD_INLINE void kqh_tile(const uint8_t *w, const uint8_t *pf, size_t rb, const kqh_col *cols, size_t nsb, int wtype,
                        float *y, size_t ldy, const int R, const int C)
{
    const size_t bytes = wtype == DD_Q4_K ? DD_Q4_K_BYTES : wtype == DD_Q5_K ? DD_Q5_K_BYTES : DD_Q6_K_BYTES;
    __m512d acc[2][8];
    for (int r = 0; r < 2; r++)
        for (int c = 0; c < 8; c++)
            acc[r][c] = _mm512_setzero_pd();
    for (size_t sb = 0; sb < nsb; sb++) {
        __m512i wv[2][4], sc[2];
        __m512d m[2], d[2], dmin[2];
        for (int r = 0; r < R; r++) {
            const uint8_t *q = pf + r * rb + sb * bytes;
            for (size_t at = 0; at < bytes; at += 64)
                dd_prefetch_weight(q + at);
            dd_prefetch_weight(q + bytes - 1);
            kqh_expand(w + r * rb + sb * bytes, wtype, wv[r], &sc[r], &m[r], &d[r], &dmin[r]);
        }
        for (int c = 0; c < C; c += 2) {
            const int two = c + 1 < C;
            const kqh_col *p0 = cols + c * nsb + sb, *p1 = two ? p0 + nsb : p0;
            __m512i v0[4], v1[4];
            for (int t = 0; t < 4; t++) {
                v0[t] = _mm512_load_si512(&p0->v[t]);
                v1[t] = _mm512_load_si512(&p1->v[t]);
            }
            const __m512i seed0 = _mm512_load_si512(&p0->seed), seed1 = _mm512_load_si512(&p1->seed);
            for (int r = 0; r < R; r++) {
                __m512i ints;
                if (wtype == DD_Q6_K) {   /* each half times its own scale, then the halves added */
                    const __m512i x0 = kqh_scaled(wv[r], sc[r], v0, seed0);
                    ints = kqh_blocks(x0, two ? kqh_scaled(wv[r], sc[r], v1, seed1) : x0);
                } else {                  /* the halves added, then the block times its scale */
                    const __m512i x0 = kqh_dots(wv[r], v0, seed0);
                    ints = _mm512_mullo_epi32(kqh_blocks(x0, two ? kqh_dots(wv[r], v1, seed1) : x0), sc[r]);
                }
                kqh_term(_mm512_castsi512_si256(ints), p0, d[r], dmin[r], m[r], wtype, &acc[r][c]);
                if (two)
                    kqh_term(_mm512_extracti64x4_epi64(ints, 1), p1, d[r], dmin[r], m[r], wtype, &acc[r][c + 1]);
            }
        }
    }
    const __m512i blocks = wtype == DD_Q6_K ? _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7)   /* lane b <- block b's */
                                            : _mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7);
    for (int r = 0; r < R; r++) {
        for (int c = 0; c < C; c++)
            acc[r][c] = _mm512_permutexvar_pd(blocks, acc[r][c]);
        float out[8];
        _mm256_storeu_ps(out, kqx_reduce8(acc[r]));
        for (int c = 0; c < C; c++)
            y[c * ldy + r] = out[c];
    }
}

/* kqh_tile with the column count m (KQH_FEW .. KQ_GEMV_COLS) as a constant. */
DD_INLINE void kqh_rows(const uint8_t *w, const uint8_t *pf, size_t rb, const kqh_col *cols, size_t nsb, int wtype,
                        float *y, size_t ldy, const int R, size_t m)
{
    switch (m) {
    case 8: kqh_tile(w, pf, rb, cols, nsb, wtype, y, ldy, R, 8); break;
    case 7: kqh_tile(w, pf, rb, cols, nsb, wtype, y, ldy, R, 7); break;
    case 6: kqh_tile(w, pf, rb, cols, nsb, wtype, y, ldy, R, 6); break;
    case 5: kqh_tile(w, pf, rb, cols, nsb, wtype, y, ldy, R, 5); break;
    case 4: kqh_tile(w, pf, rb, cols, nsb, wtype, y, ldy, R, 4); break;
    case 3: kqh_tile(w, pf, rb, cols, nsb, wtype, y, ldy, R, 3); break;
    default: kqh_tile(w, pf, rb, cols, nsb, wtype, y, ldy, R, 2); break;
    }
}

/* A thread's last columns (kqh_col_prep of each super-block, column c's super-block sb at c * nsb + sb)
 * and the activations (dd_acts.id) and layout (q6: 1 for Q6_K, 0 for Q4_K / Q5_K) they were arranged
 * for, in its scratch (DD_SCRATCH_KQH_COL; a new buffer is zeroed, and id 0 matches no activations). */
typedef struct {
    uint64_t id;
    int q6;
    kqh_col cols[KQ_GEMV_COLS * KQ_GEMV_SB];
} kqh_few_state;

/* A K-quant product (wtype) of a->m <= KQ_GEMV_COLS columns with rows of nb / 8 <= KQ_GEMV_SB super-blocks, as
 * DD_DEFINE_GEMM's GEMV walk (the same prefetches; row pairs, then a last single row), the columns arranged
 * at most once per thread and activations, in st. The bits are the GEMV's (see above). */
DD_INLINE void kqh_few(const uint8_t *w, size_t rb, size_t nrows, size_t rows_avail, const dd_acts *a, float *y,
                       size_t ldy, int wtype, kqh_few_state *st)
{
    const int q6 = wtype == DD_Q6_K;
    const size_t nsb = a->nb / 8;
    if (a->id == 0 || st->id != a->id || st->q6 != q6) {
        for (size_t c = 0; c < a->m; c++)
            for (size_t sb = 0; sb < nsb; sb++)
                kqh_col_prep(a, c * a->nbp + 8 * sb, wtype, &st->cols[c * nsb + sb]);
        st->id = a->id;
        st->q6 = q6;
    }
    const size_t ahead = dd_gemv_ahead(rb);
    dd_gemv_prefetch_start(w, rb, nrows, rows_avail, ahead);
    size_t r = 0;
    for (; r + 2 <= nrows; r += 2)
        kqh_rows(w + r * rb, DD_PREFETCH_AHEAD(w, rb, r, 2, rows_avail, ahead), rb, st->cols, nsb, wtype, y + r, ldy,
                 2, a->m);
    if (r < nrows)
        kqh_rows(w + r * rb, DD_PREFETCH_AHEAD(w, rb, r, 1, rows_avail, ahead), rb, st->cols, nsb, wtype, y + r, ldy,
                 1, a->m);
}

#endif
