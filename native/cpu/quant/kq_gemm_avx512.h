/* K-quant products with m > 1 columns (prompt processing) at the AVX-512 VNNI level: each super-block
 * of a row range is unpacked once per call instead of once per 4-column tile.
 *
 * Included by kernels_avx512vnni.c after its K-quant tile (kq_unpack, kq_row_scales). Layouts as
 * kquants.h gives them (ggml-common.h block_q4_K / block_q5_K / block_q6_K; values, scales and
 * mins as ggml-quants.c dequantize_row_q4_K / q5_K / q6_K and get_scale_min_k4).
 *
 * "Lanes = blocks". A pair of rows is expanded, super-block by super-block, into 8 vectors of
 * unsigned quant bytes (kqx_rows): int32 lane 8r + i of vector t holds values 4t .. 4t + 3 of the
 * 32-value block i of row r. A column's super-block is arranged alike once per row range and
 * column (kqx_col: dword i of row t = values 4t .. 4t + 3 of block i), and broadcast to both
 * halves. Eight vpdpbusd then leave each (row, block)'s whole integer sum S_i = sum(q a) in its own
 * lane, so a column costs no unpacking and no transpose-add, only the dot products and the f32
 * terms. The expanded range (KQX_W_BYTES) and the arranged columns (KQX_A_BYTES) stay in L2: the
 * callers' row ranges hold ~64 KiB of stored weights (dd_gemm_chunk_rows).
 *
 * Exactness: the K-quants' f32 terms are kquants.h's contract, lane by lane and super-block by super-block:
 *   Q4_K / Q5_K  acc_i += ((d sc_i) da_i) S_i, then acc_i -= (dmin m_i)(da_i bs_i);
 *   Q6_K         acc_i += (d da_i) I_i, I_i = sum over halves h of sc_h (S_h - 32 s_h) in int32;
 * with the row pair's factors (kqx_rows.f) and the column's da, dab in 16 f32 lanes (lane 8r + i), each
 * multiply and add rounded on its own. The lanes are in block order and reduced by kquants.h's tree
 * (kq_tree4), so every output keeps the bits of the GEMV (m == 1), of every ISA level and thread count.
 * bquants.h's 32-value block types (Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, MXFP4) take the same walk with a
 * group of 8 blocks as the super-block and that file's exact f64 terms (dd_bq_expand_row); lowbit.h's types
 * (Q2_K, Q3_K, IQ1_S .. IQ3_S) Q6_K's integers, with their offset for 32, their d and Q2_K's mins
 * (dd_lb_expand_row), in f64 terms: each product there is exact in f64, so an FMA rounds as an add would.
 */
#ifndef DELTADESK_KQ_GEMM_AVX512_H
#define DELTADESK_KQ_GEMM_AVX512_H

#define KQX_W_BYTES (274 * 1024)   /* expanded row pairs of one row range (stack): 292 of 960 bytes, a stripe of rows
                                     * (kqx_gemm_il) as long as KQX_FITS lets in (73 super-blocks) */
#define KQX_A_BYTES (128 * 1024)   /* arranged columns of one column block (stack) */

typedef struct {
    __m512i q[8];      /* vector t, int32 lane 8r + i: row r's quants 4t .. 4t + 3 of block i */
    __m512i sc[2];     /* Q6_K and lowbit.h's types: lane 8r + i of sc[h] = row r's scale of half h of block i;
                        * IQ4_XS: of sc[0], row r's ls_i - 32 */
    __m512i mn;        /* Q2_K: lane 8r + i = row r's mins of halves 0 and 1 of block i (int16 pairs) */
    union {
        __m512d s[2][2];   /* row r: lowbit.h's {d, dmin or unused}; bquants.h's {d_i, m_i} */
        __m512 f[2];       /* K-quants, lane 8r + i: Q4_K / Q5_K f[0] = d sc_i, f[1] = dmin m_i; Q6_K f[0] = d */
    };
} kqx_rows;            /* one super-block of a row pair */

