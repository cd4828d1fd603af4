/* The MoE feed-forward of n prompt tokens (dd_moe_prefill in deltadesk_cpu.h), grouped by expert; the
 * one-token call and the routing it shares are moe.c.
 *
 * dd_moe_prefill gives every token exactly the bits dd_moe_ffn gives it alone: the same router dot
 * products (dots_f32) and dd_moe_route(); each expert's gate/up/down rows as one GEMM over the tokens routed
 * to it (every output element of a GEMM is the GEMV's instruction sequence, gemm_tiles.h), the
 * same SwiGLU expression, each hidden vector quantized on its own (Q8_0 quantization is per column);
 * then per token the same f32 sum over its experts in slot order, the shared expert last. Stages,
 * each on the pool in chunks whose results depend only on their index:
 *   1. route chunks of tokens (router logits, top-k, the shared expert's sigmoid gate); up to
 *      ROUTE_BY_ROWS tokens (a batched decode step), chunks of router rows for all the tokens instead,
 *      then top-k and the gate on the calling thread;
 *   2. every token's x quantized once (more than one token); per used expert: its tokens' columns of those
 *      (dd_acts_gather: the bytes of quantizing them again), or one token's row quantized on its own (the GEMV's
 *      layout); the rows of x themselves where a weight type reads them (BF16, F16);
 *   3. chunks of (expert, gate/up rows): the GEMMs over that expert's tokens, then SwiGLU;
 *   4. per used expert: quantize its hidden vectors;
 *   5. chunks of (expert, down rows): the GEMM over its tokens (one output row per token and slot);
 *   6. chunks of tokens (one token each up to ROUTE_BY_ROWS tokens): the weighted sums. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "runtime.h"

#define PREFILL_TOKENS_PER_CHUNK 8
#define ROUTE_TOKENS_MAX 64
/* Up to this many tokens the router logits are cut by router rows, not by tokens: a chunk of tokens would
 * leave every thread but one idle while one reads the whole router (2 MiB a layer at 256 x 2048), and the
 * tokens' rows (64 KiB at 8 x 2048) stay in L2 while each chunk of router rows meets them all. */
#define ROUTE_BY_ROWS 8

/* Tokens per chunk of the routing stage: n over 4 chunks a thread, 8 to 64. Each chunk reads the whole router
 * (n_expert f32 rows: 2 MiB at 256 x 2048, more than a core's L2) once for all its tokens, so larger chunks
 * read it less often; the logits do not depend on the chunking (dots_f32, kernels.h). */
static size_t route_tokens(size_t n)
{
    const size_t t = n / (4 * (size_t)dd_get_threads());
    return t < PREFILL_TOKENS_PER_CHUNK ? PREFILL_TOKENS_PER_CHUNK : t > ROUTE_TOKENS_MAX ? ROUTE_TOKENS_MAX : t;
}

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
    size_t route_tokens, router_rows, sum_tokens, gate_up_rows, down_rows, gate_up_chunks, down_chunks;
    float *sh_logits;       /* n: the shared expert's gate logits (routing by router rows) */
    dd_acts all;            /* every token's x quantized (has_all), gathered by the experts of several tokens */
    int has_all;
    _Atomic int failed;
    float *out;
} prefill_job;

/* Top-k of tokens [t0, t1) from their logits, and the shared expert's gate from its logits sh (sh[0]: t0's). */
static void prefill_route_tokens(prefill_job *j, size_t t0, size_t t1, const float *sh)
{
    const dd_moe_weights *mw = j->mw;
    for (size_t t = t0; t < t1; t++) {
        dd_moe_route(j->logits + t * mw->n_expert, mw->n_expert, mw->n_used, j->sel + t * mw->n_used,
                     j->weights + t * j->n_slots, j->p + t * mw->n_expert);
        if (mw->sh_gate != NULL)
            j->weights[t * j->n_slots + mw->n_used] = 1.0f / (1.0f + expf(-sh[t - t0]));
    }
}

static void prefill_route_chunk(void *ctx, size_t chunk)
{
    prefill_job *j = ctx;
    const dd_moe_weights *mw = j->mw;
    const size_t t0 = chunk * j->route_tokens, t1 = dd_min_size(t0 + j->route_tokens, j->n);
    j->kt->dots_f32(mw->router, mw->n_expert, j->x + t0 * mw->d, t1 - t0, mw->d, j->logits + t0 * mw->n_expert,
                    mw->n_expert);
    float sh[ROUTE_TOKENS_MAX];
    if (mw->sh_gate != NULL)
        j->kt->dots_f32(mw->sh_gate_inp, 1, j->x + t0 * mw->d, t1 - t0, mw->d, sh, 1);
    prefill_route_tokens(j, t0, t1, sh);
}

