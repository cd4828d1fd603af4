/* K-quant products (Q4_K, Q5_K, Q6_K) of a few columns (a batched decode's rows, KQH_FEW ..
 * KQ_GEMV_COLS) at the AVX-512 VNNI level: "lanes = halves". Included by kq_tile_avx512.h (kq_unpack,
 * kq_col_vectors, kq_half_lane, kq_order).
 *
 * A super-block's 16 halves (16 values each) are the 16 dword lanes and vector t (t < 4) holds dword t
 * (values 4t .. 4t + 3) of every half, so four vpdpbusd accumulate a half's whole sum in one lane. The
 * layout is a 4 x 4 dword transpose within each 128-bit lane (eight unpack instructions) of kq_unpack's
 * four vectors, whose 128-bit lanes are halves: Q6_K value order (lane h of vector j: half 4j + h), Q4_K /
 * Q5_K kq_col's order (vector j's lanes 0, 1: the halves of block (0, 1, 4, 5)[j], lanes 2, 3: of block
 * (2, 3, 6, 7)[j]); the 16 bytes of lane h of vector j end in dword lanes 4h + j. This is done once per
 * row and super-block for all the columns, in registers; a column's activations are arranged alike once
 * per thread and activations. Per (row, column pair, super-block): four vpdpbusd a column (Q6_K: from
 * -32 s_h, then a conversion to f32 and a multiply by the half scales); one pair of 128-bit shuffles and an
 * add, adding each block's two halves (128-bit lanes 0 + 1 and 2 + 3), which leaves the two columns' blocks
 * in KQ_ORDER in lanes 0-7 and 8-15 of one vector; then the f32 terms of both columns at once: (Q4_K /
 * Q5_K: a conversion,) two multiplies and an add (Q4_K / Q5_K: and the min term's multiply and subtract).
 * The Q4_K / Q5_K block scale sc_i is not multiplied into the integer: it is in the row's f32 d sc_i. No
 * unpack and no transpose-add per column.
 *
 * Exactness: the block integers (Q4_K / Q5_K: S_i, int32; Q6_K: I_i = sum over halves h of
 * sc_h (S_h - 32 s_h), formed in f32, where every product and sum is an integer below 2^24) are kquants.h's,
 * and the terms are the contract's (kquants.h), each f32 operation rounded on its own (no FMA): Q4_K / Q5_K
 * ((d sc_i) da_i) S_i, d sc_i exact, less (dmin m_i)(da_i bs_i), both factors exact; Q6_K (d da_i) I_i,
 * d da_i exact. Lane l of a column's eight holds block KQ_ORDER[t][l] and adds its terms super-block by
 * super-block from +0; the lanes, put back in block order, are added in the contract's tree (kqh_reduce).
 * So every output has the bits of dd_kq_tile and of the numpy twin.
 */
#ifndef DELTADESK_KQH_FEW_AVX512_H
#define DELTADESK_KQH_FEW_AVX512_H

/* The fewest columns kqh_few takes (KQ_GEMM; below, kq_gemv) */
#define KQH_FEW 2

