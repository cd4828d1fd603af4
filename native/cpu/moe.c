/* One token's MoE feed-forward in one call (spec 3.3; see dd_moe_ffn in deltadesk_cpu.h).
 *
 * Three parallel stages, each split into chunks of output rows; a chunk's result depends only on
 * its rows, so every thread count gives the same bits:
 *   1. router logits (f32 weights);            -> softmax, top-k, renormalise (caller thread)
 *   2. a chunk of one expert's gate and up rows (chosen experts, then the shared one), then
 *      SwiGLU on those rows;                   -> quantize each hidden vector (caller thread)
 *   3. a chunk of output rows: those rows of every expert's down, then their weighted sum.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "runtime.h"

#define MAX_USED 64

typedef struct {
    const uint8_t *gate, *up, *down;
    int gate_type, up_type, down_type;
    size_t ff;
    float *g, *u, *h;      /* ff each */
    float *y;              /* d: this expert's down output */
    dd_acts acts;          /* h quantized */
    float weight;          /* routing weight, or the shared expert's sigmoid gate */
    size_t first_chunk;    /* of the gate/up stage */
} expert;

typedef struct {
    const dd_kernels *kt;
    const dd_moe_weights *mw;
    const float *x;
    const dd_acts *xacts;
    float *logits;
    expert ex[MAX_USED + 1];   /* the n_used routed experts, then the shared one */
    size_t n_ex;
    size_t router_rows, gate_up_rows, down_rows;   /* rows per chunk of each stage */
    float *out;
} moe_job;

static size_t row_bytes(size_t k, int wtype)
{
    return dd_row_bytes(wtype, k);
}

static size_t min_size(size_t a, size_t b)
{
    return a < b ? a : b;
}

static void router_chunk(void *ctx, size_t chunk)
{
    moe_job *j = ctx;
    const size_t r0 = chunk * j->router_rows, r1 = min_size(r0 + j->router_rows, j->mw->n_expert);
    for (size_t e = r0; e < r1; e++)
        j->logits[e] = j->kt->dot_f32(j->mw->router + e * j->mw->d, j->x, j->mw->d);
}

/* A chunk of one expert's gate and up rows, then SwiGLU on them. */
static void gate_up_chunk(void *ctx, size_t chunk)
{
    moe_job *j = ctx;
    const size_t d = j->mw->d;
    size_t i = 0;
    while (i + 1 < j->n_ex && j->ex[i + 1].first_chunk <= chunk)
        i++;
    expert *e = &j->ex[i];
    const size_t r0 = (chunk - e->first_chunk) * j->gate_up_rows, r1 = min_size(r0 + j->gate_up_rows, e->ff);
    const size_t rbg = row_bytes(d, e->gate_type), rbu = row_bytes(d, e->up_type);
    j->kt->gemm[e->gate_type](e->gate + r0 * rbg, rbg, r1 - r0, e->ff - r0, j->xacts, e->g + r0, e->ff);
    j->kt->gemm[e->up_type](e->up + r0 * rbu, rbu, r1 - r0, e->ff - r0, j->xacts, e->u + r0, e->ff);
    for (size_t r = r0; r < r1; r++)
        e->h[r] = e->g[r] / (1.0f + expf(-e->g[r])) * e->u[r];
}

/* A chunk of output rows: every expert's down rows, then their weighted sum. */
static void down_chunk(void *ctx, size_t chunk)
{
    moe_job *j = ctx;
    const size_t d = j->mw->d;
    const size_t r0 = chunk * j->down_rows, r1 = min_size(r0 + j->down_rows, d);
    for (size_t i = 0; i < j->n_ex; i++) {
        expert *e = &j->ex[i];
        const size_t rb = row_bytes(e->ff, e->down_type);
        j->kt->gemm[e->down_type](e->down + r0 * rb, rb, r1 - r0, d - r0, &e->acts, e->y + r0, d);
    }
    for (size_t r = r0; r < r1; r++) {
        float s = 0.0f;
        for (size_t i = 0; i < j->n_ex; i++)
            s += j->ex[i].weight * j->ex[i].y[r];
        j->out[r] = s;
    }
}

