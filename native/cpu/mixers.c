/* The two token mixers of one decoded token (see deltadesk_cpu.h): the Gated DeltaNet recurrent
 * step and single-query gated GQA attention over the KV cache. Math: shared/spec/qwen35moe.md
 * 3.2 steps 2-6 and 3.1 steps 5-6; the numpy twins in engine/backends/cpu_mixers.py.
 *
 * One portable C file for every ISA level: the hot loops are elementwise over a contiguous head
 * row (no reductions across vector lanes), so the compiler vectorises them at the x86-64 baseline
 * and, with contraction off and no -ffast-math, every level gives the same bits. Reductions
 * (norms, dot products) run in double over a fixed order. Work is split into chunks fixed by the
 * shapes (v-heads; kv head x position block), never by the thread count, so results do not depend
 * on it either.
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

/* ---- single-query gated attention ---------------------------------------------------------- */

#define ATTN_BLOCK 256    /* cache positions per chunk */

typedef struct {
    size_t n_head, n_kv, hd, group, m, row;   /* row: floats between cache positions */
    const float *q, *k, *v;
    float *part_o;        /* [kv head][block][group][hd] */
    double *part_ml;      /* [kv head][block][group][2]: block max score, sum of exp(score - max) */
    size_t n_blocks;
    float scale;
} attn_job;

/* q . k over n values (n % DD_ATTN_LANES == 0) as DD_ATTN_LANES f32 partial sums added in a fixed
 * order: the lane loop vectorises, and the order is the same at every ISA level. */
static float dot_lanes(const float *q, const float *k, size_t n)
{
    float acc[DD_ATTN_LANES] = { 0 };
    for (size_t i = 0; i < n; i += DD_ATTN_LANES)
        for (size_t l = 0; l < DD_ATTN_LANES; l++)
            acc[l] += q[i + l] * k[i + l];
    double s = 0.0;
    for (size_t l = 0; l < DD_ATTN_LANES; l++)
        s += acc[l];
    return (float)s;
}

/* One kv head x one block of positions, for the group of q heads reading that kv head. */
static void attn_block(void *ctx, size_t chunk)
{
    const attn_job *j = ctx;
    const size_t kvh = chunk / j->n_blocks, blk = chunk % j->n_blocks, hd = j->hd;
    const size_t t0 = blk * ATTN_BLOCK, t1 = t0 + ATTN_BLOCK < j->m ? t0 + ATTN_BLOCK : j->m;
    float s[ATTN_BLOCK];
    for (size_t g = 0; g < j->group; g++) {
        const float *q = j->q + (kvh * j->group + g) * hd;
        float mx = -INFINITY;
        double sum = 0.0;
        for (size_t t = t0; t < t1; t++) {
            s[t - t0] = dot_lanes(q, j->k + t * j->row + kvh * hd, hd) * j->scale;
            mx = s[t - t0] > mx ? s[t - t0] : mx;
        }
        float *o = j->part_o + ((kvh * j->n_blocks + blk) * j->group + g) * hd;
        for (size_t i = 0; i < hd; i++)
            o[i] = 0.0f;
        for (size_t t = t0; t < t1; t++) {
            const float p = expf(s[t - t0] - mx);
            const float *v = j->v + t * j->row + kvh * hd;
            sum += p;
            for (size_t i = 0; i < hd; i++)
                o[i] += p * v[i];
        }
        double *ml = j->part_ml + ((kvh * j->n_blocks + blk) * j->group + g) * 2;
        ml[0] = mx;
        ml[1] = sum;
    }
}

int dd_attn_decode(size_t n_head, size_t n_kv, size_t hd, const float *q, const float *gate,
                   const float *k, const float *v, size_t m, float *out)
{
    if (n_kv == 0 || n_head % n_kv != 0 || hd == 0 || hd % DD_ATTN_LANES != 0 || m == 0)
        return DD_ERR_ARG;
    attn_job j = { .n_head = n_head, .n_kv = n_kv, .hd = hd, .group = n_head / n_kv, .m = m,
                   .row = n_kv * hd, .q = q, .k = k, .v = v, .n_blocks = dd_div_up(m, ATTN_BLOCK),
                   .scale = (float)(1.0 / sqrt((double)hd)) };
    const size_t parts = n_kv * j.n_blocks * j.group;
    j.part_o = malloc(parts * hd * sizeof(float));
    j.part_ml = malloc(parts * 2 * sizeof(double));
    double *acc = malloc(hd * sizeof(double));
    if (j.part_o == NULL || j.part_ml == NULL || acc == NULL) {
        free(j.part_o);
        free(j.part_ml);
        free(acc);
        return DD_ERR_NOMEM;
    }
    dd_pool_for(attn_block, &j, n_kv * j.n_blocks);
    /* combine the blocks of each q head in block order, then gate */
    for (size_t head = 0; head < n_head; head++) {
        const size_t kvh = head / j.group, g = head % j.group;
        double mx = -INFINITY, sum = 0.0;
        for (size_t b = 0; b < j.n_blocks; b++) {
            const double bm = j.part_ml[((kvh * j.n_blocks + b) * j.group + g) * 2];
            mx = bm > mx ? bm : mx;
        }
        for (size_t i = 0; i < hd; i++)
            acc[i] = 0.0;
        for (size_t b = 0; b < j.n_blocks; b++) {
            const size_t p = (kvh * j.n_blocks + b) * j.group + g;
            const double w = exp(j.part_ml[p * 2] - mx);
            sum += w * j.part_ml[p * 2 + 1];
            for (size_t i = 0; i < hd; i++)
                acc[i] += w * j.part_o[p * hd + i];
        }
        for (size_t i = 0; i < hd; i++)
            out[head * hd + i] = (float)(acc[i] / sum * sigmoid(gate[head * hd + i]));
    }
    free(j.part_o);
    free(j.part_ml);
    free(acc);
    return DD_OK;
}
