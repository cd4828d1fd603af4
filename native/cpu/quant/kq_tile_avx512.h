/* K-quant decode tiles at the AVX-512 VNNI level (Q4_K, Q5_K, Q6_K), and the products that use
 * them: the GEMV (m == 1) with its column prepared once per thread and activations, the m > 1 split into
 * kq_gemm_avx512.h. Included once by kernels_avx512vnni.c (after kq_transpose_add, gemm_tiles.h, runtime.h
 * and kernels.h); it defines gemm_q4_K, gemm_q5_K and gemm_q6_K for that file's kernel table.
 */
#ifndef DELTADESK_KQ_TILE_AVX512_H
#define DELTADESK_KQ_TILE_AVX512_H

/* K-quant tiles (Q4_K, Q5_K, Q6_K; layouts and exactness argument in kquants.h), reading the stored
 * super-blocks in registers. A super-block's 256 quants become 4 vectors of 64 unsigned bytes, each
 * meeting one vector of the column's activations (kq_col_prep):
 *   Q4_K / Q5_K: qs bytes 0-63 and 64-127, low nibbles then high ones: the low nibbles of bytes
 *     0-63 are values 0-31 and 64-95, so the activation vectors are [a0-31 | a64-95],
 *     [a32-63 | a96-127], [a128-159 | a192-223], [a160-191 | a224-255]; Q5_K adds bit 2j or
 *     2j + 1 of qh[l] as 16 (vptestmb picks it per byte); Q4_K's high nibbles stay in place
 *     (qs & 0xf0, one instruction instead of a shift and a mask): their block sums come out 16
 *     times too large, exact in int32, and one arithmetic shift per row pair divides them back;
 *   Q6_K: ql bytes 64n .. 64n + 63 (n = 0, 1), low nibbles = values 128n + 0..63, high = 128n +
 *     64..127, in value order; the two high bits come from qh[32n + l] shifted into bits 4-5.
 * vpdpbusd gives 4-value partial sums; a transpose-add within 128-bit lanes puts the 16-value
 * quarter k of vector j in lane 4k + j (Q6_K: times its half scale, minus 32 times the activation
 * half sum). The two quarters of each 32-value block are 128-bit lanes (0, 1) and (2, 3); one pair
 * of 128-bit shuffles adds them for two rows at once, leaving row A's 8 block integers in lanes
 * 0-7 and row B's in lanes 8-15, in the block order KQ_ORDER (not value order: the f32 lanes keep
 * that order to the end, where they are put back in block order and summed).
 *
 * The f32 terms are kquants.h's contract, lane by lane: a row pair's 16 block integers meet the
 * column's da (and dab = da bs, exact) duplicated in both 256-bit halves; Q4_K / Q5_K take
 * ((d sc_i) da_i) S_i, the row's exact d sc_i formed once per super-block for all columns (no
 * multiply of the integers by the scales), then less (dmin m_i)(da_i bs_i); Q6_K (d da_i) I_i. Each
 * multiply and add rounds on its own (no FMA), in kquants.h's order; kq_tree4 sums the lanes in block
 * order by kquants.h's tree. */
typedef struct {
    __m512i v[4];
    __m512i seed[4];  /* Q6_K: vpdpbusd's start for vector j: -32 s_h in dword 4k of the lanes whose
                       * quarter k of vector j is half h (the transpose-add carries it into lane 4k + j) */
    __m512 da;        /* the 8 activation block scales, block KQ_ORDER[l] in lanes l and 8 + l */
    __m512 dab;       /* Q4_K / Q5_K: da times the block's activation sum, same lanes */
} kq_col;

/* lane l of a row's 8 f32 lanes holds block KQ_ORDER[t][l] (t = 0: Q4_K / Q5_K, 1: Q6_K) */
static const int32_t kq_order[2][8] = { { 0, 1, 4, 5, 2, 3, 6, 7 }, { 0, 2, 4, 6, 1, 3, 5, 7 } };
/* lane l of a row pair's accumulator <- its lane holding block l (kq_order inverted, both rows) */
static const int32_t kq_block_lanes[2][16] = { { 0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15 },
                                               { 0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15 } };
