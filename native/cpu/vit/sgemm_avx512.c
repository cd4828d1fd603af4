/* float32 GEMM with pre-packed weights and a fused epilogue (deltadesk_cpu.h dd_sgemm), AVX-512 F.
 *
 * Blocking (the BLIS scheme: Van Zee & van de Geijn, "BLIS: A Framework for Rapidly Instantiating BLAS
 * Functionality", ACM TOMS 41(3), 2015): the output is cut into tasks of up to SG_MC rows x nc columns
 * (nc a multiple of NR, chosen per call so that every thread gets several tasks), which the pool runs. A
 * task walks k in blocks of SG_KC. For each block it copies its rows' x values into a buffer with a fixed
 * row stride of SG_KC floats (so the micro-kernel addresses them with constant offsets), then for each
 * NR-column panel of the packed weights (kc x NR floats, about 32 KiB: it stays in L1) runs the
 * micro-kernel down the row panels (SG_MR rows each; the copied rows stay in L2). While it does, the
 * micro-kernel calls prefetch the next panel into L2, a line every 4 k steps: without that the panels
 * arrive at the hardware prefetcher's pace and the kernel did 81-101 GFLOP/s, with it 147 (~89 % of a
 * plain FMA loop's 165; one core of the dev machine, 1024 x 1152 x 4304).
 *
 * The micro-kernel holds an SG_MR x NR block of sums in 2 * SG_MR zmm registers; each k step loads the
 * panel's NR weights (2 vectors) and broadcasts one x value per row into a fused multiply-add. Between k
 * blocks the sums wait in a per-thread scratch tile and the next block continues the same chains, so an
 * output element is one FMA chain over k = 0 .. k - 1 in order, started from 0, whatever the blocking,
 * the task shape or the thread that runs it: results are bit-identical for any thread count and for any
 * split of the rows (a row gives the same bits alone or in a stack). After the last block the epilogue
 * adds the bias, applies the activation and adds `add`, storing only the columns below n.
 */
#include <stdatomic.h>
#include <stdlib.h>

#include "sgemm_kernel.h"

typedef struct {
    const float *x, *packed, *bias, *add;
    float *out;
    size_t ldx, ld_add, ldo, m, k, n;
    int act;
    size_t nc, col_tasks;   /* columns per task (a multiple of NR) and tasks per row block */
    _Atomic int err;
} sgemm_job;

int sgemm_act_avx512(int act, const float *x, size_t n, float *y)
{
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(y + i, m, sg_act(_mm512_maskz_loadu_ps(m, x + i), act));
    }
    return DD_OK;
}

/* ---- the micro-kernel ------------------------------------------------------------------------------ */

/* Bias, activation and add on one row's two vectors of sums; stores the row's valid columns. */
SG_INLINE void sg_store_row(const sg_tile *t, size_t r, __m512 lo, __m512 hi)
{
    const size_t cols = t->cols;
    const __mmask16 m0 = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? (__mmask16)0xFFFF : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
    if (t->bias != NULL) {
        lo = _mm512_add_ps(lo, _mm512_maskz_loadu_ps(m0, t->bias));
        hi = _mm512_add_ps(hi, _mm512_maskz_loadu_ps(m1, t->bias + 16));
    }
    lo = sg_act(lo, t->act);
    hi = sg_act(hi, t->act);
    if (t->add != NULL) {
        lo = _mm512_add_ps(lo, _mm512_maskz_loadu_ps(m0, t->add + r * t->ld_add));
        hi = _mm512_add_ps(hi, _mm512_maskz_loadu_ps(m1, t->add + r * t->ld_add + 16));
    }
    _mm512_mask_storeu_ps(t->out + r * t->ldo, m0, lo);
    _mm512_mask_storeu_ps(t->out + r * t->ldo + 16, m1, hi);
}

/* One k step of the R x (16 W) block of sums (W = 2: a whole panel, W = 1: its first 16 columns, for a last
 * panel of at most 16 valid columns): the step's weights against one x value per row. */
