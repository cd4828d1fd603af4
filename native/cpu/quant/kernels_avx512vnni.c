/* AVX-512 VNNI kernels (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni).
 *
 * Weights enter `vpdpbusd` as unsigned bytes (a Q4_0 nibble 0..15, or a Q8_0 int8 + 128) against
 * the signed Q8_0 activations; the activation-side bias (-8 or -128 times the activation sums, see
 * dd_acts) seeds the integer accumulator, so each int32 lane ends exact. Q4_0 and Q8_0 put one block in
 * each lane (16-block groups) and sum kernels.h's f32 terms in those lanes (dd_tree16_f32's order); the
 * other types' terms are exact f64 products summed in f64 lanes and rounded to f32 once per row.
 */
#include <immintrin.h>

#include "gemm_tiles.h"
#include "kernels.h"
#include "swiglu.h"
#include "k_lanes.h"
#include "q4k_interleave.h"
#include "runtime.h"

/* 4 vectors of 16 int32 lanes -> lane 4k + j = the sum of 128-bit lane k of vector j (exact, in-lane
 * shuffles only) */
DD_INLINE __m512i kq_transpose_add(const __m512i d[4])
{
    const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(d[0], d[1]), _mm512_unpackhi_epi32(d[0], d[1]));
    const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2], d[3]), _mm512_unpackhi_epi32(d[2], d[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

/* acc + vpdpbusd of the unsigned bytes w with the activation's 4 values at p (int8) in every int32 lane, read by
 * the instruction's own broadcast: GCC loads set1's dword into a register first, one more instruction for each
 * product of the Q4_K and MXFP4 stripe GEMVs (q4k_il_avx512.h, q4_il_avx512.h), a vector pipe slot on Zen 4
 * (one thread, 4 MiB in L3: Q4_K 35.5 -> 38.3 GB/s; MXFP4 from DRAM: docs/perf/log/mx-2026-12-06.md). */
DD_INLINE __m256i dd_dpbusd_bcast4(__m256i acc, __m256i w, const int8_t *p)
{
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

#include "kq_tile_avx512.h"
#include "q4k_il_avx512.h"

#define DD_BQ_LEVEL 3
#include "bquants.h"

#include "lowbit_avx512.h"
#include "q2k_rl_avx512.h"

/* The integer dot product of lowbit.h for the IQ types (kquants.h's DD_KQ_DOT8 contract, unsigned weights
 * of up to 127): one vpdpbusd per 64 values (blocks 2p, 2p + 1) gives 4-value sums, 128-bit lane h the
 * 16-value half h of the pair; each lane times its half's scale (vpmulld, exact: |sum| < 2^17, |sc| < 2^6),
 * then the transpose-add puts half h of pair p in lane 4h + p: block 2p is lanes p + (4 + p), block 2p + 1
 * lanes (8 + p) + (12 + p), gathered into block order. */
DD_INLINE void lb_dot8(const uint8_t *w, const int8_t *a, const int16_t *sc, int32_t *out)
{
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i scales = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)sc));
    __m512i d[4];
    for (int p = 0; p < 4; p++) {
        const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(w + 64 * p),
                                              _mm512_loadu_si512(a + 64 * p));
        const __m512i k = _mm512_permutexvar_epi32(_mm512_add_epi32(spread, _mm512_set1_epi32(4 * p)), scales);
        d[p] = _mm512_mullo_epi32(s, k);
    }
    __m512i t = kq_transpose_add(d);
    t = _mm512_add_epi32(t, _mm512_alignr_epi32(t, t, 4));
    t = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0), t);
    _mm256_storeu_si256((__m256i *)out, _mm512_castsi512_si256(t));
}
#define DD_LB_DOT8 lb_dot8
#define DD_LB_K_IN_REGISTERS
#include "iquants_avx512.h"
#include "lowbit.h"

