/* Scalar C kernels: the portable level, and the plainest statement of what the SIMD files compute. */
#include <math.h>

#include "kernels.h"
#include "swiglu.h"
#include "k_lanes.h"
#include "q4k_interleave.h"

/* The K-quant dot product of kquants.h, element by element. */
static inline void kq_dot8(const uint8_t *w, const int8_t *a, const int16_t *sc, int32_t *out)
{
    for (int i = 0; i < 8; i++) {
        int32_t half[2] = { 0, 0 };
        for (int j = 0; j < DD_QK; j++)
            half[j / 16] += w[DD_QK * i + j] * a[DD_QK * i + j];
        out[i] = sc[2 * i] * half[0] + sc[2 * i + 1] * half[1];
    }
}
#define DD_KQ_DOT8 kq_dot8
#define DD_KQ_WALK_ONLY
#include "kquants.h"
#define DD_BQ_LEVEL 0
#include "bquants.h"
#define DD_LB_DOT8 kq_dot8
#include "lowbit.h"

/* Round half away from zero, as C's roundf (ggml's reference quantizer uses roundf). */
static int8_t round_away(float t)
{
    return (int8_t)roundf(t);
}

static void quantize_q8_0(const float *x, size_t nb, uint8_t *out)
{
    for (size_t b = 0; b < nb; b++, x += DD_QK, out += DD_Q8_0_BYTES) {
        float amax = 0.0f;
        for (int j = 0; j < DD_QK; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = dd_f32_to_f16(d);
        memcpy(out, &dh, 2);
        for (int j = 0; j < DD_QK; j++)
            out[2 + j] = (uint8_t)round_away(x[j] * id);
    }
}

static int32_t dot_q4_0(const uint8_t *blk, const int8_t *a)
{
    int8_t v[DD_QK];
    int32_t s = 0;
    for (int j = 0; j < 16; j++) {
        v[j] = (int8_t)((blk[2 + j] & 0x0f) - 8);
        v[j + 16] = (int8_t)((blk[2 + j] >> 4) - 8);
    }
    for (int j = 0; j < DD_QK; j++)
        s += v[j] * a[j];
    return s;
}

static int32_t dot_q8_0(const uint8_t *blk, const int8_t *a)
{
    int32_t s = 0;
    for (int j = 0; j < DD_QK; j++)
        s += (int8_t)blk[2 + j] * a[j];
    return s;
}

static inline __attribute__((always_inline)) void gemm(const uint8_t *w, size_t row_bytes, size_t nrows, const dd_acts *a, float *y,
                 size_t ldy, size_t block_bytes, int32_t (*dot)(const uint8_t *, const int8_t *))
{
    for (size_t r = 0; r < nrows; r++) {
        const uint8_t *row = w + r * row_bytes;
        for (size_t c = 0; c < a->m; c++) {
            const int8_t *q = a->q + c * a->nbp * DD_QK;
            const float *d = a->bd + c * a->nbp;
            float acc[DD_Q4Q8_LANES] = { 0 };
            for (size_t b = 0; b < a->nb; b++) {
                const uint8_t *blk = row + b * block_bytes;
                const float scale = dd_f16_to_f32(dd_load_u16(blk)) * d[b];   /* exact: 11 x 11 bits */
                acc[b % DD_Q4Q8_LANES] += (float)dot(blk, q + b * DD_QK) * scale;
            }
            y[c * ldy + r] = dd_tree16_f32(acc);
        }
    }
}

static void gemm_q4_0(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a,
                      float *y, size_t ldy)
{
    (void)rows_avail;
    gemm(w, row_bytes, nrows, a, y, ldy, DD_Q4_0_BYTES, dot_q4_0);
}

static void gemm_q8_0(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a,
                      float *y, size_t ldy)
{
    (void)rows_avail;
    gemm(w, row_bytes, nrows, a, y, ldy, DD_Q8_0_BYTES, dot_q8_0);
}

static float dot_f32(const float *a, const float *b, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)a[i] * b[i];
    return (float)s;
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

const dd_kernels dd_kernels_scalar = {
    .quantize_q8_0 = quantize_q8_0,
    .gemm = { gemm_q4_0, gemm_q8_0, gemm_q4_K, gemm_q5_K, gemm_q6_K, DD_BQ_GEMMS, DD_LB_GEMMS, DD_IQ_GEMMS, gemm_mxfp4, gemm_bf16, gemm_f16,
              gemm_q4_0_il, gemm_mxfp4_il, gemm_q4_k_il, gemm_q2_k_rl, gemm_q3_k_rl },
    .bias_mult = { 0, 0 },
    .dots_f32 = dots_f32,
    .swiglu = swiglu,
};
