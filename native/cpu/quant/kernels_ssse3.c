/* SSSE3 kernels (compiled with -mssse3): the path for x86-64 CPUs without AVX.
 *
 * A 32-value block is two xmm halves. Q4_0: low nibbles (values 0-15) and high nibbles (16-31)
 * as unsigned bytes times the signed activations through `pmaddubsw` + `pmaddwd`, plus the
 * activation bias (-8 times the activation sums). Q8_0: the sign trick (|w| times a with w's
 * sign). Block scales are widened from f16 in C (no F16C here). Four blocks' 4 lanes each become their 4
 * block dots (a phaddd tree), which are scaled by d_w * d_a into kernels.h's f32 terms and summed in its 16 f32
 * lanes.
 */
#include <tmmintrin.h>
#include <xmmintrin.h>

#include "gemm_tiles.h"
#include "kernels.h"
#include "swiglu.h"
#include "k_lanes.h"
#include "q4k_interleave.h"

/* The K-quant dot product of kquants.h: per 16-value half, pmaddubsw (unsigned weights x signed
 * activations, pairs in int16) then pmaddwd by the half's scale; the 4 int32 lanes of each of the
 * 8 blocks are summed by a phaddd tree. */
DD_INLINE void kq_dot8(const uint8_t *w, const int8_t *a, const int16_t *sc, int32_t *out)
{
    __m128i v[8];
    for (int i = 0; i < 8; i++) {
        __m128i s = _mm_setzero_si128();
        for (int h = 0; h < 2; h++) {
            const __m128i p = _mm_maddubs_epi16(_mm_loadu_si128((const __m128i *)(w + 32 * i + 16 * h)),
                                                _mm_loadu_si128((const __m128i *)(a + 32 * i + 16 * h)));
            s = _mm_add_epi32(s, _mm_madd_epi16(p, _mm_set1_epi16(sc[2 * i + h])));
        }
        v[i] = s;
    }
    for (int q = 0; q < 2; q++) {
        const __m128i h01 = _mm_hadd_epi32(v[4 * q], v[4 * q + 1]), h23 = _mm_hadd_epi32(v[4 * q + 2], v[4 * q + 3]);
        _mm_storeu_si128((__m128i *)(out + 4 * q), _mm_hadd_epi32(h01, h23));
    }
}
#define DD_KQ_DOT8 kq_dot8
#define DD_KQ_WALK_ONLY
#include "kquants.h"
#define DD_BQ_LEVEL 1
#include "bquants.h"
#define DD_LB_DOT8 kq_dot8
#include "lowbit.h"

static void quantize_q8_0(const float *x, size_t nb, uint8_t *out)
{
    const __m128 sign = _mm_set1_ps(-0.0f), half = _mm_set1_ps(0.5f), one = _mm_set1_ps(1.0f);
    for (size_t b = 0; b < nb; b++, x += DD_QK, out += DD_Q8_0_BYTES) {
        __m128 v[8];
        __m128 m = _mm_setzero_ps();
        for (int h = 0; h < 8; h++) {
            v[h] = _mm_loadu_ps(x + 4 * h);
            m = _mm_max_ps(m, _mm_andnot_ps(sign, v[h]));
        }
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        float d = _mm_cvtss_f32(m) / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = dd_f32_to_f16(d);
        memcpy(out, &dh, 2);
        __m128i q[8];
        for (int h = 0; h < 8; h++) {
            /* roundf: truncate, then step away from zero when the dropped fraction is >= 0.5 */
            __m128 t = _mm_mul_ps(v[h], _mm_set1_ps(id));
            __m128i ti = _mm_cvttps_epi32(t);
            __m128 up = _mm_cmpge_ps(_mm_andnot_ps(sign, _mm_sub_ps(t, _mm_cvtepi32_ps(ti))), half);
            __m128 step = _mm_or_ps(_mm_and_ps(sign, t), one);
            q[h] = _mm_add_epi32(ti, _mm_cvttps_epi32(_mm_and_ps(up, step)));
        }
        for (int h = 0; h < 2; h++) {
            __m128i w01 = _mm_packs_epi32(q[4 * h], q[4 * h + 1]), w23 = _mm_packs_epi32(q[4 * h + 2], q[4 * h + 3]);
            _mm_storeu_si128((__m128i *)(out + 2 + 16 * h), _mm_packs_epi16(w01, w23));
        }
    }
}

/* Blocks b .. b + n - 1 (n <= 4, b a multiple of 4) of R rows against C columns into acc[r][c] (kernels.h's f32
 * lanes b % 16 .. b % 16 + 3; n is a constant but in a short last group). A row's n blocks are expanded once for
 * its C columns; each block's dot (4 int32 lanes) meets the others in a phaddd tree, giving the n exact block
 * dots in order; missing blocks add +0. */