typedef struct {
    __m512i v[4];     /* vector t: dword t of each half, half 4j + h in lane 4h + j */
    __m512i seed;     /* lane 4h + j: -32 times the sum of half 4j + h */
    __m256 da;        /* lane l: the scale of block KQ_ORDER[t][l] (t = 1: Q6_K, 0: Q4_K / Q5_K) */
    __m256 dab;       /* Q4_K / Q5_K: da times the block's activation sum (exact), same lanes */
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

/* lo in lanes 0-7, hi in lanes 8-15 (two columns' 8 block lanes in one vector). */
DD_INLINE __m512 kqh_join(__m256 lo, __m256 hi)
{
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

/* A row's stored super-block: four vectors of unsigned quants in the lane layout and its f32 scales, the
 * same in lanes l and 8 + l (a column pair's). */
typedef struct {
    __m512i w[4];
    __m512 sc;        /* Q6_K: lane 4h + j = the scale of half 4j + h */
    __m512 dsc;       /* Q6_K: d; Q4_K / Q5_K: lane l = d sc_i of block i = KQ_ORDER[0][l] (exact: 11 + 6 bits) */
    __m512 dmm;       /* Q4_K / Q5_K: lane l = dmin m_i (exact) */
} kqh_row;

DD_INLINE void kqh_expand(const uint8_t *blk, int wtype, kqh_row *u)
{
    kq_unpack(blk, wtype, u->w);
    dd_lane_transpose4(u->w);
    uint32_t bits;
    memcpy(&bits, blk + (wtype == DD_Q6_K ? 208 : 0), 4);
    const __m128 f = _mm_maskz_cvtph_ps(0x3, _mm_cvtsi32_si128((int)bits));   /* d, dmin; the EVEX form: no F16C */
    const __m512 d = _mm512_broadcastss_ps(f);
    if (wtype == DD_Q6_K) {
        const __m128i order = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);   /* kq_half_lane */
        u->sc = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(blk + 192)), order)));
        u->dsc = d;
        u->dmm = _mm512_setzero_ps();
        return;
    }
    uint32_t words[4];   /* bytes 0-7: the blocks' scales, 8-15: their mins */
    dd_kq_scale_words(blk, words);
    const __m128i sm = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)words),
                                        _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15));
    u->sc = _mm512_setzero_ps();
    u->dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_broadcast_i64x4(_mm256_cvtepu8_epi32(sm))));
    u->dmm = _mm512_mul_ps(_mm512_broadcastss_ps(_mm_movehdup_ps(f)),
                           _mm512_cvtepi32_ps(_mm512_broadcast_i64x4(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)))));
}

/* seed plus the four vpdpbusd of a row's super-block wv against a column's vectors v. */
DD_INLINE __m512i kqh_dots(const __m512i wv[4], const __m512i v[4], __m512i seed)
{
    __m512i x = seed;
    for (int t = 0; t < 4; t++)
        x = _mm512_dpbusd_epi32(x, wv[t], v[t]);
    return x;
}

/* The blocks of two columns' lanes x0, x1 (one row): block KQ_ORDER[t][l] of x0 in lane l, of x1 in lane
 * 8 + l, each the sum of its two halves (128-bit lanes 0 + 1 and 2 + 3: one pair of shuffles and an add). */
