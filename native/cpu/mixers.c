/* The Gated DeltaNet recurrent step of one token and its prefill loop (see deltadesk_cpu.h). Math:
 * docs/spec/qwen35.md 3.2 steps 2-6; the numpy twins in engine/arch/qwen35/cpu_mixers.py. (Attention
 * over the KV cache is attention.c.)
 *
 * One portable C file for every ISA level: the hot loops are elementwise over a contiguous head
 * row (no reductions across vector lanes), so the compiler vectorises them at the x86-64 baseline
 * and, with contraction off and no -ffast-math, every level gives the same bits. Reductions
 * (norms, dot products) run in double over a fixed order. Work is split into chunks fixed by the
 * shapes (v-heads), never by the thread count, so results do not depend on it either.
 */
#include <math.h>
#include <stdlib.h>

#include "runtime.h"

static double sigmoid(double x)
{
    const double e = exp(-fabs(x));
    return x >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

static double softplus(double x)
{
    return (x > 0 ? x : 0.0) + log1p(exp(-fabs(x)));
}

/* ---- Gated DeltaNet ---------------------------------------------------------------------- */

typedef struct {
    const dd_gdn_layer *L;
    const float *u;        /* conv_dim: q (scaled), k (normalised), v */
    const float *z;        /* n_v * dv */
    const float *beta;     /* n_v */
    const double *decay;   /* n_v: exp(g) */
    float *ssm;            /* n_v * dk * dv */
    float *y;              /* n_v * dv */
} gdn_job;

/* v-head h: S <- decay S; d = beta (v - S^T k); S <- S + k d^T; o = S^T q; y = rmsnorm(o) w silu(z).
 * S is dk rows of dv (transformers layout); o is taken as decay S^T q + d (k . q) from the old S,
 * which equals S_new^T q, so S is read in one pass and written in a second. */
static void gdn_head(void *ctx, size_t h)
{
    const gdn_job *j = ctx;
    const dd_gdn_layer *L = j->L;
    const size_t dk = L->dk, dv = L->dv, kh = h % L->n_k;
    const float *q = j->u + kh * dk, *k = j->u + L->n_k * dk + kh * dk;
    const float *v = j->u + 2 * L->n_k * dk + h * dv;
    float *S = j->ssm + h * dk * dv, *y = j->y + h * dv;
    float r[DD_GDN_MAX_DV], sq[DD_GDN_MAX_DV], d[DD_GDN_MAX_DV];
    const float decay = (float)j->decay[h];
    double kq = 0.0;
    for (size_t jx = 0; jx < dv; jx++)
        r[jx] = sq[jx] = 0.0f;
    for (size_t i = 0; i < dk; i++) {
        const float *row = S + i * dv;
        const float ki = k[i], qi = q[i];
        for (size_t jx = 0; jx < dv; jx++) {
            r[jx] += row[jx] * ki;
            sq[jx] += row[jx] * qi;
        }
        kq += (double)ki * qi;
    }
    double ss = 0.0;
    for (size_t jx = 0; jx < dv; jx++) {
        d[jx] = j->beta[h] * (v[jx] - decay * r[jx]);
        const float o = decay * sq[jx] + d[jx] * (float)kq;
        y[jx] = o;
        ss += (double)o * o;
    }
    for (size_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float ki = k[i];
        for (size_t jx = 0; jx < dv; jx++)
            row[jx] = decay * row[jx] + ki * d[jx];
    }
    const double inv = 1.0 / sqrt(ss / (double)dv + L->eps);
    const float *z = j->z + h * dv;
    for (size_t jx = 0; jx < dv; jx++)
        y[jx] = (float)((double)y[jx] * inv * L->norm_w[jx] * z[jx] * sigmoid(z[jx]));
}

/* x / sqrt(sum x^2 + eps) * scale, in place, the norm in double. */
static void l2norm(float *x, size_t n, double eps, float scale)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)x[i] * x[i];
    const double inv = 1.0 / sqrt(s + eps);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(x[i] * inv) * scale;
}

