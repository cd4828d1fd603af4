/* AVX2 kernels (compiled with -mavx2 -mfma -mf16c).
 *
 * One ymm register holds one 32-value block. Q4_0: the 16 nibble bytes expand to the 32 values
 * in order (low nibbles, then high) as unsigned bytes; `pmaddubsw` with the signed activations
 * and `pmaddwd` with ones give 8 exact int32 lanes, to which the activation bias (-8 times the
 * activation sums) is added. Q8_0: the sign trick (|w| times a with w's sign) keeps `pmaddubsw`
 * from saturating. Four blocks' 8 lanes each become their 4 block dots (a vphaddd tree), which are scaled by
 * d_w * d_a into kernels.h's f32 terms and summed in its 16 f32 lanes.
 */
#include <immintrin.h>

#include "gemm_tiles.h"
#include "kernels.h"
#include "swiglu.h"
#include "k_lanes.h"
#include "q4k_interleave.h"

/* The K-quant dot product of kquants.h: one ymm per 32-value block, vpmaddubsw (unsigned weights x
 * signed activations) then vpmaddwd by the two halves' scales; the 8 int32 lanes of each of the 8
 * blocks are summed by a vphaddd tree. */
DD_INLINE void kq_dot8(const uint8_t *w, const int8_t *a, const int16_t *sc, int32_t *out)
{
    __m256i v[8];
    for (int i = 0; i < 8; i++) {
        const __m256i scale = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(sc[2 * i])),
                                                      _mm_set1_epi16(sc[2 * i + 1]), 1);
        const __m256i p = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(w + 32 * i)),
                                               _mm256_loadu_si256((const __m256i *)(a + 32 * i)));
        v[i] = _mm256_madd_epi16(p, scale);
    }
    const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
    /* lo: blocks 0-3 from the low 128-bit lanes, then from the high ones; hi likewise for 4-7 */
    const __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
    _mm256_storeu_si256((__m256i *)out, sum);
}
#define DD_KQ_DOT8 kq_dot8
#include "kquants.h"
#define DD_BQ_LEVEL 2
#include "bquants.h"
#define DD_LB_DOT8 kq_dot8
#include "lowbit.h"

static void quantize_q8_0(const float *x, size_t nb, uint8_t *out)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    for (size_t b = 0; b < nb; b++, x += DD_QK, out += DD_Q8_0_BYTES) {
        __m256 v[4];
        __m256 m = _mm256_setzero_ps();
        for (int h = 0; h < 4; h++) {
            v[h] = _mm256_loadu_ps(x + 8 * h);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[h]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float d = _mm_cvtss_f32(m4) / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = dd_f32_to_f16(d);
        memcpy(out, &dh, 2);
        __m256i q[4];
        for (int h = 0; h < 4; h++) {
            /* roundf: truncate, then step away from zero when the dropped fraction is >= 0.5 */
            __m256 t = _mm256_mul_ps(v[h], _mm256_set1_ps(id));
            __m256 r = _mm256_round_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(t, r)), half, _CMP_GE_OQ);
            __m256 step = _mm256_or_ps(_mm256_and_ps(sign, t), one);
            q[h] = _mm256_cvttps_epi32(_mm256_add_ps(r, _mm256_and_ps(up, step)));
        }
        /* pack 32 int32 -> 32 int8 in order (the packs work within 128-bit lanes; fix the order) */
        __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
        __m256i bytes = _mm256_packs_epi16(w01, w23);
        bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(out + 2), bytes);
    }
}

