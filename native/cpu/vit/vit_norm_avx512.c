/* LayerNorm of float32 rows (deltadesk_cpu.h dd_vit_layer_norm), AVX-512 F: the vision towers' norms.
 *
 * Per row of d values: mean = (sum of x) / d, var = (sum of (x - mean)^2) / d (biased, two passes: no
 * cancellation), rstd = 1 / sqrt(var + eps), then y = ((x - mean) * rstd) * w + b, the same roundings in
 * the same order as engine.ops.vision_reference.layer_norm (which numpy's tower runs). Each sum is kept in
 * 16 float lanes (lane l adds the values l, l + 16, ... in order; a tail shorter than 16 adds to the first
 * lanes), then the lanes are added in a fixed tree (_mm512_reduce_add_ps). A row's result therefore depends
 * on its values alone: any thread count or split of the rows gives the same bits.
 */
#include <immintrin.h>
#include <math.h>

#include "runtime.h"

#define LN_ROWS 16   /* rows of one pool task */

typedef struct {
    const float *x, *w, *b;
    float *out;
    size_t ldx, ldo, m, d;
    float eps;
} ln_job;

static inline __mmask16 ln_mask(size_t left)
{
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* One row: x (d values) -> out (may be x itself: the statistics are taken before any write). */
static void ln_row(const ln_job *j, const float *x, float *out)
{
    const size_t d = j->d;
    __m512 s = _mm512_setzero_ps();
    for (size_t i = 0; i < d; i += 16)
        s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(ln_mask(d - i), x + i));
    const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(s) / (float)d);
    __m512 v = _mm512_setzero_ps();
    for (size_t i = 0; i < d; i += 16) {
        const __mmask16 k = ln_mask(d - i);
        const __m512 c = _mm512_maskz_sub_ps(k, _mm512_maskz_loadu_ps(k, x + i), mean);
        v = _mm512_add_ps(v, _mm512_mul_ps(c, c));
    }
    const float var = _mm512_reduce_add_ps(v) / (float)d;
    const __m512 rstd = _mm512_set1_ps(1.0f / sqrtf(var + j->eps));
    for (size_t i = 0; i < d; i += 16) {
        const __mmask16 k = ln_mask(d - i);
        __m512 y = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mean), rstd);
        y = _mm512_add_ps(_mm512_mul_ps(y, _mm512_maskz_loadu_ps(k, j->w + i)), _mm512_maskz_loadu_ps(k, j->b + i));
        _mm512_mask_storeu_ps(out + i, k, y);
    }
}

static void ln_task(void *ctx, size_t task)
{
    const ln_job *j = ctx;
    const size_t r1 = (task + 1) * LN_ROWS < j->m ? (task + 1) * LN_ROWS : j->m;
    for (size_t r = task * LN_ROWS; r < r1; r++)
        ln_row(j, j->x + r * j->ldx, j->out + r * j->ldo);
}

int vit_layer_norm_avx512(const float *x, size_t ldx, size_t m, size_t d, const float *w, const float *b, float eps,
                          float *out, size_t ldo, int threads)
{
    ln_job j = { .x = x, .w = w, .b = b, .out = out, .ldx = ldx, .ldo = ldo, .m = m, .d = d, .eps = eps };
    dd_pool_for_limit(ln_task, &j, dd_div_up(m, LN_ROWS), threads);
    return DD_OK;
}