static const int32_t kq_half_lane[16] = { 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15 };

DD_INLINE __m512i kq_pair(const int8_t *a, int lo, int hi)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a + lo))),
                              _mm256_loadu_si256((const __m256i *)(a + hi)), 1);
}

/* v in both 256-bit halves. */
DD_INLINE __m512 kq_twice(__m256 v)
{
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v)));
}

/* Rows a (lanes 0-7) and b (8-15) of a pair: x broadcast to the first half, y to the second. */
DD_INLINE __m512 kq_halves(float x, float y)
{
    return _mm512_mask_mov_ps(_mm512_set1_ps(x), 0xff00, _mm512_set1_ps(y));
}

/* Four row-pair accumulators v[j] (16 f32 lanes in block order: row 2 p's 8 lanes, then row 2 p + 1's) summed by
 * kquants.h's tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) (an add rounds alike with its operands
 * swapped): lane j of the result is v[j]'s first row, lane 4 + j its second. */
DD_INLINE __m256 kq_tree4(const __m512 v[4])
{
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_ps(v[2], v[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(v[2], v[3], _MM_SHUFFLE(3, 1, 3, 1)));
    /* 128-bit lane L: the quads (l4h .. l4h+3, h = L % 2) of row L / 2 of v[0], v[1], v[2], v[3] */
    const __m512 q = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(q, q, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(q, q, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_castps512_ps256(t);
}

/* Super-block b0's activations (b0: its first 32-value block in the acts' numbering) as kq_col's v, and the f32
 * block scales da and (Q4_K / Q5_K; Q6_K: 0) dab = da times the block's sum (exact: 11 + 12 bits), block
 * KQ_ORDER[l] in lane l; the few-column layout (kqh_few_avx512.h) starts from the same values. */
DD_INLINE void kq_col_vectors(const dd_acts *a, size_t b0, int wtype, __m512i v[4], __m256 *da, __m256 *dab)
{
    const int8_t *q = a->q + b0 * DD_QK;
    const __m256i order = _mm256_loadu_si256((const __m256i *)kq_order[wtype == DD_Q6_K]);
    *da = _mm256_permutexvar_ps(order, _mm256_loadu_ps(a->bd + b0));
    if (wtype == DD_Q6_K) {
        for (int j = 0; j < 4; j++)
            v[j] = _mm512_loadu_si512(q + 64 * j);
        *dab = _mm256_setzero_ps();
        return;
    }
    v[0] = kq_pair(q, 0, 64);
    v[1] = kq_pair(q, 32, 96);
    v[2] = kq_pair(q, 128, 192);
    v[3] = kq_pair(q, 160, 224);
    const __m256i bs = _mm256_permutexvar_epi32(order, _mm256_loadu_si256((const __m256i *)(a->bs + b0)));
    *dab = _mm256_mul_ps(*da, _mm256_cvtepi32_ps(bs));
}

/* Column c0 + c's activations of super-block sb, arranged once for the rows of a tile. */
DD_INLINE void kq_col_prep(const dd_acts *a, size_t b0, int wtype, kq_col *p)
{
    __m256 da, dab;
    kq_col_vectors(a, b0, wtype, p->v, &da, &dab);
    p->da = kq_twice(da);
    p->dab = kq_twice(dab);
    if (wtype == DD_Q6_K) {
        const __m512i s32 = _mm512_slli_epi32(   /* lane 4k + j: 32 times the sum of quarter k of vector j's half */
            _mm512_permutexvar_epi32(_mm512_loadu_si512(kq_half_lane), _mm512_loadu_si512(a->s16 + 2 * b0)), 5);
        const __m512i neg = _mm512_sub_epi32(_mm512_setzero_si512(), s32);
        const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
        for (int j = 0; j < 4; j++)   /* dword 4k of seed j = lane 4k + j of -s32, the other dwords 0 */
            p->seed[j] = _mm512_maskz_permutexvar_epi32(0x1111, _mm512_add_epi32(quad, _mm512_set1_epi32(j)), neg);
    }
}

/* The 8 scales and 8 mins of four Q4_K / Q5_K super-blocks (rows 0-3 at blk[0..3]), each in KQ_ORDER[0]:
 * 128-bit lane 2p holds row pair p's scales (bytes 0-7 row 2p's, 8-15 row 2p + 1's), lane 2p + 1 their
 * mins; as dd_kq_scale_words (kernels.h), on the 12 scale bytes at blk + 4 (words s0 s1 s2; s3 unused),
 * one row to a 128-bit lane, all four at once. */
DD_INLINE __m512i kq_scale_bytes4(const uint8_t *const blk[4])
{
    __m512i s = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(blk[0] + 4)));
    s = _mm512_inserti32x4(s, _mm_loadu_si128((const __m128i *)(blk[1] + 4)), 1);
    s = _mm512_inserti32x4(s, _mm_loadu_si128((const __m128i *)(blk[2] + 4)), 2);
    s = _mm512_inserti32x4(s, _mm_loadu_si128((const __m128i *)(blk[3] + 4)), 3);
    const __m512i a = _mm512_shuffle_epi32(s, _MM_SHUFFLE(2, 1, 2, 0));   /* s0 s2 s1 s2 */
    const __m512i b = _mm512_shuffle_epi32(s, _MM_SHUFFLE(1, 1, 0, 0));   /* s0 s0 s1 s1 */
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(b, 2), _mm512_set4_epi32(0x30303030, 0, 0x30303030, 0));
    /* (a >> (0, 0, 0, 4)) & (0x3f.., 0x0f.., 0x3f.., 0x0f..) | hi */
    const __m512i lohi = _mm512_ternarylogic_epi32(_mm512_srlv_epi32(a, _mm512_set4_epi32(4, 0, 0, 0)),
                                                   _mm512_set4_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f),
                                                   hi, 0xea);
    const __m512i o = _mm512_shuffle_epi8(lohi, _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12,
                                                                                     13, 10, 11, 14, 15)));
    /* each row's lane is [its 8 scales | its 8 mins]: pair the rows' scales, then their mins */
    return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 1, 3, 4, 6, 5, 7), o);
}