typedef struct {
    uint8_t q[8][32];  /* row t, dword i: the column's values 4t .. 4t + 3 of block i */
    union {
        struct {
            __m512d da;    /* lane i: block i's scale */
            __m512d dab;   /* all but lowbit.h's: da_i times the sum of block i's values */
        };
        struct {
            __m512 fda, fdab;   /* K-quants: the same in f32, lanes i and 8 + i (dab exact: 11 + 12 bits) */
        };
    };
    __m512i s32;       /* Q6_K (Q3_K, IQ types): lane 8h + i = 32 (the type's offset) times the sum of half h of
                        * block i; Q2_K: lanes i and 8 + i = the sums of block i's halves 0 and 1 (int16 pairs);
                        * Q5_0 and the codebook types: lanes i and 8 + i = the seed of block i's dots, -16 (Q5_0)
                        * or -128 (codes + 128) times its sum */
} kqx_col;             /* one super-block of a column */

/* The 32-value block types of bquants.h that take these products too: a group of 8 blocks (IQ4_XS: its
 * super-block) is a super-block here, block i in lane i. bquants.h (included after this file) expands their
 * rows and gives a group's bytes. */
DD_INLINE int kqx_bq(int wtype)
{
    return wtype == DD_Q4_1 || wtype == DD_Q5_0 || wtype == DD_Q5_1 || wtype == DD_IQ4_NL || wtype == DD_IQ4_XS
           || wtype == DD_MXFP4;
}

/* The K-quants, whose terms are kquants.h's f32 contract (kqx_rows.f, kqx_col.fda / fdab); the other types here
 * keep exact f64 terms. */
DD_INLINE int kqx_kq(int wtype)
{
    return wtype == DD_Q4_K || wtype == DD_Q5_K || wtype == DD_Q6_K;
}

/* The bquants.h types whose dots start from a seed (kqx_col.s32). */
DD_INLINE int kqx_seeded(int wtype)
{
    return wtype == DD_Q5_0 || wtype == DD_IQ4_NL || wtype == DD_IQ4_XS || wtype == DD_MXFP4;
}

DD_INLINE void dd_bq_expand_row(const uint8_t *g, int wtype, int r, kqx_rows *e);
DD_INLINE size_t dd_bq_group_bytes(int wtype);

/* The types of lowbit.h (Q2_K, Q3_K and the IQ types; it is included after this file, expands their rows and
 * gives their sizes and offsets) take the Q6_K walk: half sums less the offset times the activations' half
 * sums, times the half scales; Q2_K (offset 0) then takes off its mins' term. */
DD_INLINE int kqx_lb(int wtype)
{
    return wtype == DD_Q2_K || wtype == DD_Q3_K || (wtype >= DD_IQ2_XXS && wtype <= DD_IQ1_M);
}

DD_INLINE void dd_lb_expand_row(const uint8_t *blk, int wtype, int r, kqx_rows *e);
DD_INLINE size_t dd_lb_bytes(int wtype);
DD_INLINE int dd_lb_offset(int wtype);

#define KQX_W_SB (KQX_W_BYTES / sizeof(kqx_rows))
#define KQX_A_SB (KQX_A_BYTES / sizeof(kqx_col))
_Static_assert(KQX_W_SB >= 4 * (KQX_A_SB / 4), "a stripe of the longest rows kqx_gemm takes must fit its buffer");

/* Stage 1 of the transpose, lane 4u + i of output s = dword 4s + u of block i of a quad of blocks
 * held in two vectors (x, y): order 0 = value order (x: blocks 0 | 1, y: 2 | 3), index
 * 16 (i / 2) + 8 (i % 2) + dword; order 1 = kq_unpack's Q4_K / Q5_K order (x: 0 | 2, y: 1 | 3),
 * index 16 (i % 2) + 8 (i / 2) + dword. */
static const int32_t kqx_quad_idx[2][2][16] = {
    { { 0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27 },
      { 4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31 } },
    { { 0, 16, 8, 24, 1, 17, 9, 25, 2, 18, 10, 26, 3, 19, 11, 27 },
      { 4, 20, 12, 28, 5, 21, 13, 29, 6, 22, 14, 30, 7, 23, 15, 31 } },
};
/* Stage 2, qwords: [quad 0 lane 2v | quad 1 lane 2v | quad 0 lane 2v + 1 | quad 1 lane 2v + 1] */
static const int64_t kqx_merge_idx[2][8] = { { 0, 1, 8, 9, 2, 3, 10, 11 }, { 4, 5, 12, 13, 6, 7, 14, 15 } };
/* s16's lane 2i + h -> lane 8h + i */
static const int32_t kqx_halves_idx[16] = { 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15 };
/* stands in for the missing partner of an odd last row (longer than any super-block's reads) */
static const uint8_t kqx_zero_block[256];