/* A chunk of router rows for all n tokens; the chunk after the last one: the shared expert's gate logits. */
static void prefill_router_rows_chunk(void *ctx, size_t chunk)
{
    prefill_job *j = ctx;
    const dd_moe_weights *mw = j->mw;
    const size_t r0 = chunk * j->router_rows;
    if (r0 >= mw->n_expert) {
        j->kt->dots_f32(mw->sh_gate_inp, 1, j->x, j->n, mw->d, j->sh_logits, 1);
        return;
    }
    const size_t r1 = dd_min_size(r0 + j->router_rows, mw->n_expert);
    j->kt->dots_f32(mw->router + r0 * mw->d, r1 - r0, j->x, j->n, mw->d, j->logits + r0, mw->n_expert);
}

/* Stage 1: every token's logits, experts, weights and shared gate. */
static void prefill_route(prefill_job *j)
{
    const dd_moe_weights *mw = j->mw;
    if (j->n > ROUTE_BY_ROWS) {
        j->route_tokens = route_tokens(j->n);
        dd_pool_for(prefill_route_chunk, j, dd_div_up(j->n, j->route_tokens));
        return;
    }
    float sh[ROUTE_BY_ROWS];
    j->sh_logits = sh;
    j->router_rows = dd_chunk_rows(mw->d * sizeof(float));
    dd_pool_for(prefill_router_rows_chunk, j, dd_div_up(mw->n_expert, j->router_rows) + (mw->sh_gate != NULL));
    prefill_route_tokens(j, 0, j->n, sh);
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

/* A weight type whose kernel reads the f32 activations themselves (dd_acts.x). */
static int reads_floats(int wtype)
{
    return wtype == DD_BF16 || wtype == DD_F16;
}

static void prefill_quantize_x(void *ctx, size_t chunk)
{
    prefill_job *j = ctx;
    group *gr = &j->groups[chunk];
    const size_t d = j->mw->d;
    const int floats = reads_floats(gr->gate_type) || reads_floats(gr->up_type), gather = j->has_all && gr->count > 1;
    for (size_t c = 0; (floats || !gather) && c < gr->count; c++)
        memcpy(gr->xg + c * d, j->x + gr->tokens[c] * d, d * sizeof(float));
    if (!gather)
        prefill_acts(j, gr->xg, gr->count, d, &gr->xacts, &gr->has_x);
    else if (dd_acts_gather(j->kt, &j->all, gr->tokens, gr->count, floats ? gr->xg : NULL, &gr->xacts) == DD_OK)
        gr->has_x = 1;
    else
        atomic_store(&j->failed, 1);
}

static void prefill_gate_up_chunk(void *ctx, size_t chunk)
{
    prefill_job *j = ctx;
    if (atomic_load(&j->failed))
        return;
    group *gr = group_of(j, chunk, 0);
    const size_t d = j->mw->d, ff = gr->ff;
    const size_t r0 = (chunk - gr->first_gate_up) * j->gate_up_rows, r1 = dd_min_size(r0 + j->gate_up_rows, ff);
    const size_t rbg = dd_row_bytes(gr->gate_type, d), rbu = dd_row_bytes(gr->up_type, d);
    j->kt->gemm[gr->gate_type](gr->gate + r0 * rbg, rbg, r1 - r0, ff - r0, &gr->xacts, gr->g + r0, ff);
    j->kt->gemm[gr->up_type](gr->up + r0 * rbu, rbu, r1 - r0, ff - r0, &gr->xacts, gr->u + r0, ff);
    for (size_t c = 0; c < gr->count; c++)
        j->kt->swiglu(gr->g + c * ff + r0, gr->u + c * ff + r0, r1 - r0, gr->h + c * ff + r0);
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
    const size_t d = j->mw->d, rb = dd_row_bytes(gr->down_type, gr->ff);
    const size_t r0 = (chunk - gr->first_down) * j->down_rows, r1 = dd_min_size(r0 + j->down_rows, d);
    j->kt->gemm[gr->down_type](gr->down + r0 * rb, rb, r1 - r0, d - r0, &gr->hacts, gr->xg + r0, d);
}

/* A chunk of tokens: out = sum over slots of weight * that slot's down output, in slot order (each element
 * 0 + w_0 x_0 + w_1 x_1 + ..., as dd_moe_ffn sums it; the slots outer so the loop over elements vectorizes). */
static void prefill_sum_chunk(void *ctx, size_t chunk)
{
    prefill_job *j = ctx;
    const size_t d = j->mw->d, t1 = dd_min_size((chunk + 1) * j->sum_tokens, j->n);
    for (size_t t = chunk * j->sum_tokens; t < t1; t++) {
        const float *const *rows = j->rows + t * j->n_slots;
        const float *w = j->weights + t * j->n_slots;
        float *restrict out = j->out + t * d;
        for (size_t r = 0; r < d; r++)
            out[r] = 0.0f;
        for (size_t i = 0; i < j->n_slots; i++) {
            const float wi = w[i], *restrict x = rows[i];
            for (size_t r = 0; r < d; r++)
                out[r] += wi * x[r];
        }
    }
}

/* One group per used expert (count[e] > 0) in index order, then the shared expert's (all n tokens);
 * at[e] is expert e's group. Returns the number of groups. */
static size_t add_groups(prefill_job *j, const size_t *count, size_t *at)
{
    const dd_moe_weights *mw = j->mw;
    const size_t d = mw->d;
    size_t gi = 0;
    for (size_t e = 0; e < mw->n_expert; e++) {
        if (count[e] == 0)
            continue;
        at[e] = gi;
        j->groups[gi++] = (group){
            .gate = mw->gate + e * mw->ff * dd_row_bytes(mw->gate_type, d),
            .up = mw->up + e * mw->ff * dd_row_bytes(mw->up_type, d),
            .down = mw->down + e * d * dd_row_bytes(mw->down_type, mw->ff),
            .gate_type = mw->gate_type, .up_type = mw->up_type, .down_type = mw->down_type, .ff = mw->ff,
            .count = count[e],
        };
    }
    if (mw->sh_gate != NULL)
        j->groups[gi++] = (group){
            .gate = mw->sh_gate, .up = mw->sh_up, .down = mw->sh_down, .gate_type = mw->sh_gate_type,
            .up_type = mw->sh_up_type, .down_type = mw->sh_down_type, .ff = mw->ff_sh, .count = j->n,
        };
    return gi;
}

/* Each group's token list (from index) and x/g/u/h buffers (from fbuf), sized by its count; the rows
 * per chunk of the gate/up and down stages (from the largest row sizes) and each group's first chunks. */
static void place_groups(prefill_job *j, size_t *index, float *fbuf)
{
    const size_t d = j->mw->d;
    size_t gate_up_bytes = 0, down_bytes = 0, chunks_gu = 0, chunks_down = 0;
    for (size_t g = 0; g < j->n_groups; g++) {
        group *gr = &j->groups[g];
        gr->tokens = index;
        index += gr->count;
        gr->xg = fbuf;
        gr->g = gr->xg + gr->count * d;
        gr->u = gr->g + gr->count * gr->ff;
        gr->h = gr->u + gr->count * gr->ff;
        fbuf = gr->h + gr->count * gr->ff;
        const size_t gu = dd_row_bytes(gr->gate_type, d) + dd_row_bytes(gr->up_type, d);
        const size_t dn = dd_row_bytes(gr->down_type, gr->ff);
        gate_up_bytes = gate_up_bytes > gu ? gate_up_bytes : gu;
        down_bytes = down_bytes > dn ? down_bytes : dn;
    }
    j->gate_up_rows = dd_gemm_chunk_rows(gate_up_bytes, 2);
    j->down_rows = dd_gemm_chunk_rows(down_bytes, 2);
    for (size_t g = 0; g < j->n_groups; g++) {
        j->groups[g].first_gate_up = chunks_gu;
        j->groups[g].first_down = chunks_down;
        chunks_gu += dd_div_up(j->groups[g].ff, j->gate_up_rows);
        chunks_down += dd_div_up(d, j->down_rows);
    }
    j->gate_up_chunks = chunks_gu;
    j->down_chunks = chunks_down;
}

/* Lay the groups out: each used expert's tokens (ascending), its buffers, its chunks; and where each
 * (token, slot)'s down output will lie. */
static int prefill_groups(prefill_job *j, size_t *index, float *fbuf)
{
    const dd_moe_weights *mw = j->mw;
    const size_t n = j->n, d = mw->d, n_used = mw->n_used;
    size_t *count = calloc(mw->n_expert, sizeof(size_t)), *at = calloc(mw->n_expert, sizeof(size_t));
    if (count == NULL || at == NULL) {
        free(count);
        free(at);
        return DD_ERR_NOMEM;
    }
    for (size_t t = 0; t < n * n_used; t++)
        count[j->sel[t]]++;
    j->n_groups = add_groups(j, count, at);
    place_groups(j, index, fbuf);
    for (size_t g = 0; g < j->n_groups; g++)
        j->groups[g].count = 0;   /* refilled below, token by token */
    for (size_t t = 0; t < n; t++)
        for (size_t i = 0; i < j->n_slots; i++) {
            group *gr = &j->groups[i < n_used ? at[j->sel[t * n_used + i]] : j->n_groups - 1];
            gr->tokens[gr->count] = t;
            j->rows[t * j->n_slots + i] = gr->xg + gr->count * d;
            gr->count++;
        }
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
    if (!dd_moe_valid(mw))
        return DD_ERR_ARG;
    if (n == 0)
        return DD_OK;
    const size_t d = mw->d, n_used = mw->n_used, n_slots = n_used + (mw->sh_gate != NULL);
    const size_t ff_max = mw->ff > mw->ff_sh ? mw->ff : mw->ff_sh, entries = n * n_slots;
    prefill_job j = { .kt = kt, .mw = mw, .n = n, .n_slots = n_slots, .x = x, .out = out };
    float *small = malloc((2 * n * mw->n_expert + entries) * sizeof(float));
    /* the groups' x/g/u/h rows (66 MB at 512 tokens of a 35B-A3B layer) in the thread's reused scratch: a
     * fresh allocation this size is mapped anew on every call, and faulting its pages in cost ~4 % of a prompt */
    float *fbuf = dd_scratch(DD_SCRATCH_MOE, entries * (d + 3 * ff_max) * sizeof(float));
    size_t *index = malloc(entries * sizeof(size_t));
    j.sel = malloc(n * n_used * sizeof(int32_t));
    j.rows = malloc(entries * sizeof(float *));
    j.groups = calloc(mw->n_expert + 1, sizeof(group));
    int rc = small && fbuf && index && j.sel && j.rows && j.groups ? DD_OK : DD_ERR_NOMEM;
    if (rc == DD_OK) {
        j.logits = small;
        j.p = small + n * mw->n_expert;
        j.weights = j.p + n * mw->n_expert;
        prefill_route(&j);
        rc = prefill_groups(&j, index, fbuf);
    }
    if (rc == DD_OK) {
        j.has_all = n > 1 && dd_acts_new_pooled(kt, x, n, d, &j.all) == DD_OK;
        dd_pool_for(prefill_quantize_x, &j, j.n_groups);
        dd_pool_for(prefill_gate_up_chunk, &j, j.gate_up_chunks);
        dd_pool_for(prefill_quantize_h, &j, j.n_groups);
        dd_pool_for(prefill_down_chunk, &j, j.down_chunks);
        if (atomic_load(&j.failed))
            rc = DD_ERR_NOMEM;
    }
    if (rc == DD_OK) {
        j.sum_tokens = n > ROUTE_BY_ROWS ? PREFILL_TOKENS_PER_CHUNK : 1;
        dd_pool_for(prefill_sum_chunk, &j, dd_div_up(n, j.sum_tokens));
        for (size_t t = 0; t < n; t++)
            for (size_t i = 0; i < n_used; i++) {
                if (sel_out != NULL)
                    sel_out[t * n_used + i] = j.sel[t * n_used + i];
                if (weights_out != NULL)
                    weights_out[t * n_used + i] = j.weights[t * n_slots + i];
            }
    }
    if (j.has_all)
        dd_acts_free(&j.all);
    for (size_t g = 0; j.groups != NULL && g < j.n_groups; g++) {
        if (j.groups[g].has_x)
            dd_acts_free(&j.groups[g].xacts);
        if (j.groups[g].has_h)
            dd_acts_free(&j.groups[g].hacts);
    }
    free(small);
    free(index);
    free(j.sel);
    free(j.rows);
    free(j.groups);
    return rc;
}