/* A super-block row's 256 quants as 4 vectors of unsigned bytes matching kq_col's v. */
DD_INLINE void kq_unpack(const uint8_t *blk, int wtype, __m512i w[4])
{
    const __m512i low = _mm512_set1_epi8(0x0f);
    if (wtype == DD_Q6_K) {
        const __m512i two = _mm512_set1_epi8(0x30);
        const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
        const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        for (int n = 0; n < 2; n++) {
            const __m512i l = _mm512_loadu_si512(blk + 64 * n);
            const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n)));
            w[2 * n] = _mm512_ternarylogic_epi32(_mm512_and_si512(l, low), _mm512_sllv_epi16(h, up), two, 0xf8);
            w[2 * n + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l, 4), low),
                                                     _mm512_srlv_epi16(h, down), two, 0xf8);
        }
        return;
    }
    const uint8_t *qs = blk + (wtype == DD_Q5_K ? 48 : 16);
    for (int n = 0; n < 2; n++) {
        const __m512i q = _mm512_loadu_si512(qs + 64 * n);
        w[2 * n] = _mm512_and_si512(q, low);
        w[2 * n + 1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
    }
    if (wtype == DD_Q5_K) {
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
        const __m512i sixteen = _mm512_set1_epi8(0x10);
        for (int j = 0; j < 4; j++) {
            /* vector j = 2n + t holds chunks 2n (low 32 bytes) and 2n + 1: bits 2(2n) + t, 2(2n + 1) + t */
            const int b0 = 4 * (j / 2) + j % 2, b1 = b0 + 2;
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << b0)), _mm256_set1_epi8((char)(1 << b1)), 1);
            w[j] = _mm512_mask_add_epi8(w[j], _mm512_test_epi8_mask(h, bit), w[j], sixteen);
        }
    }
}