static void quantize_q8_0(const float *x, size_t nb, uint8_t *out)
{
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    for (size_t b = 0; b < nb; b++, x += DD_QK, out += DD_Q8_0_BYTES) {
        __m512 v[2] = { _mm512_loadu_ps(x), _mm512_loadu_ps(x + 16) };
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = dd_f32_to_f16(d);
        memcpy(out, &dh, 2);
        for (int h = 0; h < 2; h++) {
            /* roundf: truncate, then step away from zero when the dropped fraction is >= 0.5 */
            __m512 t = _mm512_mul_ps(v[h], _mm512_set1_ps(id));
            __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(t, r)), half, _CMP_GE_OQ);
            __m512 step = _mm512_castsi512_ps(_mm512_or_si512(
                _mm512_and_si512(_mm512_castps_si512(t), _mm512_set1_epi32((int)0x80000000u)),
                _mm512_castps_si512(one)));
            r = _mm512_mask_add_ps(r, up, r, step);
            _mm_storeu_si128((__m128i *)(out + 2 + 16 * h), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r)));
        }
    }
}

/* Q4_0 and Q8_0 run on 16-block groups with one int32 lane per block ("lanes = blocks"), so the int to
 * float conversion and the scaling happen once per 16 blocks. What follows is the GEMV's (m == 1) tile; the
 * GEMM's (m > 1) is q4_gemm_avx512.h, on the other group layout of dd_acts. Quad j of a group (blocks 4j ..
 * 4j + 3) is read into two vectors, block 4j + k in 128-bit lane k, which meet the activations' values 0-15
 * and 16-31 of the same blocks (dd_acts groups), giving 4 int32 partial sums per block; a 4 x 4
 * transpose-add within 128-bit lanes (kq_transpose_add) turns the 4 quads' vectors into one with block
 * 4j + k in lane 4k + j. The scales are gathered into the same lane order by word permutes.
 * Q4_0: a group is 288 bytes, block i at bytes 18i (f16 scale) and 18i + 2 .. 18i + 17 (16 nibble bytes);
 * quad j is one word permute of the 72 bytes at 72j (two loads), its low nibbles values 0-15, high 16-31.
 * Q8_0: a group is 544 bytes, block i at 34i (scale) and 34i + 2 .. 34i + 33 (32 int8 values, read as
 * unsigned bytes int8 + 128: the activation bias is -128 times the block's sum, 16 times dd_acts' gbias);
 * quad j's values 0-15 are one word permute of the 128 bytes at 136j, its values 16-31 of those at
 * 136j + 8 (within the quad's 136 bytes: no read past a group). */
#define Q4_GROUP_BYTES (16 * DD_Q4_0_BYTES)
#define Q8_GROUP_BYTES (16 * DD_Q8_0_BYTES)

/* word 8k + w of a Q4_0 quad vector = word 9k + 1 + w of the quad's 72 bytes: from the 64 bytes at the
 * quad (words 0..31) or the 64 at 8 bytes further (index 32 + word - 4) */
static const uint16_t quad_words[32] = {
    1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17,
    19, 20, 21, 22, 23, 24, 25, 26, 28, 29, 30, 31, 60, 61, 62, 63,
};

/* word 8k + w of a Q8_0 quad vector of values 0-15 = word 17k + 1 + w of the 128 bytes at the quad; of values
 * 16-31, word 17k + 5 + w of the 128 bytes 8 further (adding 4) */
static const uint16_t q8_quad_words[32] = {
    1, 2, 3, 4, 5, 6, 7, 8, 18, 19, 20, 21, 22, 23, 24, 25,
    35, 36, 37, 38, 39, 40, 41, 42, 52, 53, 54, 55, 56, 57, 58, 59,
};

/* word L of the scale vector = the scale of block b = 4 (L % 4) + L / 4, word 9b of a Q4_0 group:
 * blocks 0-7 (L % 4 < 2) from words 0..63, blocks 8-15 from words 72..135 (index 9b - 72) */
static const uint16_t scale_words[32] = { 0, 36, 0, 36, 9, 45, 9, 45, 18, 54, 18, 54, 27, 63, 27, 63 };
#define SCALE_LANES_LOW 0x3333u