/* Softmax over the logits, the n_used largest probabilities (ties: lower index first), their
 * weights renormalised to sum 1 (the sum clamped at >= 2^-14 as llama.cpp does). */
static void route(const float *logits, size_t n_expert, size_t n_used, int32_t *sel, float *weights, float *p)
{
    float mx = logits[0], sum = 0.0f, top = 0.0f;
    for (size_t e = 1; e < n_expert; e++)
        mx = fmaxf(mx, logits[e]);
    for (size_t e = 0; e < n_expert; e++) {
        p[e] = expf(logits[e] - mx);
        sum += p[e];
    }
    for (size_t e = 0; e < n_expert; e++)
        p[e] /= sum;
    for (size_t i = 0; i < n_used; i++) {
        size_t best = n_expert;
        for (size_t e = 0; e < n_expert; e++)
            if (p[e] >= 0.0f && (best == n_expert || p[e] > p[best]))
                best = e;
        sel[i] = (int32_t)best;
        weights[i] = p[best];
        top += p[best];
        p[best] = -1.0f;
    }
    top = fmaxf(top, 6.103515625e-5f);
    for (size_t i = 0; i < n_used; i++)
        weights[i] /= top;
}

static int valid(const dd_moe_weights *w)
{
    const int types_ok = dd_wtype_fits(w->gate_type, w->d) && dd_wtype_fits(w->up_type, w->d) &&
                         dd_wtype_fits(w->down_type, w->ff);
    const int shared_ok = w->sh_gate == NULL ||
                          (w->sh_up != NULL && w->sh_down != NULL && w->sh_gate_inp != NULL &&
                           dd_wtype_fits(w->sh_gate_type, w->d) && dd_wtype_fits(w->sh_up_type, w->d) &&
                           dd_wtype_fits(w->sh_down_type, w->ff_sh));
    return types_ok && shared_ok && w->d > 0 && w->d % DD_QK == 0 && w->ff > 0 && w->ff % DD_QK == 0 &&
           (w->sh_gate == NULL || (w->ff_sh > 0 && w->ff_sh % DD_QK == 0)) && w->n_used >= 1 &&
           w->n_used <= w->n_expert && w->n_used <= MAX_USED;
}

