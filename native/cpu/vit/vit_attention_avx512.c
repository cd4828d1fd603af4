/* Full (non-causal) ViT attention over the pieces of a stack (deltadesk_cpu.h dd_vit_attention), AVX-512 F,
 * on the GEMM's micro-kernel (sgemm_kernel.h).
 *
 * One task per (piece, head). It lays the head's keys out as a packed weight of S "output columns" over
 * k = hd (so q . k_j is the GEMM's sum), and its values as one of hd output columns over k = S. Then for
 * each block of SG_MR queries: the queries times 1/sqrt(hd) into a row buffer, their S scores (one FMA
 * chain over d each) into a buffer kept in SG_KC-key blocks (the layout the micro-kernel reads as x), the
 * softmax of each row (row max, exp(s - max), their float sum in 16 lanes reduced in a fixed order, times
 * 1 / sum), and the probabilities times the values (one FMA chain over the keys in order). Every output
 * element is thus computed by the same operations whatever the thread count, and a piece gives the same
 * bits alone or in a stack.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "sgemm_kernel.h"

typedef struct {
    const float *qkv;
    size_t ldq, n_head, hd;
    const size_t *starts;
    float *out;
    size_t ldo;
    _Atomic int err;
} vit_job;

/* One (piece, head): s rows from row0; q, k, v at columns h*hd of the three n_head*hd-wide parts. */
typedef struct {
    const float *q, *k, *v;     /* the head's first row */
    size_t ldq, s, hd, nkb;     /* nkb: key blocks of SG_KC */
    float *kp, *vp, *qb, *sc, *acc;
    float *out;
    size_t ldo;
} vit_head;

/* Keys as a packed (s, hd) weight, values as a packed (hd, s) one (dd_sgemm_pack_rows's layout). */
static void vit_pack(const vit_head *a)
{
    for (size_t j0 = 0; j0 < a->s; j0 += NR)
        for (size_t d = 0; d < a->hd; d++)
            for (size_t c = 0; c < NR; c++)
                a->kp[j0 * a->hd + d * NR + c] = j0 + c < a->s ? a->k[(j0 + c) * a->ldq + d] : 0.0f;
    for (size_t c0 = 0; c0 < a->hd; c0 += NR)
        for (size_t j = 0; j < a->s; j++)
            for (size_t c = 0; c < NR; c++)
                a->vp[c0 * a->s + j * NR + c] = c0 + c < a->hd ? a->v[j * a->ldq + c0 + c] : 0.0f;
}

/* Scores of `rows` queries from i0 into a->sc: key block b, query r, key j at sc[b*SG_MR*SG_KC + r*SG_KC + j]. */
static void vit_scores(const vit_head *a, size_t i0, size_t rows)
{
    const float scale = 1.0f / sqrtf((float)a->hd);
    for (size_t r = 0; r < rows; r++)
        for (size_t d = 0; d < a->hd; d++)
            a->qb[r * SG_KC + d] = a->q[(i0 + r) * a->ldq + d] * scale;
    for (size_t j0 = 0; j0 < a->s; j0 += NR) {
        sg_tile t = {
            .a = a->qb, .b = a->kp + j0 * a->hd, .pf = a->kp + j0 * a->hd, .kc = a->hd, .acc = a->acc,
            .first = 1, .last = 1, .out = a->sc + j0 / SG_KC * SG_MR * SG_KC + j0 % SG_KC, .ldo = SG_KC,
            .cols = a->s - j0 < NR ? a->s - j0 : NR, .act = DD_ACT_NONE,
        };
        sg_tile_fn(t.cols)[rows](&t);
    }
}

