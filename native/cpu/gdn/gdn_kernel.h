/* The Gated DeltaNet layer of n tokens (deltadesk_cpu.h dd_gdn_prefill; n = 1 is decode): the kernel
 * body, compiled once per ISA level. mixers.c includes it for the portable build, mixers_avx2.c and
 * mixers_avx512.c with their own -m flags; GDN_SUFFIX names the copy. Math: docs/spec/qwen35.md 3.2
 * steps 2-6 (the gated delta rule of Yang, Kautz and Hatamizadeh, "Gated Delta Networks", 2024, in its
 * token-by-token form); the numpy twins are engine/arch/qwen35/cpu_mixers.py.
 *
 * Two passes on the pool, each job's arithmetic fixed by the shapes, never by the thread count:
 *   1. per q, k or v head of channels: the causal conv over [conv_state; mixed] token by token, SiLU,
 *      then (q, k) each token's L2 norm, or (v) each token's beta and decay;
 *   2. per v-head h: the delta rule through the n tokens, column block by column block of the state,
 *      then each token's gated RMS norm.
 * Why every level gives the same bits: every float or double value is computed by one fixed sequence
 * of IEEE + - * / and sqrt (contraction off, no fast-math): the conv and the state's updates are
 * elementwise across channels or state columns, which the vectors run side by side; each sum (the
 * conv taps, L2 norms, k.q, the RMS norm, S^T k and S^T q) runs in its one order, in a scalar or a
 * lane of its own; beta and the decay use libm's exp and log1p (the same function at every level)
 * and the SiLU and gate sigmoids vexp.h's dd_sigmoid_d (IEEE operations only). A token's arithmetic
 * is therefore that of a one-token call too, so prefill equals decode whatever the split.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runtime.h"
#include "vexp.h"

#pragma GCC diagnostic ignored "-Wpsabi"   /* wide vectors in inlined helpers only, no ABI crossing */

#define GDN_CAT2(a, b) a##_##b
#define GDN_CAT(a, b) GDN_CAT2(a, b)
#define GDN_FN(name) GDN_CAT(name, GDN_SUFFIX)

#define AI static inline __attribute__((always_inline))

/* The delta rule's column blocks: GDN_U native vectors of GDN_LANES floats, GDN_U * GDN_LANES = 64
 * columns at AVX-512 (a block of dk = 128 rows is 32 KiB, in L1 through all n tokens), 32 at AVX2,
 * 16 at the baseline; S^T k, S^T q and d of a block stay in registers. */
#if defined(__AVX512F__)
#define GDN_LANES 16
#define GDN_U 4
#elif defined(__AVX2__)
#define GDN_LANES 8
#define GDN_U 4
#else
#define GDN_LANES 4
#define GDN_U 4
#endif
/* A decode step's blocks (one token: each state line read and written once): at AVX-512 whole rows of dv = 128,
 * so a head's 64 KiB state is one forward stream (docs/perf/log/gdn-2026-12-07.md); a prompt's tokens re-read
 * the block, which GDN_U keeps in L1. */
#if defined(__AVX512F__)
#define GDN_ROW_U 8
#else
#define GDN_ROW_U GDN_U
#endif
#define GDN_TOK 4   /* tokens whose sequential double sums run side by side (independent chains) */
/* State rows the delta rule's first read of a block prefetches ahead (16 KiB at dv = 128): rows dv floats apart,
 * a part of each read, are a pattern the hardware prefetchers follow late when a decode step streams the state
 * from DRAM (measured in docs/perf/log/gdn-2026-12-06.md). */
#define GDN_AHEAD 32

typedef float gdn_vn __attribute__((vector_size(4 * GDN_LANES)));
typedef float gdn_v8 __attribute__((vector_size(32)));

typedef struct {
    const dd_gdn_layer *L;
    size_t n, C, nvd;              /* tokens, conv_dim, n_v * dv */
    const float *mixed, *z, *b, *a;
    float *conv_state, *ssm, *y;
    float *u;                      /* n x C after conv + SiLU: q (normalised, scaled), k (normalised), v */
    float *beta, *decay, *kq;      /* n x n_v: sigmoid(b), (float) exp(g); (float) k.q per v-head */
} gdn_ctx;