/* Q8_0: block 4j + k's scale is word 17k of quad j's 128 bytes; lane L = 4k + j */
static const uint16_t q8_scale_words[32] = { 0, 0, 0, 0, 17, 17, 17, 17, 34, 34, 34, 34, 51, 51, 51, 51 };

/* acc += kernels.h's Q4_0 / Q8_0 terms of 16 blocks: the exact int32 dots (in f32) times the f32 scales
 * dw * da (exact, 11 x 11 bits), rounded once, then added: a multiply and an add, no fused one. */
DD_INLINE __m512 acc_f32(__m512 acc, __m512i dot, __m512 scale)
{
    return _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(dot), scale));
}

/* dd_tree16_f32 of 16 lanes in the group order (lane L = 4 (i % 4) + i / 4 holds block lane i): i + 8 is
 * L + 2 and i + 4 is L + 1 (within a 128-bit lane), i + 2 is L + 8 and i + 1 is L + 4. */
DD_INLINE float reduce_lanes(__m512 acc)
{
    acc = _mm512_add_ps(acc, _mm512_permute_ps(acc, _MM_SHUFFLE(1, 0, 3, 2)));
    acc = _mm512_add_ps(acc, _mm512_permute_ps(acc, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

DD_INLINE size_t group_bytes(int wtype)
{
    return wtype == DD_Q4_0 ? Q4_GROUP_BYTES : Q8_GROUP_BYTES;
}

/* Quad j of the group at p as unsigned bytes: lo's 128-bit lane k = values 0-15 of block 4j + k, hi's = values
 * 16-31 (Q4_0: nibbles; Q8_0: int8 + 128). */
DD_INLINE void group_quad(const uint8_t *p, int j, int wtype, __m512i *lo, __m512i *hi)
{
    if (wtype == DD_Q4_0) {
        const __m512i low = _mm512_set1_epi8(0x0f);
        const __m512i v = _mm512_permutex2var_epi16(_mm512_loadu_si512(p + 72 * j), _mm512_loadu_si512(quad_words),
                                                    _mm512_loadu_si512(p + 72 * j + 8));
        *lo = _mm512_and_si512(v, low);
        *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        return;
    }
    const __m512i flip = _mm512_set1_epi8((char)0x80), idx = _mm512_loadu_si512(q8_quad_words);
    const uint8_t *q = p + 4 * j * DD_Q8_0_BYTES;
    *lo = _mm512_xor_si512(_mm512_permutex2var_epi16(_mm512_loadu_si512(q), idx, _mm512_loadu_si512(q + 64)), flip);
    *hi = _mm512_xor_si512(_mm512_permutex2var_epi16(_mm512_loadu_si512(q + 8),
                                                     _mm512_add_epi16(idx, _mm512_set1_epi16(4)),
                                                     _mm512_loadu_si512(q + 72)), flip);
}

/* The group's 16 scales in lane order (lane L: block 4 (L % 4) + L / 4), widened to f32. */
DD_INLINE __m512 group_scales(const uint8_t *p, int wtype)
{
    if (wtype == DD_Q4_0) {
        const __m512i sidx = _mm512_loadu_si512(scale_words);
        const __m512i d = _mm512_or_si512(
            _mm512_maskz_permutex2var_epi16(SCALE_LANES_LOW, _mm512_loadu_si512(p), sidx, _mm512_loadu_si512(p + 64)),
            _mm512_maskz_permutex2var_epi16(~SCALE_LANES_LOW & 0xffffu, _mm512_loadu_si512(p + 144), sidx,
                                            _mm512_loadu_si512(p + 208)));
        return _mm512_cvtph_ps(_mm512_castsi512_si256(d));
    }
    const __m512i sidx = _mm512_loadu_si512(q8_scale_words);
    __m512i d = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        const uint8_t *q = p + 4 * j * DD_Q8_0_BYTES;
        d = _mm512_or_si512(d, _mm512_maskz_permutex2var_epi16(0x1111u << j, _mm512_loadu_si512(q), sidx,
                                                               _mm512_loadu_si512(q + 64)));
    }
    return _mm512_cvtph_ps(_mm512_castsi512_si256(d));
}

/* Column bias of a group's lanes for the weight type: dd_acts' gbias (-8 times each block's sum) for Q4_0's
 * nibbles, 16 times that (-128 times the sum) for Q8_0's int8 + 128. */
DD_INLINE __m512i group_bias(const int32_t *gbias, int wtype)
{
    const __m512i b = _mm512_load_si512(gbias);
    return wtype == DD_Q4_0 ? b : _mm512_slli_epi32(b, 4);
}

/* Prefetch every line of the group of type wtype at p. */
DD_INLINE void prefetch_group(const uint8_t *p, int wtype)
{
    const size_t bytes = group_bytes(wtype);
    for (size_t at = 0; at < bytes; at += 64)
        dd_prefetch_weight(p + at);
    dd_prefetch_weight(p + bytes - 1);
}

/* One group of R rows (rows `rstride` bytes apart from grp) against C columns of group g. */
DD_INLINE void group_step(const uint8_t *grp, size_t rstride, const uint8_t *pf, size_t rb, const dd_acts *a,
                          size_t c0, size_t g, int wtype, __m512 acc[4][4], const int R, const int C)
{
    /* unrolled, so that each row's accumulators stay in registers (GCC left the loop rolled, acc[r] on the stack) */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const uint8_t *p = grp + r * rstride;
        if (pf != NULL)
            prefetch_group(pf + r * rb + g * group_bytes(wtype), wtype);
        __m512i part[4][4];
        for (int j = 0; j < 4; j++) {
            __m512i lo, hi;
            group_quad(p, j, wtype, &lo, &hi);
            for (int c = 0; c < C; c++) {
                const int8_t *q = a->gq + (((c0 + c) * a->ng + g) * 8 + 2 * j) * 64;
                part[c][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(q)),
                                                 hi, _mm512_load_si512(q + 64));
            }
        }
        const __m512 dw = group_scales(p, wtype);
        for (int c = 0; c < C; c++) {
            const size_t at = ((c0 + c) * a->ng + g) * 16;
            const __m512i dot = _mm512_add_epi32(kq_transpose_add(part[c]), group_bias(a->gbias + at, wtype));
            acc[r][c] = acc_f32(acc[r][c], dot, _mm512_mul_ps(dw, _mm512_load_ps(a->gd + at)));
        }
    }
}