/* Row r of the scores -> its softmax, in place. */
static void vit_softmax_row(const vit_head *a, size_t r)
{
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int pass = 0; pass < 3; pass++) {
        const float m = _mm512_reduce_max_ps(mx), inv = pass == 2 ? 1.0f / _mm512_reduce_add_ps(sum) : 0.0f;
        for (size_t j = 0; j < a->s; j += 16) {
            const __mmask16 k = a->s - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (a->s - j)) - 1);
            float *p = a->sc + j / SG_KC * SG_MR * SG_KC + r * SG_KC + j % SG_KC;
            const __m512 x = _mm512_maskz_loadu_ps(k, p);
            if (pass == 0) {
                mx = _mm512_mask_max_ps(mx, k, mx, x);
            } else if (pass == 1) {
                const __m512 e = sg_exp(_mm512_sub_ps(x, _mm512_set1_ps(m)));
                sum = _mm512_mask_add_ps(sum, k, sum, e);
                _mm512_mask_storeu_ps(p, k, e);
            } else {
                _mm512_mask_storeu_ps(p, k, _mm512_mul_ps(x, _mm512_set1_ps(inv)));
            }
        }
    }
}

/* The probabilities of `rows` queries from i0 times the values, into the output rows. */
static void vit_weighted_sum(const vit_head *a, size_t i0, size_t rows)
{
    for (size_t c0 = 0; c0 < a->hd; c0 += NR) {
        for (size_t b = 0; b < a->nkb; b++) {
            const size_t j0 = b * SG_KC;
            const float *vb = a->vp + c0 * a->s + j0 * NR;
            sg_tile t = {
                .a = a->sc + b * SG_MR * SG_KC, .b = vb, .pf = vb, .kc = a->s - j0 < SG_KC ? a->s - j0 : SG_KC,
                .acc = a->acc, .first = b == 0, .last = b + 1 == a->nkb, .out = a->out + i0 * a->ldo + c0,
                .ldo = a->ldo, .cols = a->hd - c0 < NR ? a->hd - c0 : NR, .act = DD_ACT_NONE,
            };
            sg_tile_fn(t.cols)[rows](&t);
        }
    }
}

static void vit_task(void *ctx, size_t task)
{
    vit_job *j = ctx;
    const size_t piece = task / j->n_head, h = task % j->n_head, row0 = j->starts[piece];
    const size_t s = j->starts[piece + 1] - row0, hd = j->hd, width = j->n_head * hd;
    const size_t nkb = dd_div_up(s, SG_KC), s_pad = dd_div_up(s, NR) * NR, hd_pad = dd_div_up(hd, NR) * NR;
    /* kept per thread between tasks and calls (dd_scratch): a fresh block per task cost ~5 % of a 1024-row head
     * in the kernel's page clearing */
    const size_t floats = s_pad * hd + hd_pad * s + SG_MR * SG_KC * (1 + nkb) + SG_MR * NR;
    float *mem = dd_scratch(DD_SCRATCH_VIT, floats * sizeof(float));
    if (mem == NULL) {
        atomic_store(&j->err, DD_ERR_NOMEM);
        return;
    }
    const float *q = j->qkv + row0 * j->ldq + h * hd;
    vit_head a = {
        .q = q, .k = q + width, .v = q + 2 * width, .ldq = j->ldq, .s = s, .hd = hd, .nkb = nkb,
        .kp = mem, .vp = mem + s_pad * hd, .qb = mem + s_pad * hd + hd_pad * s,
        .out = j->out + row0 * j->ldo + h * hd, .ldo = j->ldo,
    };
    a.sc = a.qb + SG_MR * SG_KC;
    a.acc = a.sc + SG_MR * SG_KC * nkb;
    vit_pack(&a);
    for (size_t i0 = 0; i0 < s; i0 += SG_MR) {
        const size_t rows = s - i0 < SG_MR ? s - i0 : SG_MR;
        vit_scores(&a, i0, rows);
        for (size_t r = 0; r < rows; r++)
            vit_softmax_row(&a, r);
        vit_weighted_sum(&a, i0, rows);
    }
}

int vit_attention_avx512(const float *qkv, size_t ldq, const size_t *starts, size_t n_piece, size_t n_head,
                         size_t hd, float *out, size_t ldo, int threads)
{
    vit_job j = { .qkv = qkv, .ldq = ldq, .n_head = n_head, .hd = hd, .starts = starts, .out = out, .ldo = ldo };
    atomic_init(&j.err, DD_OK);
    dd_pool_for_limit(vit_task, &j, n_piece * n_head, threads);
    return atomic_load(&j.err);
}