SG_INLINE void sg_step(const float *a, const float *b, __m512 *c0, __m512 *c1, const int R, const int W)
{
    const __m512 b0 = _mm512_loadu_ps(b), b1 = W == 2 ? _mm512_loadu_ps(b + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int r = 0; r < R; r++) {
        const __m512 av = _mm512_set1_ps(a[r * SG_KC]);
        c0[r] = _mm512_fmadd_ps(av, b0, c0[r]);
        if (W == 2)
            c1[r] = _mm512_fmadd_ps(av, b1, c1[r]);
    }
}

/* R rows x 16 W columns (R, W compile-time constants after inlining) over one k block, prefetching t->pf.
 * With W = 1 the columns past 16 are neither computed nor stored (t->cols <= 16). */
SG_INLINE void sg_tile_rows(const sg_tile *t, const int R, const int W)
{
    __m512 c0[SG_MR], c1[SG_MR];
#pragma GCC unroll 12
    for (int r = 0; r < R; r++) {
        c0[r] = t->first ? _mm512_setzero_ps() : _mm512_load_ps(t->acc + r * NR);
        c1[r] = t->first || W == 1 ? _mm512_setzero_ps() : _mm512_load_ps(t->acc + r * NR + 16);
    }
    const float *a = t->a, *b = t->b;
    const char *pf = (const char *)t->pf;
    size_t kk = 0;
    for (; kk + 4 <= t->kc; kk += 4, pf += 64) {
        _mm_prefetch(pf, _MM_HINT_T1);
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++, a++, b += NR)
            sg_step(a, b, c0, c1, R, W);
    }
    for (; kk < t->kc; kk++, a++, b += NR)
        sg_step(a, b, c0, c1, R, W);
#pragma GCC unroll 12
    for (int r = 0; r < R; r++) {
        if (t->last) {
            sg_store_row(t, (size_t)r, c0[r], c1[r]);
        } else {
            _mm512_store_ps(t->acc + r * NR, c0[r]);
            if (W == 2)
                _mm512_store_ps(t->acc + r * NR + 16, c1[r]);
        }
    }
}

#define SG_TILE(R) static void sg_tile_##R(const sg_tile *t) { sg_tile_rows(t, R, 2); } \
                   static void sg_half_##R(const sg_tile *t) { sg_tile_rows(t, R, 1); }
SG_TILE(1) SG_TILE(2) SG_TILE(3) SG_TILE(4) SG_TILE(5) SG_TILE(6)
SG_TILE(7) SG_TILE(8) SG_TILE(9) SG_TILE(10) SG_TILE(11) SG_TILE(12)

void (*const dd_sg_tiles[SG_MR + 1])(const sg_tile *) = {
    NULL, sg_tile_1, sg_tile_2, sg_tile_3, sg_tile_4, sg_tile_5, sg_tile_6,
    sg_tile_7, sg_tile_8, sg_tile_9, sg_tile_10, sg_tile_11, sg_tile_12,
};

void (*const dd_sg_half_tiles[SG_MR + 1])(const sg_tile *) = {
    NULL, sg_half_1, sg_half_2, sg_half_3, sg_half_4, sg_half_5, sg_half_6,
    sg_half_7, sg_half_8, sg_half_9, sg_half_10, sg_half_11, sg_half_12,
};

/* ---- tasks ------------------------------------------------------------------------------------------ */

/* Rows [r0, r0 + mr) x columns [k0, k0 + kc) of x into buf, row stride SG_KC, 16 floats per vector move (GCC
 * inlined memcpy here as `rep movsq`: 4.5 % of a 256 x 4304 x 1152 product under perf, now 3.8 %). */
static void sg_copy_x(const sgemm_job *j, size_t r0, size_t mr, size_t k0, size_t kc, float *buf)
{
    for (size_t r = 0; r < mr; r++) {
        const float *src = j->x + (r0 + r) * j->ldx + k0;
        float *dst = buf + r * SG_KC;
        size_t i = 0;
        for (; i + 16 <= kc; i += 16)
            _mm512_store_ps(dst + i, _mm512_loadu_ps(src + i));
        if (i < kc) {
            const __mmask16 tail = (__mmask16)((1u << (kc - i)) - 1);
            _mm512_mask_storeu_ps(dst + i, tail, _mm512_maskz_loadu_ps(tail, src + i));
        }
    }
}