/* The 8 blocks of a super-block, as four vectors in `order` (see kqx_quad_idx), stored transposed:
 * dword i of the 32 bytes at out + t * stride = values 4t .. 4t + 3 of block i. */
DD_INLINE void kqx_transpose(const __m512i x[4], int order, uint8_t *out, size_t stride)
{
    __m512i p[2][2];
    for (int quad = 0; quad < 2; quad++)
        for (int s = 0; s < 2; s++)
            p[quad][s] = _mm512_permutex2var_epi32(x[2 * quad], _mm512_loadu_si512(kqx_quad_idx[order][s]),
                                                   x[2 * quad + 1]);
    for (int s = 0; s < 2; s++)
        for (int v = 0; v < 2; v++) {
            const __m512i z = _mm512_permutex2var_epi64(p[0][s], _mm512_loadu_si512(kqx_merge_idx[v]), p[1][s]);
            _mm256_storeu_si256((__m256i *)(out + (4 * s + 2 * v) * stride), _mm512_castsi512_si256(z));
            _mm256_storeu_si256((__m256i *)(out + (4 * s + 2 * v + 1) * stride), _mm512_extracti64x4_epi64(z, 1));
        }
}

/* Row r (0, 1) of *e from one stored super-block. */
DD_INLINE void kqx_expand_row(const uint8_t *blk, int wtype, int r, kqx_rows *e)
{
    __m512i x[4];
    __m256 d, dmin;
    kq_unpack(blk, wtype, x);
    kqx_transpose(x, wtype != DD_Q6_K, (uint8_t *)e->q + 32 * r, sizeof(__m512i));
    kq_row_scales(blk, wtype, &d, &dmin);
    float *f = (float *)e->f;
    if (wtype == DD_Q6_K) {   /* scale byte 2i + h -> lane 8r + i of sc[h] */
        const __m512i bytes = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m512i sc = _mm512_permutexvar_epi32(_mm512_loadu_si512(kqx_halves_idx), bytes);
        int32_t *lanes = (int32_t *)e->sc + 8 * r;
        _mm256_storeu_si256((__m256i *)lanes, _mm512_castsi512_si256(sc));
        _mm256_storeu_si256((__m256i *)(lanes + 16), _mm512_extracti64x4_epi64(sc, 1));
        _mm256_storeu_ps(f + 8 * r, d);
        return;
    }
    uint32_t words[4];   /* bytes 0-7: the blocks' scales, 8-15: their mins */
    dd_kq_scale_words(blk, words);
    const __m128i sm = _mm_loadu_si128((const __m128i *)words);
    _mm256_storeu_ps(f + 8 * r, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm))));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
    _mm256_storeu_ps(f + 16 + 8 * r, _mm256_mul_ps(dmin, mn));
}

/* Column super-block b0 (its first 32-value block in the acts' numbering) arranged into *p. */
DD_INLINE void kqx_col_prep(const dd_acts *a, size_t b0, int wtype, kqx_col *p)
{
    __m512i x[4];
    for (int v = 0; v < 4; v++)
        x[v] = _mm512_loadu_si512(a->q + (b0 + 2 * v) * DD_QK);
    kqx_transpose(x, 0, p->q[0], 32);
    const __m256i bs = _mm256_loadu_si256((const __m256i *)(a->bs + b0));
    if (kqx_kq(wtype)) {
        const __m256 da = _mm256_loadu_ps(a->bd + b0);
        p->fda = kq_twice(da);
        p->fdab = kq_twice(_mm256_mul_ps(da, _mm256_cvtepi32_ps(bs)));
        if (wtype == DD_Q6_K)
            p->s32 = _mm512_slli_epi32(_mm512_permutexvar_epi32(_mm512_loadu_si512(kqx_halves_idx),
                                                                _mm512_loadu_si512(a->s16 + 2 * b0)), 5);
        return;
    }
    p->da = _mm512_cvtps_pd(_mm256_loadu_ps(a->bd + b0));
    if (wtype == DD_Q2_K) {
        p->s32 = _mm512_broadcast_i64x4(_mm512_cvtepi32_epi16(_mm512_loadu_si512(a->s16 + 2 * b0)));
    } else if (kqx_lb(wtype)) {
        const __m512i s = _mm512_permutexvar_epi32(_mm512_loadu_si512(kqx_halves_idx),
                                                   _mm512_loadu_si512(a->s16 + 2 * b0));
        p->s32 = _mm512_mullo_epi32(s, _mm512_set1_epi32(dd_lb_offset(wtype)));
    } else {
        p->dab = _mm512_mul_pd(p->da, _mm512_cvtepi32_pd(bs));
    }
    if (kqx_seeded(wtype))
        p->s32 = _mm512_broadcast_i64x4(_mm256_mullo_epi32(bs, _mm256_set1_epi32(wtype == DD_Q5_0 ? -16 : -128)));
}