DD_INLINE void tile_groups(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, size_t c0, float *y,
                           size_t ldy, int wtype, const int R, const int C)
{
    const size_t full = a->nb / 16, rest = a->nb % 16, gb = group_bytes(wtype);
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = _mm512_setzero_ps();
    for (size_t g = 0; g < full; g++)
        group_step(w + g * gb, rb, pf, rb, a, c0, g, wtype, acc, R, C);
    if (rest) {
        /* a short last group: copied into zeroed buffers (the padding weights, Q8_0's 128 after the flip, meet
         * zero activations, bias and scales) */
        uint8_t tail[4][Q8_GROUP_BYTES];
        for (int r = 0; r < R; r++) {
            memset(tail[r], 0, gb);
            memcpy(tail[r], w + r * rb + full * gb, rest * (gb / 16));
        }
        group_step(tail[0], Q8_GROUP_BYTES, NULL, rb, a, c0, full, wtype, acc, R, C);
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            y[(c0 + c) * ldy + r] = reduce_lanes(acc[r][c]);
}

DD_INLINE void tile_q4_0(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, size_t c0, float *y,
                         size_t ldy, const int R, const int C)
{
    tile_groups(w, pf, rb, a, c0, y, ldy, DD_Q4_0, R, C);
}

DD_INLINE void tile_q8_0(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, size_t c0, float *y,
                         size_t ldy, const int R, const int C)
{
    tile_groups(w, pf, rb, a, c0, y, ldy, DD_Q8_0, R, C);
}

DD_DEFINE_GEMV(gemm_q4_0_gemv, tile_q4_0)
DD_DEFINE_GEMV(gemm_q8_0_gemv, tile_q8_0)
#include "q4_il_avx512.h"
#include "q4_gemm_avx512.h"

/* R router rows x C tokens of dots_f32 (kernels.h) at once, so each loaded and widened row or token vector
 * serves several dots. Each dot keeps 4 f64 accumulators (values 8u .. 8u + 7 of every 32 in acc u, the
 * last n % 32 values 8 at a time in acc 0), then (acc 0 + acc 1) + (acc 2 + acc 3) and its 8 lanes by
 * _mm512_reduce_add_pd: the same instructions for every R, C and position, hence the same bits. f32 x f32
 * is exact in f64, so each fused add rounds as a plain one. */
DD_INLINE void dots_tile(const float *w, const float *x, size_t n, float *out, size_t ldo, const int R, const int C)
{
    __m512d acc[2][2][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            for (int u = 0; u < 4; u++)
                acc[r][c][u] = _mm512_setzero_pd();
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        for (int r = 0; r < R; r++) {   /* the rows stream: 4 KiB ahead */
            dd_prefetch_weight(w + r * n + i + 1024);
            dd_prefetch_weight(w + r * n + i + 1040);
        }
        for (int u = 0; u < 4; u++) {
            __m512d wv[2], xv[2];
            for (int r = 0; r < R; r++)
                wv[r] = _mm512_cvtps_pd(_mm256_loadu_ps(w + r * n + i + 8 * u));
            for (int c = 0; c < C; c++)
                xv[c] = _mm512_cvtps_pd(_mm256_loadu_ps(x + c * n + i + 8 * u));
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++)
                    acc[r][c][u] = _mm512_fmadd_pd(wv[r], xv[c], acc[r][c][u]);
        }
    }
    for (; i < n; i += 8) {
        const __mmask8 m = n - i >= 8 ? 0xff : (__mmask8)((1u << (n - i)) - 1);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                acc[r][c][0] = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, w + r * n + i)),
                                               _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, x + c * n + i)), acc[r][c][0]);
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            out[c * ldo + r] = (float)_mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(acc[r][c][0], acc[r][c][1]),
                                                                         _mm512_add_pd(acc[r][c][2], acc[r][c][3])));
}