/* One k block of a task: every NR panel of its columns against every SG_MR panel of its rows. */
static void sg_task_block(const sgemm_job *j, size_t r0, size_t mr, size_t c0, size_t nc, size_t k0,
                          const float *xb, float *acc)
{
    const size_t kc = j->k - k0 < SG_KC ? j->k - k0 : SG_KC;
    for (size_t jc = 0; jc < nc; jc += NR) {
        const size_t col = c0 + jc;
        sg_tile t = {
            .b = j->packed + col * j->k + k0 * NR, .kc = kc, .first = k0 == 0, .last = k0 + kc == j->k,
            .bias = j->bias != NULL ? j->bias + col : NULL, .ld_add = j->ld_add, .ldo = j->ldo,
            .cols = j->n - col < NR ? j->n - col : NR, .act = j->act,
        };
        for (size_t ir = 0; ir < mr; ir += SG_MR) {
            const size_t rows = mr - ir < SG_MR ? mr - ir : SG_MR;
            t.pf = t.b + (jc + NR < nc ? j->k * NR : 0) + ir / SG_MR * kc * 4;
            t.a = xb + ir * SG_KC;
            t.acc = acc + (jc * SG_MC + ir * NR);
            t.add = j->add != NULL ? j->add + (r0 + ir) * j->ld_add + col : NULL;
            t.out = j->out + (r0 + ir) * j->ldo + col;
            sg_tile_fn(t.cols)[rows](&t);
        }
    }
}

static void sg_task(void *ctx, size_t task)
{
    sgemm_job *j = ctx;
    const size_t r0 = task / j->col_tasks * SG_MC, c0 = task % j->col_tasks * j->nc;
    const size_t mr = j->m - r0 < SG_MC ? j->m - r0 : SG_MC;
    const size_t nc = j->n - c0 < j->nc ? j->n - c0 : j->nc;
    /* the x block (SG_MC x SG_KC) and the task's sums (SG_MC x SG_NC_MAX), kept per thread (dd_scratch) */
    float *xb = dd_scratch(DD_SCRATCH_SGEMM, (size_t)SG_MC * (SG_KC + SG_NC_MAX) * sizeof(float));
    if (xb == NULL) {
        atomic_store(&j->err, DD_ERR_NOMEM);
        return;
    }
    float *acc = xb + (size_t)SG_MC * SG_KC;
    for (size_t k0 = 0; k0 < j->k; k0 += SG_KC) {
        const size_t kc = j->k - k0 < SG_KC ? j->k - k0 : SG_KC;
        sg_copy_x(j, r0, mr, k0, kc, xb);
        sg_task_block(j, r0, mr, c0, nc, k0, xb, acc);
    }
}

/* Columns per task: the widest multiple of NR up to SG_NC_MAX that still gives each thread 8 tasks,
 * but at least 4 panels (narrower tasks copy their x block too often for the work they do). */
static size_t sg_task_cols(size_t m, size_t n, int threads)
{
    const size_t row_tasks = dd_div_up(m, SG_MC), want = 8 * (size_t)(threads > 1 ? threads : 1);
    size_t nc = SG_NC_MAX;
    while (nc > 4 * NR && row_tasks * dd_div_up(n, nc) < want)
        nc -= NR;
    return nc;
}

int sgemm_avx512(const float *x, size_t ldx, size_t m, size_t k, const float *packed, size_t n,
                 const float *bias, int act, const float *add, size_t ld_add, float *out, size_t ldo, int threads)
{
    sgemm_job j = {
        .x = x, .packed = packed, .bias = bias, .add = add, .out = out,
        .ldx = ldx, .ld_add = ld_add, .ldo = ldo, .m = m, .k = k, .n = n, .act = act,
        .nc = sg_task_cols(m, n, threads),
    };
    j.col_tasks = dd_div_up(n, j.nc);
    atomic_init(&j.err, DD_OK);
    dd_pool_for_limit(sg_task, &j, dd_div_up(m, SG_MC) * j.col_tasks, threads);
    return atomic_load(&j.err);
}