/* acc (lane 8r + i) += the K-quant f32 terms of pair e's super-block against column p, from the pair's
 * integers (Q4_K / Q5_K: S_i, Q6_K: I_i), in kquants.h's order. */
DD_INLINE __m512 kqx_kq_terms(const kqx_rows *e, const kqx_col *p, __m512i ints, int wtype, __m512 acc)
{
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(e->f[0], p->fda), _mm512_cvtepi32_ps(ints)));
    return wtype == DD_Q6_K ? acc : _mm512_sub_ps(acc, _mm512_mul_ps(e->f[1], p->fdab));
}

/* acc[r] += the f64 terms of row r (0, 1) of pair e's super-block against column p (bquants.h's and
 * lowbit.h's types), from the pair's integers (I_i; row r in lanes 8r .. 8r + 7): then Q4_1 / Q5_1 add
 * (da_i bs_i) m_i, bquants.h's (m_i da_i) S_i, and Q2_K takes off (dmin da_i) M_i (its mins' integers, mins).
 * MXFP4's scale is bquants.h's f32 product da_i d_i (exact unless beyond the f32 range; then its rounding). */
DD_INLINE void kqx_terms(const kqx_rows *e, const kqx_col *p, __m512i ints, __m512i mins, int wtype, __m512d acc[2])
{
    for (int r = 0; r < 2; r++) {
        const __m512d s = _mm512_cvtepi32_pd(r ? _mm512_extracti64x4_epi64(ints, 1) : _mm512_castsi512_si256(ints));
        const __m512d scale = wtype == DD_MXFP4 ? _mm512_cvtps_pd(_mm256_mul_ps(_mm512_cvtpd_ps(p->da),
                                                                                _mm512_cvtpd_ps(e->s[r][0])))
                                                : _mm512_mul_pd(p->da, e->s[r][0]);
        acc[r] = _mm512_fmadd_pd(scale, s, acc[r]);
        if (wtype == DD_Q4_1 || wtype == DD_Q5_1)
            acc[r] = _mm512_fmadd_pd(p->dab, e->s[r][1], acc[r]);
        else if (wtype == DD_Q2_K)
            acc[r] = _mm512_fnmadd_pd(_mm512_mul_pd(p->da, e->s[r][1]),
                                      _mm512_cvtepi32_pd(r ? _mm512_extracti64x4_epi64(mins, 1)
                                                           : _mm512_castsi512_si256(mins)), acc[r]);
    }
}

/* s[pp][c] += the products of vectors [t0, t0 + 4) of P pairs' super-block with C columns'. */
DD_INLINE void kqx_dots(const kqx_rows *const e[2], const kqx_col *const p[4], int t0, __m512i s[2][4],
                        const int P, const int C)
{
    for (int t = t0; t < t0 + 4; t++)
        for (int c = 0; c < C; c++) {
            const __m512i av = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p[c]->q[t]));
            for (int pp = 0; pp < P; pp++)
                s[pp][c] = _mm512_dpbusd_epi32(s[pp][c], _mm512_load_si512(&e[pp]->q[t]), av);
        }
}

DD_INLINE void kqx_zero(__m512i s[2][4], const int P, const int C)
{
    for (int pp = 0; pp < P; pp++)
        for (int c = 0; c < C; c++)
            s[pp][c] = _mm512_setzero_si512();
}

/* Q6_K and lowbit.h's types: the pairs' integer sums of half h, minus the offset times s_h (none for Q2_K),
 * times sc_h. */
DD_INLINE void kqx_q6_half(const kqx_rows *const e[2], const kqx_col *const p[4], int h, int wtype, __m512i s[2][4],
                           const int P, const int C)
{
    for (int c = 0; c < C; c++)
        for (int pp = 0; pp < P; pp++) {
            __m512i x = s[pp][c];
            if (wtype != DD_Q2_K)
                x = _mm512_sub_epi32(x, _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)&p[c]->s32 + h)));
            s[pp][c] = _mm512_mullo_epi32(x, e[pp]->sc[h]);
        }
}