static int gdn_layer_ok(const dd_gdn_layer *L)
{
    return !(L->dv == 0 || L->dv > DD_GDN_MAX_DV || L->dk == 0 || L->n_k == 0 || L->n_v % L->n_k != 0 ||
             L->conv_kernel < 1);
}

/* One token's inputs of the delta rule: the conv over [state; mixed], SiLU, the q/k L2 norms into u
 * (conv_dim), beta and the decay (n_v each); the conv state shifts by one row. */
static void gdn_inputs(const dd_gdn_layer *L, const float *mixed, const float *b, const float *a,
                       float *conv_state, float *u, float *beta, double *decay)
{
    const size_t C = 2 * L->n_k * L->dk + L->n_v * L->dv, K = L->conv_kernel;
    /* causal conv over [state; mixed] (K taps, column K-1 the current token), SiLU; shift the state */
    for (size_t c = 0; c < C; c++) {
        const float *w = L->conv_w + c * K;
        double s = 0.0;
        for (size_t t = 0; t + 1 < K; t++)
            s += (double)w[t] * conv_state[t * C + c];
        s += (double)w[K - 1] * mixed[c];
        const float cf = (float)s;
        u[c] = (float)(cf * sigmoid(cf));
        for (size_t t = 0; t + 2 < K; t++)
            conv_state[t * C + c] = conv_state[(t + 1) * C + c];
        if (K > 1)
            conv_state[(K - 2) * C + c] = mixed[c];
    }
    const float qscale = (float)(1.0 / sqrt((double)L->dk));
    for (size_t h = 0; h < L->n_k; h++) {
        l2norm(u + h * L->dk, L->dk, L->eps, qscale);
        l2norm(u + (L->n_k + h) * L->dk, L->dk, L->eps, 1.0f);
    }
    for (size_t h = 0; h < L->n_v; h++) {
        beta[h] = (float)sigmoid(b[h]);
        const float g = L->ssm_a[h] * (float)softplus(a[h] + L->dt_bias[h]);
        decay[h] = exp((double)g);
    }
}

int dd_gdn_decode(const dd_gdn_layer *L, const float *mixed, const float *z, const float *b, const float *a,
                  float *conv_state, float *ssm, float *y)
{
    return dd_gdn_prefill(L, 1, mixed, z, b, a, conv_state, ssm, y);
}

typedef struct {
    gdn_job *tokens;   /* one job per token, in order */
    size_t n;
} gdn_run;

/* v-head h through every token in order: the same gdn_head step a one-token call makes. */
static void gdn_head_run(void *ctx, size_t h)
{
    const gdn_run *r = ctx;
    for (size_t t = 0; t < r->n; t++)
        gdn_head(&r->tokens[t], h);
}

int dd_gdn_prefill(const dd_gdn_layer *L, size_t n, const float *mixed, const float *z, const float *b,
                   const float *a, float *conv_state, float *ssm, float *y)
{
    if (!gdn_layer_ok(L) || n == 0)
        return DD_ERR_ARG;
    const size_t C = 2 * L->n_k * L->dk + L->n_v * L->dv, nv = L->n_v, nvd = L->n_v * L->dv;
    double *decay = malloc(n * (nv * sizeof(double) + (C + nv) * sizeof(float)));
    gdn_job *jobs = malloc(n * sizeof(gdn_job));
    if (decay == NULL || jobs == NULL) {
        free(decay);
        free(jobs);
        return DD_ERR_NOMEM;
    }
    float *u = (float *)(decay + n * nv), *beta = u + n * C;
    for (size_t t = 0; t < n; t++) {
        gdn_inputs(L, mixed + t * C, b + t * nv, a + t * nv, conv_state, u + t * C, beta + t * nv, decay + t * nv);
        jobs[t] = (gdn_job){ .L = L, .u = u + t * C, .z = z + t * nvd, .beta = beta + t * nv,
                             .decay = decay + t * nv, .ssm = ssm, .y = y + t * nvd };
    }
    gdn_run run = { .tokens = jobs, .n = n };
    dd_pool_for(gdn_head_run, &run, nv);
    free(decay);
    free(jobs);
    return DD_OK;
}