int dd_moe_ffn(int isa, const dd_moe_weights *mw, const float *x, float *out, int32_t *sel_out, float *weights_out)
{
    const dd_kernels *kt = dd_kernels_for(isa);
    if (kt == NULL)
        return DD_ERR_ISA;
    if (!valid(mw))
        return DD_ERR_ARG;
    const size_t d = mw->d, n_used = mw->n_used, has_sh = mw->sh_gate != NULL;
    const size_t hidden = n_used * mw->ff + (has_sh ? mw->ff_sh : 0);
    float *scratch = malloc((2 * mw->n_expert + 3 * hidden + (n_used + has_sh) * d) * sizeof(float));
    if (scratch == NULL)
        return DD_ERR_NOMEM;
    moe_job j = { .kt = kt, .mw = mw, .x = x, .logits = scratch, .n_ex = n_used + has_sh, .out = out };
    float *p = scratch + mw->n_expert, *g = p + mw->n_expert, *u = g + hidden, *h = u + hidden, *y = h + hidden;
    int32_t sel[MAX_USED];
    float weights[MAX_USED];
    dd_acts xacts;
    int rc = dd_acts_new(kt, x, 1, d, &xacts);
    if (rc != DD_OK) {
        free(scratch);
        return rc;
    }
    j.xacts = &xacts;

    j.router_rows = dd_chunk_rows(d * sizeof(float));
    dd_pool_for(router_chunk, &j, dd_div_up(mw->n_expert, j.router_rows));
    route(j.logits, mw->n_expert, n_used, sel, weights, p);

    size_t off = 0, gate_up_row_bytes = 0, down_row_bytes = 0;
    for (size_t i = 0; i < j.n_ex; i++) {
        expert *e = &j.ex[i];
        if (i < n_used) {
            const size_t s = (size_t)sel[i];
            *e = (expert){
                .gate = mw->gate + s * mw->ff * row_bytes(d, mw->gate_type),
                .up = mw->up + s * mw->ff * row_bytes(d, mw->up_type),
                .down = mw->down + s * d * row_bytes(mw->ff, mw->down_type),
                .gate_type = mw->gate_type, .up_type = mw->up_type, .down_type = mw->down_type,
                .ff = mw->ff, .weight = weights[i],
            };
        } else {
            *e = (expert){
                .gate = mw->sh_gate, .up = mw->sh_up, .down = mw->sh_down, .gate_type = mw->sh_gate_type,
                .up_type = mw->sh_up_type, .down_type = mw->sh_down_type, .ff = mw->ff_sh,
                .weight = 1.0f / (1.0f + expf(-kt->dot_f32(mw->sh_gate_inp, x, d))),
            };
        }
        e->g = g + off;
        e->u = u + off;
        e->h = h + off;
        e->y = y + i * d;
        off += e->ff;
        gate_up_row_bytes = row_bytes(d, e->gate_type) + row_bytes(d, e->up_type) > gate_up_row_bytes
                                ? row_bytes(d, e->gate_type) + row_bytes(d, e->up_type) : gate_up_row_bytes;
        down_row_bytes += row_bytes(e->ff, e->down_type);
    }
    j.gate_up_rows = dd_chunk_rows(gate_up_row_bytes);
    size_t chunks = 0;
    for (size_t i = 0; i < j.n_ex; i++) {
        j.ex[i].first_chunk = chunks;
        chunks += dd_div_up(j.ex[i].ff, j.gate_up_rows);
    }
    dd_pool_for(gate_up_chunk, &j, chunks);

    size_t made = 0;
    while (made < j.n_ex && (rc = dd_acts_new(kt, j.ex[made].h, 1, j.ex[made].ff, &j.ex[made].acts)) == DD_OK)
        made++;
    if (rc == DD_OK) {
        j.down_rows = dd_chunk_rows(down_row_bytes);
        dd_pool_for(down_chunk, &j, dd_div_up(d, j.down_rows));
    }
    for (size_t i = 0; i < made; i++)
        dd_acts_free(&j.ex[i].acts);
    dd_acts_free(&xacts);
    free(scratch);
    if (rc == DD_OK) {
        for (size_t i = 0; i < n_used; i++) {
            if (sel_out != NULL)
                sel_out[i] = sel[i];
            if (weights_out != NULL)
                weights_out[i] = weights[i];
        }
    }
    return rc;
}

/* ---- prefill: n tokens, grouped by expert ----------------------------------------------------
 *
 * dd_moe_prefill gives every token exactly the bits dd_moe_ffn gives it alone: the same router dot
 * products (dot_f32) and route(); each expert's gate/up/down rows as one GEMM over the tokens routed
 * to it (every output element of a GEMM is the GEMV's instruction sequence, gemm_tiles.h), the
 * same SwiGLU expression, each hidden vector quantized on its own (Q8_0 quantization is per column);
 * then per token the same f32 sum over its experts in slot order, the shared expert last. Stages,
 * each on the pool in chunks whose results depend only on their index:
 *   1. route chunks of tokens (router logits, top-k, the shared expert's sigmoid gate);
 *   2. per used expert: gather its tokens' rows of x, quantize them;
 *   3. chunks of (expert, gate/up rows): the GEMMs over that expert's tokens, then SwiGLU;
 *   4. per used expert: quantize its hidden vectors;
 *   5. chunks of (expert, down rows): the GEMM over its tokens (one output row per token and slot);
 *   6. chunks of tokens: the weighted sums. */

#define PREFILL_TOKENS_PER_CHUNK 8

typedef struct {
    const uint8_t *gate, *up, *down;
    int gate_type, up_type, down_type;
    size_t ff, count;       /* count: tokens routed here */
    size_t *tokens;         /* their indices, ascending */
    float *xg;              /* count x d: their rows of x (stage 2), then their down outputs (stage 5) */
    float *g, *u, *h;       /* count x ff each: column c is token tokens[c] */
    dd_acts xacts, hacts;
    int has_x, has_h;
    size_t first_gate_up, first_down;   /* first chunk of stages 3 and 5 */
} group;