/* Lane 4k + j = the quarter (128-bit lane) k of row blk's products with column p (Q6_K: already
 * times its half scale, minus 32 sc_h times the activation half sum; Q4_K: vectors 1 and 3, the
 * high nibbles, 16 times their products, exact in int32: |16 S| < 16 * 15 * 127 * 32 < 2^20). */
DD_INLINE __m512i kq_quarters(const uint8_t *blk, int wtype, const kq_col *p)
{
    __m512i w[4], d[4];
    if (wtype == DD_Q4_K)
        for (int n = 0; n < 2; n++) {   /* the high nibbles left in place: 16 times their value (kq_row_pair) */
            const __m512i q = _mm512_loadu_si512(blk + 16 + 64 * n);
            w[2 * n] = _mm512_and_si512(q, _mm512_set1_epi8(0x0f));
            w[2 * n + 1] = _mm512_and_si512(q, _mm512_set1_epi8((char)0xf0));
        }
    else
        kq_unpack(blk, wtype, w);
    for (int j = 0; j < 4; j++)
        d[j] = _mm512_dpbusd_epi32(wtype == DD_Q6_K ? p->seed[j] : _mm512_setzero_si512(), w[j], p->v[j]);
    __m512i t = kq_transpose_add(d);
    if (wtype == DD_Q6_K) {
        const __m512i scl = _mm512_cvtepi8_epi32(
            _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(blk + 192)),
                             _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)));
        t = _mm512_mullo_epi32(t, scl);
    }
    return t;
}

/* The f16 scale at blk (and, Q4_K / Q5_K, dmin at blk + 2) widened, broadcast to 8 f32 lanes. */
DD_INLINE void kq_row_scales(const uint8_t *blk, int wtype, __m256 *d, __m256 *dmin)
{
    uint32_t bits;
    memcpy(&bits, blk + (wtype == DD_Q6_K ? 208 : 0), 4);
    const __m128 f = _mm_maskz_cvtph_ps(0x3, _mm_cvtsi32_si128((int)bits));   /* the EVEX form: no F16C flag here */
    *d = _mm256_broadcastss_ps(f);
    *dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(f));
}

/* The f16 scales of a tile's R rows at one super-block (row r at w + r * rb), widened in one conversion:
 * ds[2r] = d, ds[2r + 1] = dmin (Q6_K: 0). */
DD_INLINE void kq_tile_scales(const uint8_t *w, size_t rb, int wtype, const int R, float ds[8])
{
    uint32_t h[4] = { 0, 0, 0, 0 };
    for (int r = 0; r < R; r++) {
        uint16_t d, dmin = 0;
        memcpy(&d, w + r * rb + (wtype == DD_Q6_K ? 208 : 0), 2);
        if (wtype != DD_Q6_K)
            memcpy(&dmin, w + r * rb + 2, 2);
        h[r] = d | (uint32_t)dmin << 16;
    }
    const __m128i v = _mm_set_epi64x((int64_t)((uint64_t)h[3] << 32 | h[2]), (int64_t)((uint64_t)h[1] << 32 | h[0]));
    _mm256_storeu_ps(ds, _mm256_maskz_cvtph_ps(0xff, v));   /* the EVEX form: no F16C flag here */
}

/* A row pair's factors of one super-block (rows a, b in lanes 0-7, 8-15, block KQ_ORDER[t][l] in lane l):
 * Q4_K / Q5_K f[0] = d sc_i and f[1] = dmin m_i, each exact (an f16 value times a 6-bit integer); Q6_K
 * f[0] = d. ds: the pair's d, dmin, d, dmin (kq_tile_scales); sc, mn: kq_scale_bytes4's bytes of the pair. */