AI dd_vd load8(const float *p, size_t w)
{
    gdn_v8 f = { 0 };
    if (w == 8)
        memcpy(&f, p, sizeof f);
    else
        memcpy(&f, p, w * sizeof(float));
    return __builtin_convertvector(f, dd_vd);
}

AI void store8(float *p, dd_vd v, size_t w)
{
    const gdn_v8 f = __builtin_convertvector(v, gdn_v8);
    if (w == 8)
        memcpy(p, &f, sizeof f);
    else
        memcpy(p, &f, w * sizeof(float));
}

/* out[t] = sum_i (double)a_t[i] b_t[i] for t < n, a_t = a + t * stride (b alike), i = 0..len-1 in order;
 * GDN_TOK tokens at a time so their chains overlap. */
static void token_dots(const float *a, const float *b, size_t stride, size_t n, size_t len, double *out)
{
    for (size_t t = 0; t < n; t += GDN_TOK) {
        size_t row[GDN_TOK];
        double s[GDN_TOK] = { 0 };
        for (size_t x = 0; x < GDN_TOK; x++)
            row[x] = (t + x < n ? t + x : n - 1) * stride;   /* past the end: repeat the last token */
        for (size_t i = 0; i < len; i++)
            for (size_t x = 0; x < GDN_TOK; x++)
                s[x] += (double)a[row[x] + i] * b[row[x] + i];
        for (size_t x = 0; x < GDN_TOK && t + x < n; x++)
            out[t + x] = s[x];
    }
}

#define GDN_CONV_CH 128   /* channels per conv pass: their taps and last inputs (double) stay in L1 */

/* Channels [c0, c0 + w) (w <= GDN_CONV_CH) through the n tokens, token by token: s = sum_t w_t x_t in
 * double over the K taps, oldest first (the conv_state rows, then the token), cf = (float)s,
 * u = (float)(cf sigmoid(cf)). The last K - 1 inputs sit in a ring (the oldest of token tok in slot
 * tok % (K - 1)), written back to conv_state at the end. K is a constant where inlined with one. */
AI void conv_chunk(const gdn_ctx *x, size_t c0, size_t w, size_t K)
{
    const size_t C = x->C, nb = dd_div_up(w, 8), R = K > 1 ? K - 1 : 1;
    dd_vd wt[DD_GDN_MAX_CONV][GDN_CONV_CH / 8], ring[DD_GDN_MAX_CONV][GDN_CONV_CH / 8];
    size_t slot[DD_GDN_MAX_CONV];
    for (size_t b = 0; b < nb; b++)
        for (size_t t = 0; t < K; t++) {
            const size_t wb = w - 8 * b < 8 ? w - 8 * b : 8;
            wt[t][b] = load8(x->L->conv_w + t * C + c0 + 8 * b, wb);
            if (t + 1 < K)
                ring[t][b] = load8(x->conv_state + t * C + c0 + 8 * b, wb);
        }
    for (size_t tok = 0; tok < x->n; tok++) {
        for (size_t t = 0; t + 1 < K; t++)
            slot[t] = (tok + t) % R;
        const float *in = x->mixed + tok * C + c0;
        float *u = x->u + tok * C + c0;
        for (size_t b = 0; b < nb; b++) {
            const size_t wb = w - 8 * b < 8 ? w - 8 * b : 8;
            const dd_vd v = load8(in + 8 * b, wb);
            dd_vd s = { 0 };
            for (size_t t = 0; t + 1 < K; t++)
                s += wt[t][b] * ring[slot[t]][b];
            s += wt[K - 1][b] * v;
            const dd_vd cf = __builtin_convertvector(__builtin_convertvector(s, gdn_v8), dd_vd);
            store8(u + 8 * b, cf * dd_sigmoid_d(cf), wb);
            if (K > 1)
                ring[slot[0]][b] = v;
        }
    }
    for (size_t t = 0; t + 1 < K; t++)
        for (size_t b = 0; b < nb; b++)
            store8(x->conv_state + t * C + c0 + 8 * b, ring[(x->n + t) % R][b], w - 8 * b < 8 ? w - 8 * b : 8);
}