typedef struct {
    const dd_kernels *kt;
    const dd_moe_weights *mw;
    size_t n, n_slots;      /* n_slots: n_used, plus one for the shared expert */
    const float *x;
    float *logits, *p;      /* n x n_expert each */
    int32_t *sel;           /* n x n_used */
    float *weights;         /* n x n_slots: routing weights, then the shared gate */
    group *groups;          /* the used experts in index order, then the shared one */
    size_t n_groups;
    const float **rows;     /* n x n_slots: where each (token, slot)'s down output lies */
    size_t gate_up_rows, down_rows, gate_up_chunks, down_chunks;
    _Atomic int failed;
    float *out;
} prefill_job;

static void prefill_route_chunk(void *ctx, size_t chunk)
{
    prefill_job *j = ctx;
    const dd_moe_weights *mw = j->mw;
    const size_t t1 = min_size((chunk + 1) * PREFILL_TOKENS_PER_CHUNK, j->n);
    for (size_t t = chunk * PREFILL_TOKENS_PER_CHUNK; t < t1; t++) {
        const float *xt = j->x + t * mw->d;
        float *logits = j->logits + t * mw->n_expert;
        for (size_t e = 0; e < mw->n_expert; e++)
            logits[e] = j->kt->dot_f32(mw->router + e * mw->d, xt, mw->d);
        route(logits, mw->n_expert, mw->n_used, j->sel + t * mw->n_used, j->weights + t * j->n_slots,
              j->p + t * mw->n_expert);
        if (mw->sh_gate != NULL)
            j->weights[t * j->n_slots + mw->n_used] = 1.0f / (1.0f + expf(-j->kt->dot_f32(mw->sh_gate_inp, xt, mw->d)));
    }
}

/* The group whose chunks of a stage start at or before `chunk` (the last such). */
static group *group_of(prefill_job *j, size_t chunk, int down)
{
    size_t i = 0;
    while (i + 1 < j->n_groups && (down ? j->groups[i + 1].first_down : j->groups[i + 1].first_gate_up) <= chunk)
        i++;
    return &j->groups[i];
}

/* Quantize a group's m columns of k values into *acts, setting *made; a failure stops the job. */
static void prefill_acts(prefill_job *j, const float *v, size_t m, size_t k, dd_acts *acts, int *made)
{
    if (dd_acts_new(j->kt, v, m, k, acts) == DD_OK)
        *made = 1;
    else
        atomic_store(&j->failed, 1);
}

static void prefill_quantize_x(void *ctx, size_t chunk)
{
    prefill_job *j = ctx;
    group *gr = &j->groups[chunk];
    const size_t d = j->mw->d;
    for (size_t c = 0; c < gr->count; c++)
        memcpy(gr->xg + c * d, j->x + gr->tokens[c] * d, d * sizeof(float));
    prefill_acts(j, gr->xg, gr->count, d, &gr->xacts, &gr->has_x);
}

static void prefill_gate_up_chunk(void *ctx, size_t chunk)
{
    prefill_job *j = ctx;
    if (atomic_load(&j->failed))
        return;
    group *gr = group_of(j, chunk, 0);
    const size_t d = j->mw->d, ff = gr->ff;
    const size_t r0 = (chunk - gr->first_gate_up) * j->gate_up_rows, r1 = min_size(r0 + j->gate_up_rows, ff);
    const size_t rbg = row_bytes(d, gr->gate_type), rbu = row_bytes(d, gr->up_type);
    j->kt->gemm[gr->gate_type](gr->gate + r0 * rbg, rbg, r1 - r0, ff - r0, &gr->xacts, gr->g + r0, ff);
    j->kt->gemm[gr->up_type](gr->up + r0 * rbu, rbu, r1 - r0, ff - r0, &gr->xacts, gr->u + r0, ff);
    for (size_t c = 0; c < gr->count; c++)
        for (size_t r = r0; r < r1; r++) {
            const float g = gr->g[c * ff + r];
            gr->h[c * ff + r] = g / (1.0f + expf(-g)) * gr->u[c * ff + r];
        }
}

static void prefill_quantize_h(void *ctx, size_t chunk)
{
    prefill_job *j = ctx;
    group *gr = &j->groups[chunk];
    if (!atomic_load(&j->failed))
        prefill_acts(j, gr->h, gr->count, gr->ff, &gr->hacts, &gr->has_h);
}