/* dots_f32 in 2 x 2 tiles (odd edges 1 wide), a pair of rows meeting every token pair while it is in L1. */
static void dots_f32(const float *w, size_t nw, const float *x, size_t nx, size_t n, float *out, size_t ldo)
{
    size_t e = 0;
    for (; e + 2 <= nw; e += 2) {
        size_t t = 0;
        for (; t + 2 <= nx; t += 2)
            dots_tile(w + e * n, x + t * n, n, out + t * ldo + e, ldo, 2, 2);
        if (t < nx)
            dots_tile(w + e * n, x + t * n, n, out + t * ldo + e, ldo, 2, 1);
    }
    if (e < nw) {
        size_t t = 0;
        for (; t + 2 <= nx; t += 2)
            dots_tile(w + e * n, x + t * n, n, out + t * ldo + e, ldo, 1, 2);
        if (t < nx)
            dots_tile(w + e * n, x + t * n, n, out + t * ldo + e, ldo, 1, 1);
    }
}

#define DD_BF16_ROWS 4
#define DD_BF16_COLS 4
#include "bf16.h"

DD_SWIGLU_DEFINE(swiglu, 16)

const dd_kernels dd_kernels_avx512vnni = {
    .quantize_q8_0 = quantize_q8_0,
    .gemm = { gemm_q4_0, gemm_q8_0, gemm_q4_K, gemm_q5_K, gemm_q6_K, DD_BQ_GEMMS, DD_LB_GEMMS, DD_IQ_GEMMS, gemm_mxfp4, gemm_bf16, gemm_f16,
              gemm_q4_0_il, gemm_mxfp4_il, gemm_q4_k_il, gemm_q2_k_rl, gemm_q3_k_rl },
    .bias_mult = { 0, 0 },
    .q4_0_groups = 1,
    .dots_f32 = dots_f32,
    .swiglu = swiglu,
};