static void conv_silu(const gdn_ctx *x, size_t c0, size_t width)
{
    const size_t K = x->L->conv_kernel;
    for (size_t c = c0; c < c0 + width; c += GDN_CONV_CH) {
        const size_t w = c0 + width - c < GDN_CONV_CH ? c0 + width - c : GDN_CONV_CH;
        if (K == 4)
            conv_chunk(x, c, w, 4);
        else
            conv_chunk(x, c, w, K);
    }
}

static double gdn_sigmoid(double x)
{
    const double e = exp(-fabs(x));
    return x >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

/* Pass 1, job c: q head c, k head c - n_k, or v head c - 2 n_k (see the file comment). */
static void gdn_inputs(void *ctx, size_t c)
{
    const gdn_ctx *x = ctx;
    const dd_gdn_layer *L = x->L;
    const size_t nk = L->n_k, nv = L->n_v, dk = L->dk;
    if (c >= 2 * nk) {
        const size_t h = c - 2 * nk;
        conv_silu(x, 2 * nk * dk + h * L->dv, L->dv);
        for (size_t t = 0; t < x->n; t++) {
            const double sp = x->a[t * nv + h] + L->dt_bias[h];   /* softplus(a + dt_bias) */
            const float g = L->ssm_a[h] * (float)((sp > 0 ? sp : 0.0) + log1p(exp(-fabs(sp))));
            x->beta[t * nv + h] = (float)gdn_sigmoid(x->b[t * nv + h]);
            x->decay[t * nv + h] = (float)exp((double)g);
        }
        return;
    }
    const float scale = c < nk ? (float)(1.0 / sqrt((double)dk)) : 1.0f;
    float *u = x->u + c * dk;
    conv_silu(x, c * dk, dk);
    double s[GDN_TOK];
    for (size_t t0 = 0; t0 < x->n; t0 += GDN_TOK) {
        const size_t m = x->n - t0 < GDN_TOK ? x->n - t0 : GDN_TOK;
        token_dots(u + t0 * x->C, u + t0 * x->C, x->C, m, dk, s);
        for (size_t t = 0; t < m; t++) {   /* x / sqrt(sum x^2 + eps) * scale, the norm in double */
            float *row = u + (t0 + t) * x->C;
            const double inv = 1.0 / sqrt(s[t] + L->eps);
            for (size_t i = 0; i < dk; i++)
                row[i] = (float)(row[i] * inv) * scale;
        }
    }
}

/* The delta rule on state columns [c0, c0 + U lanes of T) of v-head h through the n tokens; T is a
 * native vector of floats or float. Per token (S read as stored, dk rows of dv): r = S^T k, sq = S^T q
 * (float, rows in order from +0), d = beta (v - decay r), o = decay sq + d (k.q), which is S_new^T q
 * for S_new = decay S + k d^T; S_new is written in the pass that reads it for the next token's r, sq (the last
 * token's pass only writes it). */
#define GDN_DEFINE_COLS(NAME, T, U)                                                                          \
    static void NAME(const gdn_ctx *x, size_t h, size_t c0)                                                  \
    {                                                                                                        \
        const size_t dk = x->L->dk, dv = x->L->dv, C = x->C, nv = x->L->n_v, w = sizeof(T) / sizeof(float); \
        const size_t qo = h % x->L->n_k * dk, ko = x->L->n_k * dk + qo;                                       \
        const size_t vo = 2 * x->L->n_k * dk + h * dv + c0;                                                  \
        float *S = x->ssm + h * dk * dv + c0;                                                                \
        T r[U], sq[U], d[U], row;                                                                            \
        for (size_t e = 0; e < U; e++)                                                                       \
            r[e] = sq[e] = (T){ 0 };                                                                         \
        for (size_t i = 0; i < dk; i++) {                                                                    \
            for (size_t e = 0; i + GDN_AHEAD < dk && e < U * w; e += 16)                                     \
                __builtin_prefetch(S + (i + GDN_AHEAD) * dv + e);                                            \
            for (size_t e = 0; e < U; e++) {                                                                 \
                memcpy(&row, S + i * dv + e * w, sizeof row);                                                \
                r[e] = r[e] + row * x->u[ko + i];                                                            \
                sq[e] = sq[e] + row * x->u[qo + i];                                                          \
            }                                                                                                \
        }                                                                                                    \
        for (size_t t = 0; t < x->n; t++) {                                                                  \
            const float *ut = x->u + t * C, decay = x->decay[t * nv + h], beta = x->beta[t * nv + h];        \
            const int more = t + 1 < x->n;                                                                   \
            const float *k = ut + ko, *kn = ut + more * C + ko, *qn = ut + more * C + qo;                    \
            for (size_t e = 0; e < U; e++) {                                                                 \
                T v;                                                                                         \
                memcpy(&v, ut + vo + e * w, sizeof v);                                                       \
                d[e] = beta * (v - decay * r[e]);                                                            \
                const T o = decay * sq[e] + d[e] * x->kq[t * nv + h];                                        \
                memcpy(x->y + t * x->nvd + h * dv + c0 + e * w, &o, sizeof o);                               \
                r[e] = sq[e] = (T){ 0 };                                                                     \
            }                                                                                                \
            for (size_t i = 0; i < dk; i++)                                                                  \
                for (size_t e = 0; e < U; e++) {                                                             \
                    memcpy(&row, S + i * dv + e * w, sizeof row);                                            \
                    row = decay * row + k[i] * d[e];                                                         \
                    memcpy(S + i * dv + e * w, &row, sizeof row);                                            \
                    if (more) {                                                                              \
                        r[e] = r[e] + row * kn[i];                                                           \
                        sq[e] = sq[e] + row * qn[i];                                                         \
                    }                                                                                        \
                }                                                                                            \
        }                                                                                                    \
    }

GDN_DEFINE_COLS(gdn_cols_wide, gdn_vn, GDN_U)
GDN_DEFINE_COLS(gdn_cols_row, gdn_vn, GDN_ROW_U)
GDN_DEFINE_COLS(gdn_cols_vec, gdn_vn, 1)
GDN_DEFINE_COLS(gdn_cols_1, float, 1)

/* y = (float)((double)o inv norm_w z sigmoid(z)) with inv = 1 / sqrt(sum o^2 / dv + eps) per token. */
static void gated_norm(const gdn_ctx *x, size_t h)
{
    const size_t dv = x->L->dv;
    double ss[GDN_TOK];
    for (size_t t0 = 0; t0 < x->n; t0 += GDN_TOK) {
        const size_t m = x->n - t0 < GDN_TOK ? x->n - t0 : GDN_TOK;
        float *y0 = x->y + t0 * x->nvd + h * dv;
        token_dots(y0, y0, x->nvd, m, dv, ss);
        for (size_t t = 0; t < m; t++) {
            float *y = y0 + t * x->nvd;
            const float *z = x->z + (t0 + t) * x->nvd + h * dv;
            const dd_vd inv = (dd_vd){ 0 } + 1.0 / sqrt(ss[t] / (double)dv + x->L->eps);
            for (size_t j = 0; j < dv; j += 8) {
                const size_t w = dv - j < 8 ? dv - j : 8;
                const dd_vd zj = load8(z + j, w);
                store8(y + j, load8(y + j, w) * inv * load8(x->L->norm_w + j, w) * zj * dd_sigmoid_d(zj), w);
            }
        }
    }
}

/* Pass 2, job h: v-head h's k.q per token, the delta rule block by block, the gated norm. */
static void gdn_head(void *ctx, size_t h)
{
    const gdn_ctx *x = ctx;
    const size_t dk = x->L->dk, dv = x->L->dv, nv = x->L->n_v, qo = h % x->L->n_k * dk;
    double kq[GDN_TOK];
    for (size_t t0 = 0; t0 < x->n; t0 += GDN_TOK) {
        const size_t m = x->n - t0 < GDN_TOK ? x->n - t0 : GDN_TOK;
        const float *q = x->u + t0 * x->C + qo;
        token_dots(q + x->L->n_k * dk, q, x->C, m, dk, kq);
        for (size_t t = 0; t < m; t++)
            x->kq[(t0 + t) * nv + h] = (float)kq[t];
    }
    size_t c = 0;
    for (; x->n == 1 && c + GDN_ROW_U * GDN_LANES <= dv; c += GDN_ROW_U * GDN_LANES)
        gdn_cols_row(x, h, c);
    for (; c + GDN_U * GDN_LANES <= dv; c += GDN_U * GDN_LANES)
        gdn_cols_wide(x, h, c);
    for (; c + GDN_LANES <= dv; c += GDN_LANES)
        gdn_cols_vec(x, h, c);
    for (; c < dv; c++)
        gdn_cols_1(x, h, c);
    gated_norm(x, h);
}

int GDN_FN(gdn_prefill)(const dd_gdn_layer *L, size_t n, const float *mixed, const float *z, const float *b,
                        const float *a, float *conv_state, float *ssm, float *y)
{
    const size_t nk = L->n_k, nv = L->n_v, C = 2 * nk * L->dk + nv * L->dv;
    gdn_ctx x = { .L = L, .n = n, .C = C, .nvd = nv * L->dv, .mixed = mixed, .z = z, .b = b, .a = a,
                  .conv_state = conv_state, .ssm = ssm, .y = y };
    x.u = malloc(n * (C + 3 * nv) * sizeof(float));
    if (x.u == NULL)
        return DD_ERR_NOMEM;
    x.beta = x.u + n * C;
    x.decay = x.beta + n * nv;
    x.kq = x.decay + n * nv;
    dd_pool_for(gdn_inputs, &x, 2 * nk + nv);   /* one token's pass too: ~0.1 ms alone, longer than a dispatch */
    dd_pool_for(gdn_head, &x, nv);
    free(x.u);
    return DD_OK;
}

/* n rows of n sequences, one token each (runtime.h dd_gdn_decode_rows): row i's jobs are those of its one-token
 * GDN_FN(gdn_prefill) call on its own context, in one pass-1 job and one pass-2 job for all rows. */
typedef struct {
    gdn_ctx *x;     /* the rows' contexts */
    size_t per;     /* jobs of the pass per row */
} gdn_rows_job;

static void gdn_inputs_rows(void *ctx, size_t c)
{
    const gdn_rows_job *j = ctx;
    gdn_inputs(&j->x[c / j->per], c % j->per);
}

static void gdn_head_rows(void *ctx, size_t c)
{
    const gdn_rows_job *j = ctx;
    gdn_head(&j->x[c / j->per], c % j->per);
}

int GDN_FN(gdn_decode_rows)(const dd_gdn_layer *L, size_t n, const float *mixed, const float *z, const float *b,
                            const float *a, float *const *conv_state, float *const *ssm, float *y)
{
    const size_t nk = L->n_k, nv = L->n_v, C = 2 * nk * L->dk + nv * L->dv, nvd = nv * L->dv, per = C + 3 * nv;
    gdn_ctx *x = malloc(n * sizeof *x);
    float *u = malloc(n * per * sizeof(float));
    if (x == NULL || u == NULL) {
        free(x);
        free(u);
        return DD_ERR_NOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        x[i] = (gdn_ctx){ .L = L, .n = 1, .C = C, .nvd = nvd, .mixed = mixed + i * C, .z = z + i * nvd,
                          .b = b + i * nv, .a = a + i * nv, .conv_state = conv_state[i], .ssm = ssm[i],
                          .y = y + i * nvd, .u = u + i * per };
        x[i].beta = x[i].u + C;
        x[i].decay = x[i].beta + nv;
        x[i].kq = x[i].decay + nv;
    }
    gdn_rows_job in = { .x = x, .per = 2 * nk + nv }, heads = { .x = x, .per = nv };
    dd_pool_for(gdn_inputs_rows, &in, n * in.per);
    dd_pool_for(gdn_head_rows, &heads, n * heads.per);
    free(u);
    free(x);
    return DD_OK;
}