DD_INLINE void quad(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, int wtype, size_t c0,
                    size_t b, __m128 acc[4][4], const int R, const int C, const int n)
{
    const size_t bytes = wtype == DD_Q4_0 ? DD_Q4_0_BYTES : DD_Q8_0_BYTES;
    const __m128i ones = _mm_set1_epi16(1), low = _mm_set1_epi8(0x0f);
    for (int r = 0; r < R; r++) {
        __m128i wq[4][2], wabs[4][2];
        float f[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
        for (int k = 0; k < n; k++) {
            const uint8_t *blk = w + r * rb + (b + k) * bytes;
            dd_prefetch_weight(pf + r * rb + (b + k) * bytes);
            f[k] = dd_f16_to_f32(dd_load_u16(blk));
            if (wtype == DD_Q4_0) {
                const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 2));
                wq[k][0] = _mm_and_si128(qs, low);
                wq[k][1] = _mm_and_si128(_mm_srli_epi16(qs, 4), low);
            } else {
                for (int h = 0; h < 2; h++) {
                    wq[k][h] = _mm_loadu_si128((const __m128i *)(blk + 2 + 16 * h));
                    wabs[k][h] = _mm_sign_epi8(wq[k][h], wq[k][h]);
                }
            }
        }
        const __m128 dw = _mm_setr_ps(f[0], f[1], f[2], f[3]);
        for (int c = 0; c < C; c++) {
            const size_t col = (c0 + c) * a->nbp + b;
            __m128i d[4];
            for (int k = 0; k < 4; k++) {
                if (k >= n) {
                    d[k] = _mm_setzero_si128();
                    continue;
                }
                const __m128i *aq = (const __m128i *)(a->q + (col + k) * DD_QK);
                __m128i p0, p1;
                if (wtype == DD_Q4_0) {
                    p0 = _mm_maddubs_epi16(wq[k][0], _mm_load_si128(aq));
                    p1 = _mm_maddubs_epi16(wq[k][1], _mm_load_si128(aq + 1));
                } else {
                    p0 = _mm_maddubs_epi16(wabs[k][0], _mm_sign_epi8(_mm_load_si128(aq), wq[k][0]));
                    p1 = _mm_maddubs_epi16(wabs[k][1], _mm_sign_epi8(_mm_load_si128(aq + 1), wq[k][1]));
                }
                d[k] = _mm_add_epi32(_mm_madd_epi16(p0, ones), _mm_madd_epi16(p1, ones));
                if (wtype == DD_Q4_0) {
                    const __m128i *bp = (const __m128i *)(a->bias[DD_Q4_0] + (col + k) * 8);
                    d[k] = _mm_add_epi32(d[k], _mm_add_epi32(_mm_load_si128(bp), _mm_load_si128(bp + 1)));
                }
            }
            const __m128i dot = _mm_hadd_epi32(_mm_hadd_epi32(d[0], d[1]), _mm_hadd_epi32(d[2], d[3]));
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
    __m128d acc[4] = { _mm_setzero_pd(), _mm_setzero_pd(), _mm_setzero_pd(), _mm_setzero_pd() };
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm_prefetch((const char *)(a + i + 1024), _MM_HINT_T0);               /* a streams: 4 KiB ahead */
        for (int u = 0; u < 2; u++) {
            const __m128 x = _mm_loadu_ps(a + i + 4 * u), z = _mm_loadu_ps(b + i + 4 * u);
            acc[2 * u] = _mm_add_pd(acc[2 * u], _mm_mul_pd(_mm_cvtps_pd(x), _mm_cvtps_pd(z)));
            acc[2 * u + 1] = _mm_add_pd(acc[2 * u + 1], _mm_mul_pd(_mm_cvtps_pd(_mm_movehl_ps(x, x)),
                                                                   _mm_cvtps_pd(_mm_movehl_ps(z, z))));
        }
    }
    __m128d s = _mm_add_pd(_mm_add_pd(acc[0], acc[1]), _mm_add_pd(acc[2], acc[3]));
    double sum = _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
    for (; i < n; i++)
        sum += (double)a[i] * b[i];
    return (float)sum;
}

DD_DEFINE_DOTS_F32(dots_f32, dot_f32)

#define DD_BF16_ROWS 1
#define DD_BF16_COLS 1
#include "bf16.h"

DD_DEFINE_GEMM_IL(gemm_q4_0_il, DD_Q4_0, gemm_q4_0, NULL, NULL)
DD_DEFINE_GEMM_IL(gemm_mxfp4_il, DD_MXFP4, gemm_mxfp4, NULL, NULL)
DD_DEFINE_GEMM_Q4_K_IL(gemm_q4_k_il, gemm_q4_K, NULL, NULL)
DD_DEFINE_GEMM_RL(gemm_q2_k_rl, gemm_q2_K, dd_q2_k_rl_unpack_groups)
DD_DEFINE_GEMM_RL(gemm_q3_k_rl, gemm_q3_K, dd_q3_k_rl_unpack_groups)

DD_SWIGLU_DEFINE(swiglu, 4)

const dd_kernels dd_kernels_ssse3 = {
    .quantize_q8_0 = quantize_q8_0,
    .gemm = { gemm_q4_0, gemm_q8_0, gemm_q4_K, gemm_q5_K, gemm_q6_K, DD_BQ_GEMMS, DD_LB_GEMMS, DD_IQ_GEMMS, gemm_mxfp4, gemm_bf16, gemm_f16,
              gemm_q4_0_il, gemm_mxfp4_il, gemm_q4_k_il, gemm_q2_k_rl, gemm_q3_k_rl },
    .bias_mult = { -8, 0 },
    .dots_f32 = dots_f32,
    .swiglu = swiglu,
};