DD_INLINE void kq_pair_factors(const float *ds, __m128i sc, __m128i mn, int wtype, __m512 f[2])
{
    f[0] = kq_halves(ds[0], ds[2]);
    if (wtype == DD_Q6_K)
        return;
    f[1] = _mm512_mul_ps(kq_halves(ds[1], ds[3]), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
    f[0] = _mm512_mul_ps(f[0], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
}

/* Two rows (blk_a, blk_b; blk_b unread unless both) of a super-block against column p: acc (row a in lanes
 * 0-7, row b in 8-15) += their f32 terms, the pair's factors f (kq_pair_factors), in kquants.h's order. */
DD_INLINE void kq_row_pair(const uint8_t *blk_a, const uint8_t *blk_b, int wtype, const kq_col *p, const __m512 f[2],
                           __m512 *acc, const int both)
{
    const __m512i ta = kq_quarters(blk_a, wtype, p), tb = both ? kq_quarters(blk_b, wtype, p) : ta;
    __m512i s = _mm512_add_epi32(_mm512_shuffle_i32x4(ta, tb, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_i32x4(ta, tb, _MM_SHUFFLE(3, 1, 3, 1)));
    if (wtype == DD_Q4_K)   /* lanes 1, 3, 5, 7 of each row (the high nibbles' blocks): 16 S, an exact shift back */
        s = _mm512_srav_epi32(s, _mm512_set4_epi32(4, 0, 4, 0));
    *acc = _mm512_add_ps(*acc, _mm512_mul_ps(_mm512_mul_ps(f[0], p->da), _mm512_cvtepi32_ps(s)));
    if (wtype != DD_Q6_K)
        *acc = _mm512_sub_ps(*acc, _mm512_mul_ps(f[1], p->dab));
}

/* Rows [0, R) x columns [c0, c0 + C) (gemm_tiles.h's TILE). pre: NULL, or the columns' super-blocks
 * already prepared by kq_col_prep, column c0 + c's super-block sb at pre[c * nsb + sb]. */
DD_INLINE void kq_tile(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, int wtype, size_t c0,
                       float *y, size_t ldy, const int R, const int C, const kq_col *pre)
{
    const size_t bytes = wtype == DD_Q4_K ? DD_Q4_K_BYTES : wtype == DD_Q5_K ? DD_Q5_K_BYTES : DD_Q6_K_BYTES;
    const size_t nsb = a->nb / 8;
    const int P = (R + 1) / 2;
    __m512 acc[2][4];   /* row pair, column */
    for (int p = 0; p < P; p++)
        for (int c = 0; c < C; c++)
            acc[p][c] = _mm512_setzero_ps();
    for (size_t sb = 0; sb < nsb; sb++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *q = pf + r * rb + sb * bytes;
            for (size_t at = 0; at < bytes; at += 64)
                dd_prefetch_weight(q + at);
            dd_prefetch_weight(q + bytes - 1);
        }
        float ds[8];
        kq_tile_scales(w + sb * bytes, rb, wtype, R, ds);
        __m512i sm = _mm512_setzero_si512();   /* Q4_K / Q5_K: the rows' scales and mins (rows past R repeat the last) */
        if (wtype != DD_Q6_K) {
            const uint8_t *blk[4];
            for (int r = 0; r < 4; r++)
                blk[r] = w + (r < R ? r : R - 1) * rb + sb * bytes;
            sm = kq_scale_bytes4(blk);
        }
        __m512 f[2][2];
        for (int p = 0; p < P; p++)
            kq_pair_factors(ds + 4 * p, p ? _mm512_extracti32x4_epi32(sm, 2) : _mm512_castsi512_si128(sm),
                            p ? _mm512_extracti32x4_epi32(sm, 3) : _mm512_extracti32x4_epi32(sm, 1), wtype, f[p]);
        for (int c = 0; c < C; c++) {
            kq_col own;
            const kq_col *col = pre ? &pre[c * nsb + sb] : &own;
            if (!pre)
                kq_col_prep(a, (c0 + c) * a->nbp + 8 * sb, wtype, &own);
            for (int p = 0; p < P; p++)
                kq_row_pair(w + 2 * p * rb + sb * bytes, w + (2 * p + 1) * rb + sb * bytes, wtype, col, f[p],
                            &acc[p][c], 2 * p + 1 < R);
        }
    }
    /* lanes back in block order, then kquants.h's tree */
    const __m512i order = _mm512_loadu_si512(kq_block_lanes[wtype == DD_Q6_K]);
    __m512 v[8];
    int n = 0;
    for (int c = 0; c < C; c++)
        for (int p = 0; p < P; p++)
            v[n++] = _mm512_permutexvar_ps(order, acc[p][c]);
    for (; n % 4; n++)
        v[n] = _mm512_setzero_ps();
    for (int g = 0; g < n; g += 4) {
        float out[8];
        _mm256_storeu_ps(out, kq_tree4(v + g));
        for (int j = 0; j < 4 && g + j < C * P; j++) {
            const int c = (g + j) / P, r = 2 * ((g + j) % P);
            y[(c0 + c) * ldy + r] = out[j];
            if (r + 1 < R)
                y[(c0 + c) * ldy + r + 1] = out[4 + j];
        }
    }
}
#define KQ_TILE_Q4_K(w, pf, rb, a, c0, y, ldy, R, C) kq_tile(w, pf, rb, a, DD_Q4_K, c0, y, ldy, R, C, NULL)
#define KQ_TILE_Q5_K(w, pf, rb, a, c0, y, ldy, R, C) kq_tile(w, pf, rb, a, DD_Q5_K, c0, y, ldy, R, C, NULL)
#define KQ_TILE_Q6_K(w, pf, rb, a, c0, y, ldy, R, C) kq_tile(w, pf, rb, a, DD_Q6_K, c0, y, ldy, R, C, NULL)
DD_DEFINE_GEMM(tiles_q4_K, KQ_TILE_Q4_K)
DD_DEFINE_GEMM(tiles_q5_K, KQ_TILE_Q5_K)
DD_DEFINE_GEMM(tiles_q6_K, KQ_TILE_Q6_K)

/* Super-blocks of a GEMV column prepared at most once per thread and activations (k <= 8192; 20 KiB):
 * the tiles then read them from L1 instead of arranging them again for every 4 rows. */
#define KQ_GEMV_SB 32
/* Columns the few-column products take (a batched decode's rows): kqh_few_avx512.h's from KQH_FEW
 * (kq_gemv below, and if that scratch cannot be had: each 4-row tile meeting the columns 4 at a time,
 * its super-blocks in L1, so the weights are read from memory once for all of them); more columns go to
 * kq_gemm_avx512.h's prompt GEMM, whose per-call column arrangement pays off only over many columns. */
#define KQ_GEMV_COLS 8

/* A thread's last GEMV columns (kq_col_prep of each super-block), with the activations (dd_acts.id)
 * and layout (q6: 1 for Q6_K, 0 for Q4_K / Q5_K) it was prepared for, in the thread's scratch
 * (DD_SCRATCH_KQ_COL; a new buffer is zeroed, and id 0 matches no activations). A product's chunks, and
 * the products that share one prepared x (a matvec set, the MoE's expert gates and ups), are calls of
 * their own: before, each call (16-32 rows) prepared the whole column again. */
typedef struct {
    uint64_t id;
    int q6;
    kq_col cols[KQ_GEMV_COLS * KQ_GEMV_SB];   /* column c's super-block sb at c * nsb + sb */
} kq_gemv_state;

/* One row of w against all a->m prepared columns, 4 at a time. */
DD_INLINE void kq_gemv_row(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, int wtype, float *y,
                           size_t ldy, const kq_col *cols)
{
    const size_t nsb = a->nb / 8;
    for (size_t c0 = 0; c0 < a->m; c0 += 4) {
        const kq_col *pre = cols + c0 * nsb;
        switch (a->m - c0 < 4 ? a->m - c0 : 4) {
        case 4: kq_tile(w, pf, rb, a, wtype, c0, y, ldy, 1, 4, pre); break;
        case 3: kq_tile(w, pf, rb, a, wtype, c0, y, ldy, 1, 3, pre); break;
        case 2: kq_tile(w, pf, rb, a, wtype, c0, y, ldy, 1, 2, pre); break;
        default: kq_tile(w, pf, rb, a, wtype, c0, y, ldy, 1, 1, pre); break;
        }
    }
}

/* A GEMV (m <= KQ_GEMV_COLS) as DD_DEFINE_GEMM's m == 1 walk with one-row tiles (its prefetches), the columns
 * prepared at most once per thread and activations, in st. One row at a time reads the matrix as one forward
 * stream, which a core reads from DRAM faster than 4-row tiles' four streams a row apart, though those compute a
 * little faster in L2 (docs/perf/log/zen5-2026-12-07.md). Every (row, column) runs
 * kq_tile's instructions on the same prepared values, so the bits are those of the per-tile preparation,
 * for any m and any row grouping. */
DD_INLINE void kq_gemv(const uint8_t *w, size_t rb, size_t nrows, size_t rows_avail, const dd_acts *a, float *y,
                       size_t ldy, int wtype, kq_gemv_state *st)
{
    const int q6 = wtype == DD_Q6_K;
    const size_t nsb = a->nb / 8;
    if (a->id == 0 || st->id != a->id || st->q6 != q6) {   /* id 0: activations not from acts_place */
        for (size_t c = 0; c < a->m; c++)
            for (size_t sb = 0; sb < nsb; sb++)
                kq_col_prep(a, c * a->nbp + 8 * sb, wtype, &st->cols[c * nsb + sb]);
        st->id = a->id;
        st->q6 = q6;
    }
    const kq_col *cols = st->cols;
    const size_t ahead = dd_gemv_ahead(rb);
    dd_gemv_prefetch_start(w, rb, nrows, rows_avail, ahead);
    for (size_t r = 0; r < nrows; r++)
        kq_gemv_row(w + r * rb, DD_PREFETCH_AHEAD(w, rb, r, 1, rows_avail, ahead), rb, a, wtype, y + r, ldy, cols);
}

#include "kq_gemm_avx512.h"
#include "kqh_few_avx512.h"
/* KQ_GEMM(NAME, TYPE, TILES, GEMM_M) defines the dd_gemm_fn NAME for weight type TYPE, for rows of up to
 * KQ_GEMV_SB super-blocks (their scratch allocated): kq_gemv for one column, kqh_few for KQH_FEW ..
 * KQ_GEMV_COLS (docs/design/batched-decode.md); beyond, GEMM_M (kq_gemm_avx512.h) for m > 1 when its
 * scratch holds the rows, else TILES (DD_DEFINE_GEMM of kq_tile). All give the same bits. */
#define KQ_GEMM(NAME, TYPE, TILES, GEMM_M)                                                                     \
    static void NAME(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a,   \
                     float *y, size_t ldy)                                                                    \
    {                                                                                                         \
        kq_gemv_state *st = NULL;                                                                             \
        kqh_few_state *fs = NULL;                                                                             \
        const int few = a->m <= KQ_GEMV_COLS && a->nb / 8 <= KQ_GEMV_SB;                                      \
        if (few && a->m >= KQH_FEW && (fs = dd_scratch(DD_SCRATCH_KQH_COL, sizeof(kqh_few_state))) != NULL)   \
            kqh_few(w, row_bytes, nrows, rows_avail, a, y, ldy, TYPE, fs);                                    \
        else if (few && (st = dd_scratch(DD_SCRATCH_KQ_COL, sizeof(kq_gemv_state))) != NULL)                  \
            kq_gemv(w, row_bytes, nrows, rows_avail, a, y, ldy, TYPE, st);                                    \
        else if (a->m > 1 && KQX_FITS(a))                                                                     \
            GEMM_M(w, row_bytes, nrows, rows_avail, a, y, ldy);                                               \
        else                                                                                                  \
            TILES(w, row_bytes, nrows, rows_avail, a, y, ldy);                                                \
    }
KQ_GEMM(gemm_q4_K, DD_Q4_K, tiles_q4_K, KQX_GEMM_Q4_K)
KQ_GEMM(gemm_q5_K, DD_Q5_K, tiles_q5_K, KQX_GEMM_Q5_K)
KQ_GEMM(gemm_q6_K, DD_Q6_K, tiles_q6_K, KQX_GEMM_Q6_K)

#endif
