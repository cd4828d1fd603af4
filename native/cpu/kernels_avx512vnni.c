/* AVX-512 VNNI kernels (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni).
 *
 * One zmm register holds two consecutive 32-value blocks. Weights enter `vpdpbusd` as unsigned
 * bytes (a Q4_0 nibble 0..15, or a Q8_0 int8 + 128) against the signed Q8_0 activations; the
 * activation-side bias (-8 or -128 times the activation sums, see dd_acts) seeds the integer
 * accumulator, so each int32 lane ends exact. Per block pair: lanes 0-7 belong to the first block,
 * 8-15 to the second; they are scaled by d_w * d_a and summed in f32 lanes, reduced once per row.
 */
#include <immintrin.h>

#include "gemm_tiles.h"
#include "kernels.h"

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

static const uint16_t q4_qs_words[32] = {
    1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8,
    10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12, 13, 14, 15, 16, 17,
};
static const uint16_t q4_d_words[32] = {
    0, 0, 0, 0, 0, 0, 0, 0, 9, 9, 9, 9, 9, 9, 9, 9,
};

/* A Q4_0 block pair (36 bytes = 18 words, or 9 words for a lone last block) -> the 64 nibbles in
 * value order (low nibbles of block 0, its high nibbles, then block 1's), and the two scales. */
DD_INLINE void q4_0_pair(const uint8_t *p, __mmask32 words, __m512i *nib, __m512 *dw)
{
    const __m512i raw = _mm512_maskz_loadu_epi16(words, p);
    const __m512i dup = _mm512_permutexvar_epi16(_mm512_loadu_si512(q4_qs_words), raw);
    *nib = _mm512_and_si512(_mm512_srlv_epi64(dup, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)),
                            _mm512_set1_epi8(0x0f));
    *dw = _mm512_cvtph_ps(_mm512_castsi512_si256(
        _mm512_permutexvar_epi16(_mm512_loadu_si512(q4_d_words), raw)));
}

/* A Q8_0 block pair (68 bytes, or 34 for a lone last block) -> 64 bytes int8 + 128, two scales. */
DD_INLINE void q8_0_pair(const uint8_t *p, int full, __m512i *qu, __m512 *dw)
{
    __m256i lo = _mm256_loadu_si256((const __m256i *)(p + 2));
    __m256i hi = full ? _mm256_loadu_si256((const __m256i *)(p + DD_Q8_0_BYTES + 2)) : _mm256_setzero_si256();
    __m128i d0 = _mm_set1_epi16((short)dd_load_u16(p));
    __m128i d1 = full ? _mm_set1_epi16((short)dd_load_u16(p + DD_Q8_0_BYTES)) : _mm_setzero_si128();
    *qu = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8((char)0x80));
    *dw = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(d0), d1, 1));
}

/* One block pair p of R rows x C columns: acc[r][c] += (bias + wq . aq) * (dw * da), per lane. */
DD_INLINE void pair_step(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, int wtype,
                         size_t c0, size_t p, int full, __m512 acc[4][4], const int R, const int C)
{
    const size_t pair_bytes = 2 * (wtype == DD_Q4_0 ? DD_Q4_0_BYTES : DD_Q8_0_BYTES);
    __m512i wq[4];
    __m512 dw[4];
    for (int r = 0; r < R; r++) {
        _mm_prefetch((const char *)(pf + r * rb + p * pair_bytes), _MM_HINT_T0);
        if (wtype == DD_Q4_0)
            q4_0_pair(w + r * rb + p * pair_bytes, full ? 0x3ffff : 0x1ff, &wq[r], &dw[r]);
        else
            q8_0_pair(w + r * rb + p * pair_bytes, full, &wq[r], &dw[r]);
    }
    for (int c = 0; c < C; c++) {
        const size_t col = (c0 + c) * a->nbp;
        const __m512i aq = _mm512_load_si512(a->q + col * DD_QK + p * 64);
        const __m512i bias = _mm512_load_si512(a->bias[wtype] + col * 8 + p * 16);
        const __m512 da = _mm512_load_ps(a->d + col * 8 + p * 16);
        for (int r = 0; r < R; r++) {
            __m512i dot = _mm512_dpbusd_epi32(bias, wq[r], aq);
            acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw[r], da), acc[r][c]);
        }
    }
}

DD_INLINE void tile(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, int wtype, size_t c0,
                    float *y, size_t ldy, const int R, const int C)
{
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = _mm512_setzero_ps();
    const size_t full_pairs = a->nb / 2;
    for (size_t p = 0; p < full_pairs; p++)
        pair_step(w, pf, rb, a, wtype, c0, p, 1, acc, R, C);
    if (a->nb & 1)
        pair_step(w, pf, rb, a, wtype, c0, full_pairs, 0, acc, R, C);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            y[(c0 + c) * ldy + r] = _mm512_reduce_add_ps(acc[r][c]);
}

#define TILE_Q4_0(w, pf, rb, a, c0, y, ldy, R, C) tile(w, pf, rb, a, DD_Q4_0, c0, y, ldy, R, C)
#define TILE_Q8_0(w, pf, rb, a, c0, y, ldy, R, C) tile(w, pf, rb, a, DD_Q8_0, c0, y, ldy, R, C)
DD_DEFINE_GEMM(gemm_q4_0, TILE_Q4_0)
DD_DEFINE_GEMM(gemm_q8_0, TILE_Q8_0)

static float dot_f32(const float *a, const float *b, size_t n)
{
    __m512 acc[4] = { _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps() };
    size_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (int u = 0; u < 4; u++) {
            _mm_prefetch((const char *)(a + i + 16 * u + 1024), _MM_HINT_T0);   /* a streams: 4 KiB ahead */
            acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16 * u), _mm512_loadu_ps(b + i + 16 * u), acc[u]);
        }
    for (; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        acc[0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc[0]);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

const dd_kernels dd_kernels_avx512vnni = {
    .quantize_q8_0 = quantize_q8_0,
    .gemm = { gemm_q4_0, gemm_q8_0 },
    .bias_mult = { -8, -128 },
    .dot_f32 = dot_f32,
};