DD_INLINE __m512i kqh_blocks(__m512i x0, __m512i x1)
{
    return _mm512_add_epi32(_mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* kqh_blocks in f32 (Q6_K's sums of two exact halves: exact). */
DD_INLINE __m512 kqh_blocks_ps(__m512 x0, __m512 x1)
{
    return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Q6_K: lane 4h + j = sc_L (S_L - 32 s_L), L = 4j + h, of row u against column vectors v and seed, in f32:
 * exact, as is the block sum I_i of two (|S_L - 32 s_L| <= 16 * 32 * 127 < 2^16, |sc_L| <= 128: |I_i| < 2^24).
 * The conversion and multiply cost less than a vpmulld and the block integers' conversion. */
DD_INLINE __m512 kqh_scaled(const kqh_row *u, const __m512i v[4], __m512i seed)
{
    return _mm512_mul_ps(_mm512_cvtepi32_ps(kqh_dots(u->w, v, seed)), u->sc);
}

/* One row's outputs from its column pairs' accumulators acc[p] (columns 2p and 2p + 1, lanes in block order):
 * out[c] = ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of column c (kq_tree4). */
DD_INLINE void kqh_reduce(const __m512 acc[4], float out[8])
{
    /* kq_tree4's lanes are columns 0, 2, 4, 6, 1, 3, 5, 7 */
    _mm256_storeu_ps(out, _mm256_permutexvar_ps(_mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), kq_tree4(acc)));
}

/* One row (at w) x columns [0, C) (C <= 8; column c's super-block sb at cols[c * nsb + sb]) into y[c * ldy];
 * pf: the row to prefetch while this one is read (kq_tile's prefetches). Columns 2p and 2p + 1 share the f32
 * accumulator acc[p] (lanes 0-7 and 8-15; an odd C's last pair: the last column twice). */
DD_INLINE void kqh_tile(const uint8_t *w, const uint8_t *pf, const kqh_col *cols, size_t nsb, int wtype, float *y,
                        size_t ldy, const int C)
{
    const size_t bytes = wtype == DD_Q4_K ? DD_Q4_K_BYTES : wtype == DD_Q5_K ? DD_Q5_K_BYTES : DD_Q6_K_BYTES;
    __m512 acc[4];
    for (int p = 0; p < 4; p++)
        acc[p] = _mm512_setzero_ps();
    for (size_t sb = 0; sb < nsb; sb++) {
        const uint8_t *q = pf + sb * bytes;
        for (size_t at = 0; at < bytes; at += 64)
            dd_prefetch_weight(q + at);
        dd_prefetch_weight(q + bytes - 1);
        kqh_row u;
        kqh_expand(w + sb * bytes, wtype, &u);
        for (int c = 0; c < C; c += 2) {
            const int two = c + 1 < C;
            const kqh_col *p0 = cols + c * nsb + sb, *p1 = two ? p0 + nsb : p0;
            __m512i v0[4], v1[4];
            for (int t = 0; t < 4; t++) {
                v0[t] = _mm512_load_si512(&p0->v[t]);
                v1[t] = _mm512_load_si512(&p1->v[t]);
            }
            const __m512i seed0 = _mm512_load_si512(&p0->seed), seed1 = _mm512_load_si512(&p1->seed);
            const __m512 da = kqh_join(p0->da, p1->da), dab = kqh_join(p0->dab, p1->dab);
            __m512 *a = &acc[c / 2];
            if (wtype == DD_Q6_K) {   /* (d da_i) I_i */
                const __m512 x0 = kqh_scaled(&u, v0, seed0);
                const __m512 ints = kqh_blocks_ps(x0, two ? kqh_scaled(&u, v1, seed1) : x0);
                *a = _mm512_add_ps(*a, _mm512_mul_ps(_mm512_mul_ps(u.dsc, da), ints));
            } else {                  /* ((d sc_i) da_i) S_i, less (dmin m_i)(da_i bs_i) */
                const __m512i x0 = kqh_dots(u.w, v0, seed0);
                const __m512i ints = kqh_blocks(x0, two ? kqh_dots(u.w, v1, seed1) : x0);
                *a = _mm512_add_ps(*a, _mm512_mul_ps(_mm512_mul_ps(u.dsc, da), _mm512_cvtepi32_ps(ints)));
                *a = _mm512_sub_ps(*a, _mm512_mul_ps(u.dmm, dab));
            }
        }
    }
    const __m512i blocks = _mm512_loadu_si512(kq_block_lanes[wtype == DD_Q6_K]);   /* lane b (8 + b) <- block b's */
    for (int p = 0; p < (C + 1) / 2; p++)
        acc[p] = _mm512_permutexvar_ps(blocks, acc[p]);
    float out[8];
    kqh_reduce(acc, out);
    for (int c = 0; c < C; c++)
        y[c * ldy] = out[c];
}

/* kqh_tile with the column count m (KQH_FEW .. KQ_GEMV_COLS) as a constant. */
DD_INLINE void kqh_row_cols(const uint8_t *w, const uint8_t *pf, const kqh_col *cols, size_t nsb, int wtype,
                            float *y, size_t ldy, size_t m)
{
    switch (m) {
    case 8: kqh_tile(w, pf, cols, nsb, wtype, y, ldy, 8); break;
    case 7: kqh_tile(w, pf, cols, nsb, wtype, y, ldy, 7); break;
    case 6: kqh_tile(w, pf, cols, nsb, wtype, y, ldy, 6); break;
    case 5: kqh_tile(w, pf, cols, nsb, wtype, y, ldy, 5); break;
    case 4: kqh_tile(w, pf, cols, nsb, wtype, y, ldy, 4); break;
    case 3: kqh_tile(w, pf, cols, nsb, wtype, y, ldy, 3); break;
    default: kqh_tile(w, pf, cols, nsb, wtype, y, ldy, 2); break;
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

/* A K-quant product (wtype) of a->m <= KQ_GEMV_COLS columns with rows of nb / 8 <= KQ_GEMV_SB super-blocks, one row
 * at a time with DD_DEFINE_GEMM's GEMV prefetches, the columns arranged at most once per thread and activations,
 * in st. One row at a time reads the matrix as one forward stream, as kq_gemv does (faster from DRAM than row
 * pairs, a little slower in L2: docs/perf/log/zen5-2026-12-07.md). The bits are the contract's (see above). */
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
    for (size_t r = 0; r < nrows; r++)
        kqh_row_cols(w + r * rb, DD_PREFETCH_AHEAD(w, rb, r, 1, rows_avail, ahead), st->cols, nsb, wtype, y + r, ldy,
                     a->m);
}

#endif