/* A chunk of one expert's down rows over its tokens, into xg (count x d; stage 2 is done with it). */
static void prefill_down_chunk(void *ctx, size_t chunk)
{
    prefill_job *j = ctx;
    if (atomic_load(&j->failed))
        return;
    group *gr = group_of(j, chunk, 1);
    const size_t d = j->mw->d, rb = row_bytes(gr->ff, gr->down_type);
    const size_t r0 = (chunk - gr->first_down) * j->down_rows, r1 = min_size(r0 + j->down_rows, d);
    j->kt->gemm[gr->down_type](gr->down + r0 * rb, rb, r1 - r0, d - r0, &gr->hacts, gr->xg + r0, d);
}

/* A chunk of tokens: out = sum over slots of weight * that slot's down output, in slot order. */
static void prefill_sum_chunk(void *ctx, size_t chunk)
{
    prefill_job *j = ctx;
    const size_t d = j->mw->d, t1 = min_size((chunk + 1) * PREFILL_TOKENS_PER_CHUNK, j->n);
    for (size_t t = chunk * PREFILL_TOKENS_PER_CHUNK; t < t1; t++) {
        const float *const *rows = j->rows + t * j->n_slots;
        const float *w = j->weights + t * j->n_slots;
        for (size_t r = 0; r < d; r++) {
            float s = 0.0f;
            for (size_t i = 0; i < j->n_slots; i++)
                s += w[i] * rows[i][r];
            j->out[t * d + r] = s;
        }
    }
}

/* Lay the groups out: each used expert's tokens (ascending), its buffers, its chunks; and where each
 * (token, slot)'s down output will lie. */
static int prefill_groups(prefill_job *j, size_t *index, float *fbuf)
{
    const dd_moe_weights *mw = j->mw;
    const size_t n = j->n, d = mw->d, n_used = mw->n_used, has_sh = mw->sh_gate != NULL;
    size_t *count = calloc(mw->n_expert, sizeof(size_t)), *at = calloc(mw->n_expert, sizeof(size_t));
    if (count == NULL || at == NULL) {
        free(count);
        free(at);
        return DD_ERR_NOMEM;
    }
    for (size_t t = 0; t < n * n_used; t++)
        count[j->sel[t]]++;
    size_t gi = 0, entries = 0;
    for (size_t e = 0; e < mw->n_expert; e++) {
        if (count[e] == 0)
            continue;
        at[e] = gi;
        j->groups[gi++] = (group){
            .gate = mw->gate + e * mw->ff * row_bytes(d, mw->gate_type),
            .up = mw->up + e * mw->ff * row_bytes(d, mw->up_type),
            .down = mw->down + e * d * row_bytes(mw->ff, mw->down_type),
            .gate_type = mw->gate_type, .up_type = mw->up_type, .down_type = mw->down_type, .ff = mw->ff,
        };
    }
    if (has_sh)
        j->groups[gi++] = (group){
            .gate = mw->sh_gate, .up = mw->sh_up, .down = mw->sh_down, .gate_type = mw->sh_gate_type,
            .up_type = mw->sh_up_type, .down_type = mw->sh_down_type, .ff = mw->ff_sh, .count = n,
        };
    j->n_groups = gi;
    for (size_t e = 0; e < mw->n_expert; e++)
        if (count[e] > 0)
            j->groups[at[e]].count = count[e];
    size_t gate_up_bytes = 0, down_bytes = 0, chunks_gu = 0, chunks_down = 0;
    for (size_t g = 0; g < gi; g++) {
        group *gr = &j->groups[g];
        gr->tokens = index + entries;
        gr->xg = fbuf;
        gr->g = gr->xg + gr->count * d;
        gr->u = gr->g + gr->count * gr->ff;
        gr->h = gr->u + gr->count * gr->ff;
        fbuf = gr->h + gr->count * gr->ff;
        entries += gr->count;
        gate_up_bytes = gate_up_bytes > row_bytes(d, gr->gate_type) + row_bytes(d, gr->up_type)
                            ? gate_up_bytes : row_bytes(d, gr->gate_type) + row_bytes(d, gr->up_type);
        down_bytes = down_bytes > row_bytes(gr->ff, gr->down_type) ? down_bytes : row_bytes(gr->ff, gr->down_type);
        gr->count = 0;   /* refilled below, token by token */
    }
    for (size_t t = 0; t < n; t++)
        for (size_t i = 0; i < j->n_slots; i++) {
            group *gr = &j->groups[i < n_used ? at[j->sel[t * n_used + i]] : gi - 1];
            gr->tokens[gr->count] = t;
            j->rows[t * j->n_slots + i] = gr->xg + gr->count * d;
            gr->count++;
        }
    j->gate_up_rows = dd_gemm_chunk_rows(gate_up_bytes, 2);
    j->down_rows = dd_gemm_chunk_rows(down_bytes, 2);
    for (size_t g = 0; g < gi; g++) {
        j->groups[g].first_gate_up = chunks_gu;
        j->groups[g].first_down = chunks_down;
        chunks_gu += dd_div_up(j->groups[g].ff, j->gate_up_rows);
        chunks_down += dd_div_up(d, j->down_rows);
    }
    j->gate_up_chunks = chunks_gu;
    j->down_chunks = chunks_down;
    free(count);
    free(at);
    return DD_OK;
}