/* Eight (row, column) f64 accumulators of bquants.h's and lowbit.h's types, each summed in block order,
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), eight at a time, and rounded to f32: lane j
 * of the result is v[j]'s sum. */
DD_INLINE __m256 kqx_reduce8(const __m512d v[8])
{
    __m512d s1[4], s2[2];
    for (int j = 0; j < 4; j++)   /* 128-bit lane L: (l2L + l2L+1) of v[2j], of v[2j + 1] */
        s1[j] = _mm512_add_pd(_mm512_unpacklo_pd(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_pd(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 2; j++)   /* lanes: l0-3 of v[4j], v[4j + 1], l4-7 of them, then of v[4j + 2], v[4j + 3] */
        s2[j] = _mm512_add_pd(_mm512_shuffle_f64x2(s1[2 * j], s1[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f64x2(s1[2 * j], s1[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_cvtpd_ps(_mm512_add_pd(_mm512_shuffle_f64x2(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_f64x2(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1))));
}

/* Rows [0, 2P) of P expanded pairs (pair pp's super-block sb at e[pp * nsb + sb]) against C
 * arranged columns (column c's at cols[c * nsb + sb]) into y (column c at y + c * ldy); rows >= nr
 * (an odd range's zero partner) are not stored. */
DD_INLINE void kqx_tile(const kqx_rows *e, const kqx_col *cols, size_t nsb, int wtype, float *y, size_t ldy,
                        size_t nr, const int P, const int C)
{
    __m512d acc[2][4][2];
    __m512 facc[2][4];   /* the K-quants' */
    for (int pp = 0; pp < P; pp++)
        for (int c = 0; c < C; c++) {
            acc[pp][c][0] = acc[pp][c][1] = _mm512_setzero_pd();
            facc[pp][c] = _mm512_setzero_ps();
        }
    for (size_t sb = 0; sb < nsb; sb++) {
        const kqx_rows *const ep[2] = { e + sb, e + (P > 1 ? nsb : 0) + sb };
        const kqx_col *cp[4];
        for (int c = 0; c < 4; c++)
            cp[c] = cols + (c < C ? c : 0) * nsb + sb;
        __m512i s[2][4], s1[2][4];
        kqx_zero(s, P, C);
        if (kqx_seeded(wtype))
            for (int pp = 0; pp < P; pp++)
                for (int c = 0; c < C; c++)
                    s[pp][c] = _mm512_load_si512(&cp[c]->s32);
        kqx_dots(ep, cp, 0, s, P, C);
        if (wtype == DD_Q6_K || kqx_lb(wtype)) {
            kqx_q6_half(ep, cp, 0, wtype, s, P, C);
            kqx_zero(s1, P, C);
            kqx_dots(ep, cp, 4, s1, P, C);
            kqx_q6_half(ep, cp, 1, wtype, s1, P, C);
            for (int pp = 0; pp < P; pp++)
                for (int c = 0; c < C; c++)
                    s[pp][c] = _mm512_add_epi32(s[pp][c], s1[pp][c]);
        } else {
            kqx_dots(ep, cp, 4, s, P, C);
        }
        if (wtype == DD_IQ4_XS)
            for (int pp = 0; pp < P; pp++)
                for (int c = 0; c < C; c++)
                    s[pp][c] = _mm512_mullo_epi32(s[pp][c], ep[pp]->sc[0]);
        for (int pp = 0; pp < P; pp++)
            for (int c = 0; c < C; c++) {   /* Q2_K: M_i = mn_0 s_0 + mn_1 s_1, one vpmaddwd (|s_h| < 2^11) */
                if (kqx_kq(wtype)) {
                    facc[pp][c] = kqx_kq_terms(ep[pp], cp[c], s[pp][c], wtype, facc[pp][c]);
                    continue;
                }
                const __m512i mins = wtype == DD_Q2_K ? _mm512_madd_epi16(ep[pp]->mn, cp[c]->s32)
                                                      : _mm512_setzero_si512();
                kqx_terms(ep[pp], cp[c], s[pp][c], mins, wtype, acc[pp][c]);
            }
    }
    float out[16];
    int n = 0;
    if (kqx_kq(wtype)) {   /* lane j of group g / 4: pair (c, pp) = g + j's first row, lane 4 + j its second */
        __m512 v[8];
        for (int c = 0; c < C; c++)
            for (int pp = 0; pp < P; pp++)
                v[n++] = facc[pp][c];
        for (; n % 4; n++)
            v[n] = _mm512_setzero_ps();
        for (int g = 0; g < n; g += 4) {
            float t[8];
            _mm256_storeu_ps(t, kq_tree4(v + g));
            for (int j = 0; j < 4; j++) {
                out[2 * (g + j)] = t[j];
                out[2 * (g + j) + 1] = t[4 + j];
            }
        }
    } else {
        __m512d v[16];
        for (int c = 0; c < C; c++)
            for (int pp = 0; pp < P; pp++)
                for (int r = 0; r < 2; r++)
                    v[n++] = acc[pp][c][r];
        for (; n % 8; n++)
            v[n] = _mm512_setzero_pd();
        for (int g = 0; g < n; g += 8)
            _mm256_storeu_ps(out + g, kqx_reduce8(v + g));
    }
    n = 0;
    for (int c = 0; c < C; c++)
        for (int r = 0; r < 2 * P; r++, n++)
            if ((size_t)r < nr)
                y[c * ldy + r] = out[n];
}

/* P expanded pairs against nc arranged columns: tiles of 4 columns, then the 1-3 left over. */
DD_INLINE void kqx_columns(const kqx_rows *e, const kqx_col *cols, size_t nc, size_t nsb, int wtype, float *y,
                           size_t ldy, size_t nr, const int P)
{
    size_t c = 0;
    for (; c + 4 <= nc; c += 4)
        kqx_tile(e, cols + c * nsb, nsb, wtype, y + c * ldy, ldy, nr, P, 4);
    switch (nc - c) {
    case 3: kqx_tile(e, cols + c * nsb, nsb, wtype, y + c * ldy, ldy, nr, P, 3); break;
    case 2: kqx_tile(e, cols + c * nsb, nsb, wtype, y + c * ldy, ldy, nr, P, 2); break;
    case 1: kqx_tile(e, cols + c * nsb, nsb, wtype, y + c * ldy, ldy, nr, P, 1); break;
    default: break;
    }
}

/* Prefetch stored row r (every line of its rb bytes) when it is one of the rows_avail rows at w. */
DD_INLINE void kqx_prefetch_row(const uint8_t *w, size_t rb, size_t r, size_t rows_avail)
{
    if (r >= rows_avail)
        return;
    const uint8_t *row = w + r * rb;
    for (size_t at = 0; at < rb; at += 64)
        dd_prefetch_weight(row + at);
    dd_prefetch_weight(row + rb - 1);
}

/* The expanded pairs of one row range (np pairs, nr rows; pair p's super-block sb at e[p * nsb + sb]) against
 * all columns -> y (rows from 0): column blocks of up to KQX_A_SB super-blocks arranged once into cols, met in
 * tiles of P pairs. */
DD_INLINE void kqx_range(const kqx_rows *e, size_t np, size_t nr, const dd_acts *a, kqx_col *cols, float *y,
                         size_t ldy, int wtype, const int P)
{
    const size_t nsb = a->nb / 8, cmax = KQX_A_SB / nsb / 4 * 4;
    for (size_t c0 = 0; c0 < a->m; c0 += cmax) {
        const size_t nc = a->m - c0 < cmax ? a->m - c0 : cmax;
        for (size_t c = 0; c < nc; c++)
            for (size_t sb = 0; sb < nsb; sb++)
                kqx_col_prep(a, (c0 + c) * a->nbp + 8 * sb, wtype, &cols[c * nsb + sb]);
        size_t p = 0;
        for (; p + P <= np; p += P)
            kqx_columns(e + p * nsb, cols, nc, nsb, wtype, y + c0 * ldy + 2 * p, ldy, nr - 2 * p, P);
        if (p < np)
            kqx_columns(e + p * nsb, cols, nc, nsb, wtype, y + c0 * ldy + 2 * p, ldy, nr - 2 * p, 1);
    }
}

/* Rows [0, nrows) x all columns: row ranges of up to KQX_W_SB super-blocks of pairs expanded once, then
 * kqx_range. While a pair is expanded the rows DD_PREFETCH_ROWS further on (of the rows_avail that follow w)
 * are prefetched: the expansion is the only reader of the stored weights, and a demand miss per super-block
 * stalled it (the loads of d and the scales were the hottest instructions of the call). */
DD_INLINE void kqx_gemm(const uint8_t *w, size_t rb, size_t nrows, size_t rows_avail, const dd_acts *a, float *y,
                        size_t ldy, int wtype, const int P)
{
    kqx_rows e[KQX_W_SB];
    kqx_col cols[KQX_A_SB];
    const size_t nsb = a->nb / 8, range = KQX_W_SB / nsb * 2;
    const size_t bytes = kqx_bq(wtype) ? dd_bq_group_bytes(wtype) : kqx_lb(wtype) ? dd_lb_bytes(wtype)
                         : wtype == DD_Q4_K ? DD_Q4_K_BYTES : wtype == DD_Q5_K ? DD_Q5_K_BYTES : DD_Q6_K_BYTES;
    for (size_t r = 0; r < DD_PREFETCH_ROWS && r < nrows; r++)   /* the first rows, all in flight at once */
        kqx_prefetch_row(w, rb, r, rows_avail);
    for (size_t r0 = 0; r0 < nrows; r0 += range) {
        const size_t nr = nrows - r0 < range ? nrows - r0 : range, np = (nr + 1) / 2;
        for (size_t p = 0; p < np; p++) {
            kqx_prefetch_row(w, rb, r0 + 2 * p + DD_PREFETCH_ROWS, rows_avail);
            kqx_prefetch_row(w, rb, r0 + 2 * p + 1 + DD_PREFETCH_ROWS, rows_avail);
            for (size_t sb = 0; sb < nsb; sb++) {
                const uint8_t *blk = w + (r0 + 2 * p) * rb + sb * bytes;
                const uint8_t *next = 2 * p + 1 < nr ? blk + rb : kqx_zero_block;
                if (kqx_bq(wtype)) {
                    dd_bq_expand_row(blk, wtype, 0, &e[p * nsb + sb]);
                    dd_bq_expand_row(next, wtype, 1, &e[p * nsb + sb]);
                } else if (kqx_lb(wtype)) {
                    dd_lb_expand_row(blk, wtype, 0, &e[p * nsb + sb]);
                    dd_lb_expand_row(next, wtype, 1, &e[p * nsb + sb]);
                } else {
                    kqx_expand_row(blk, wtype, 0, &e[p * nsb + sb]);
                    kqx_expand_row(next, wtype, 1, &e[p * nsb + sb]);
                }
            }
        }
        kqx_range(e, np, nr, a, cols, y + r0, ldy, wtype, P);
    }
}

/* kqx_gemm runs when 4 columns' super-blocks fit the scratch (k up to 256 * KQX_A_SB / 4 = 18688
 * values); a longer k keeps kernels_avx512vnni.c's K-quant walk (DD_DEFINE_GEMM_SPLIT). */
#define KQX_FITS(a) ((a)->nb / 8 <= KQX_A_SB / 4)
#define KQX_GEMM_Q4_K(w, rb, n, avail, a, y, ldy) kqx_gemm(w, rb, n, avail, a, y, ldy, DD_Q4_K, 2)
#define KQX_GEMM_Q5_K(w, rb, n, avail, a, y, ldy) kqx_gemm(w, rb, n, avail, a, y, ldy, DD_Q5_K, 2)
#define KQX_GEMM_Q6_K(w, rb, n, avail, a, y, ldy) kqx_gemm(w, rb, n, avail, a, y, ldy, DD_Q6_K, 2)

/* NAME, the product of a bquants.h or lowbit.h type whose other route is OTHER (a dd_gemm_fn): MIN_COLS or more
 * columns of whole super-blocks (k a multiple of 256) that the buffers hold go to kqx_gemm, the rest to OTHER;
 * the same bits either way. MIN_COLS is where the expansion stops losing to OTHER (one thread, in cache;
 * docs/perf/log/q8-bq-2026-12-06.md). */
#define KQX_GEMM_FROM(NAME, WTYPE, MIN_COLS, OTHER)                                                            \
    static void NAME(const uint8_t *w, size_t rb, size_t nrows, size_t rows_avail, const dd_acts *a, float *y, \
                     size_t ldy)                                                                               \
    {                                                                                                          \
        if (a->m >= (MIN_COLS) && a->nb % 8 == 0 && KQX_FITS(a))                                              \
            kqx_gemm(w, rb, nrows, rows_avail, a, y, ldy, WTYPE, 2);                                           \
        else                                                                                                   \
            OTHER(w, rb, nrows, rows_avail, a, y, ldy);                                                        \
    }


#endif