DD_INLINE __m256i q4_0_block(const uint8_t *blk)
{
    const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 2));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(qs), _mm_srli_epi16(qs, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* Blocks b .. b + n - 1 (n <= 4, b a multiple of 4) of R rows against C columns into acc[r][c] (kernels.h's f32
 * lanes b % 16 .. b % 16 + 3; n is a constant but in a short last group). A row's n blocks are expanded once for
 * its C columns; each block's dot (8 int32 lanes) meets the others in a vphaddd tree, giving the n exact block
 * dots in order; missing blocks add +0. */
DD_INLINE void quad(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, int wtype, size_t c0,
                    size_t b, __m128 acc[4][4], const int R, const int C, const int n)
{
    const size_t bytes = wtype == DD_Q4_0 ? DD_Q4_0_BYTES : DD_Q8_0_BYTES;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++) {
        __m256i wq[4], wabs[4];
        uint16_t dh[4] = { 0, 0, 0, 0 };
        for (int k = 0; k < n; k++) {
            const uint8_t *blk = w + r * rb + (b + k) * bytes;
            dd_prefetch_weight(pf + r * rb + (b + k) * bytes);
            dh[k] = dd_load_u16(blk);
            if (wtype == DD_Q4_0) {
                wq[k] = q4_0_block(blk);
            } else {
                wq[k] = _mm256_loadu_si256((const __m256i *)(blk + 2));
                wabs[k] = _mm256_sign_epi8(wq[k], wq[k]);
            }
        }
        const __m128 dw =
            _mm_cvtph_ps(_mm_setr_epi16((short)dh[0], (short)dh[1], (short)dh[2], (short)dh[3], 0, 0, 0, 0));
        for (int c = 0; c < C; c++) {
            const size_t col = (c0 + c) * a->nbp + b;
            __m256i d[4];
            for (int k = 0; k < 4; k++) {
                if (k >= n) {
                    d[k] = _mm256_setzero_si256();
                    continue;
                }
                const __m256i aq = _mm256_load_si256((const __m256i *)(a->q + (col + k) * DD_QK));
                if (wtype == DD_Q4_0)
                    d[k] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(wq[k], aq), ones),
                                            _mm256_load_si256((const __m256i *)(a->bias[DD_Q4_0] + (col + k) * 8)));
                else
                    d[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[k], _mm256_sign_epi8(aq, wq[k])), ones);
            }
            const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
            const __m128i dot = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            const __m128 da = n == 4 ? _mm_loadu_ps(a->bd + col)
                                     : _mm_setr_ps(a->bd[col], n > 1 ? a->bd[col + 1] : 0.0f,
                                                   n > 2 ? a->bd[col + 2] : 0.0f, 0.0f);
            const __m128 scale = _mm_mul_ps(dw, da);   /* exact: 11 x 11 bits */
            acc[r][c] = _mm_add_ps(acc[r][c], _mm_mul_ps(_mm_cvtepi32_ps(dot), scale));
        }
    }
}

#include "q4q8_tile.h"

DD_DEFINE_TYPED_GEMMS()

static float dot_f32(const float *a, const float *b, size_t n)
{
    __m256d acc[4] = { _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd() };
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm_prefetch((const char *)(a + i + 1024), _MM_HINT_T0);               /* a streams: 4 KiB ahead */
        for (int u = 0; u < 4; u++)   /* f32 x f32 is exact in f64, so the fused add rounds as a plain one */
            acc[u] = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(a + i + 4 * u)),
                                     _mm256_cvtps_pd(_mm_loadu_ps(b + i + 4 * u)), acc[u]);
    }
    __m256d t = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
    double sum = _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
    for (; i < n; i++)
        sum += (double)a[i] * b[i];
    return (float)sum;
}

DD_DEFINE_DOTS_F32(dots_f32, dot_f32)

#define DD_BF16_ROWS 2
#define DD_BF16_COLS 2
#include "bf16.h"

DD_DEFINE_GEMM_IL(gemm_q4_0_il, DD_Q4_0, gemm_q4_0, NULL, NULL)
DD_DEFINE_GEMM_IL(gemm_mxfp4_il, DD_MXFP4, gemm_mxfp4, NULL, NULL)
DD_DEFINE_GEMM_Q4_K_IL(gemm_q4_k_il, gemm_q4_K, NULL, NULL)
DD_DEFINE_GEMM_RL(gemm_q2_k_rl, gemm_q2_K, dd_q2_k_rl_unpack_groups)
DD_DEFINE_GEMM_RL(gemm_q3_k_rl, gemm_q3_K, dd_q3_k_rl_unpack_groups)

DD_SWIGLU_DEFINE(swiglu, 8)

const dd_kernels dd_kernels_avx2 = {
    .quantize_q8_0 = quantize_q8_0,
    .gemm = { gemm_q4_0, gemm_q8_0, gemm_q4_K, gemm_q5_K, gemm_q6_K, DD_BQ_GEMMS, DD_LB_GEMMS, DD_IQ_GEMMS, gemm_mxfp4, gemm_bf16, gemm_f16,
              gemm_q4_0_il, gemm_mxfp4_il, gemm_q4_k_il, gemm_q2_k_rl, gemm_q3_k_rl },
    .bias_mult = { -8, 0 },
    .dots_f32 = dots_f32,
    .swiglu = swiglu,
};
