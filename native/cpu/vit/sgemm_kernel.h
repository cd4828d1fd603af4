/* The float32 micro-kernel's interface, shared by the GEMM (sgemm_avx512.c) and the ViT attention
 * (vit_attention_avx512.c); both are compiled with -mavx512f. sgemm_avx512.c says how the kernel works.
 * dd_sg_tiles[R] computes an R x NR block (R = 1 .. SG_MR) of one k block as described by an sg_tile. */
#ifndef DELTADESK_SGEMM_KERNEL_H
#define DELTADESK_SGEMM_KERNEL_H

#include <immintrin.h>

#include "runtime.h"

#define NR DD_SGEMM_NR
#define SG_MR 12     /* rows of the micro-kernel: 24 accumulators + 2 weight vectors of 32 zmm */
#define SG_KC 256    /* k block: a weight panel is SG_KC * NR * 4 = 32 KiB (L1 is 48 KiB) */
#define SG_MC 96     /* rows of a task: its x block is SG_MC * SG_KC * 4 = 96 KiB (in L2) */
#define SG_NC_MAX 512

#define SG_INLINE static inline __attribute__((always_inline))

/* What one micro-kernel call works on. */
typedef struct {
    const float *a;         /* SG_MR rows of the x block, row stride SG_KC */
    const float *b;         /* the weight panel at the block's first k: kc rows of NR */
    const float *pf;        /* kc * 4 floats of the next panel, prefetched into L2 one line per 4 k steps */
    size_t kc;
    float *acc;             /* SG_MR x NR scratch sums (row stride NR) */
    int first, last;        /* the first k block (start from 0) / the last one (epilogue) */
    const float *bias, *add;/* at the tile's first column (bias) / first row and column (add); may be NULL */
    float *out;
    size_t ld_add, ldo, cols;   /* cols: valid columns of the tile, 1..NR */
    int act;
} sg_tile;

extern void (*const dd_sg_tiles[SG_MR + 1])(const sg_tile *);
/* The same for a panel of at most 16 valid columns (t->cols <= 16): only those are computed (half the FMAs). */
extern void (*const dd_sg_half_tiles[SG_MR + 1])(const sg_tile *);

/* The tile functions for a panel of `cols` valid columns: the same sums either way. */
SG_INLINE void (*const *sg_tile_fn(size_t cols))(const sg_tile *)
{
    return cols <= 16 ? dd_sg_half_tiles : dd_sg_tiles;
}

/* ---- vector math of the epilogue --------------------------------------------------------------- */

/* exp(x), float32: n = round(x log2 e), r = x - n ln 2 (Cody-Waite split of ln 2, exact for |n| < 2^15),
 * e^r by its Taylor polynomial of degree 7 (|r| <= ln2 / 2: truncation below 5e-9 relative), times 2^n
 * by vscalefps (which gives 0 or inf outside float range). x is clamped to [-104, 89] first. */
SG_INLINE __m512 sg_exp(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    static const float inv_fact[] = { 1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f };
    __m512 p = _mm512_set1_ps(inv_fact[0]);
    for (int i = 1; i < 8; i++)
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(inv_fact[i]));
    return _mm512_scalef_ps(p, n);
}

/* GELU, tanh form: 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3) (HF
 * gelu_pytorch_tanh). */
SG_INLINE __m512 sg_gelu_tanh(__m512 x)
{
    const __m512 x2 = _mm512_mul_ps(x, x);
    const __m512 u = _mm512_mul_ps(x, _mm512_fmadd_ps(x2, _mm512_set1_ps(0.0356774081363001f),
                                                      _mm512_set1_ps(0.797884560802865f)));
    const __m512 e = sg_exp(_mm512_mul_ps(u, _mm512_set1_ps(-2.0f)));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

/* GELU, exact form: 0.5 x erfc(-x / sqrt 2) (HF nn.GELU()), erfc by Numerical Recipes (3rd ed.) section
 * 6.2.2: erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z/2) for z >= 0, erfc(-z) = 2 - erfc(z). */
SG_INLINE __m512 sg_gelu_erf(__m512 x)
{
    static const float coef[] = { 0.17087277f, -0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f,
                                  -0.18628806f, 0.09678418f, 0.37409196f, 1.00002368f, -1.26551223f };
    const __m512 z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.707106781186547524f));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(z, _mm512_set1_ps(0.5f), one));
    __m512 p = _mm512_set1_ps(coef[0]);
    for (int i = 1; i < 10; i++)
        p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(coef[i]));
    const __m512 r = _mm512_mul_ps(t, sg_exp(_mm512_fnmadd_ps(z, z, p)));
    const __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 e = _mm512_mask_sub_ps(r, pos, _mm512_set1_ps(2.0f), r);   /* erfc(-x / sqrt 2) */
    return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), e);
}

SG_INLINE __m512 sg_act(__m512 v, int act)
{
    return act == DD_ACT_GELU_TANH ? sg_gelu_tanh(v) : act == DD_ACT_GELU_ERF ? sg_gelu_erf(v) : v;
}

#endif