int dd_moe_prefill(int isa, const dd_moe_weights *mw, size_t n, const float *x, float *out, int32_t *sel_out,
                   float *weights_out)
{
    const dd_kernels *kt = dd_kernels_for(isa);
    if (kt == NULL)
        return DD_ERR_ISA;
    if (!valid(mw))
        return DD_ERR_ARG;
    if (n == 0)
        return DD_OK;
    const size_t d = mw->d, n_used = mw->n_used, n_slots = n_used + (mw->sh_gate != NULL);
    const size_t ff_max = mw->ff > mw->ff_sh ? mw->ff : mw->ff_sh, entries = n * n_slots;
    prefill_job j = { .kt = kt, .mw = mw, .n = n, .n_slots = n_slots, .x = x, .out = out };
    float *small = malloc((2 * n * mw->n_expert + entries) * sizeof(float));
    float *fbuf = malloc(entries * (d + 3 * ff_max) * sizeof(float));
    size_t *index = malloc(entries * sizeof(size_t));
    j.sel = malloc(n * n_used * sizeof(int32_t));
    j.rows = malloc(entries * sizeof(float *));
    j.groups = calloc(mw->n_expert + 1, sizeof(group));
    int rc = small && fbuf && index && j.sel && j.rows && j.groups ? DD_OK : DD_ERR_NOMEM;
    if (rc == DD_OK) {
        j.logits = small;
        j.p = small + n * mw->n_expert;
        j.weights = j.p + n * mw->n_expert;
        dd_pool_for(prefill_route_chunk, &j, dd_div_up(n, PREFILL_TOKENS_PER_CHUNK));
        rc = prefill_groups(&j, index, fbuf);
    }
    if (rc == DD_OK) {
        dd_pool_for(prefill_quantize_x, &j, j.n_groups);
        dd_pool_for(prefill_gate_up_chunk, &j, j.gate_up_chunks);
        dd_pool_for(prefill_quantize_h, &j, j.n_groups);
        dd_pool_for(prefill_down_chunk, &j, j.down_chunks);
        if (atomic_load(&j.failed))
            rc = DD_ERR_NOMEM;
    }
    if (rc == DD_OK) {
        dd_pool_for(prefill_sum_chunk, &j, dd_div_up(n, PREFILL_TOKENS_PER_CHUNK));
        for (size_t t = 0; t < n; t++)
            for (size_t i = 0; i < n_used; i++) {
                if (sel_out != NULL)
                    sel_out[t * n_used + i] = j.sel[t * n_used + i];
                if (weights_out != NULL)
                    weights_out[t * n_used + i] = j.weights[t * n_slots + i];
            }
    }
    for (size_t g = 0; j.groups != NULL && g < j.n_groups; g++) {
        if (j.groups[g].has_x)
            dd_acts_free(&j.groups[g].xacts);
        if (j.groups[g].has_h)
            dd_acts_free(&j.groups[g].hacts);
    }
    free(small);
    free(fbuf);
    free(index);
    free(j.sel);
    free(j.rows);
    free(j.groups);
    return rc;
}
