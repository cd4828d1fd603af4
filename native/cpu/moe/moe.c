/* One token's MoE feed-forward in one call (spec 3.3; see dd_moe_ffn in deltadesk_cpu.h).
 *
 * Three parallel stages, each split into chunks of output rows; a chunk's result depends only on
 * its rows, so every thread count gives the same bits:
 *   1. router logits (f32 weights);            -> softmax, top-k, renormalise (caller thread)
 *   2. a chunk of one expert's gate and up rows (chosen experts, then the shared one), then
 *      SwiGLU on those rows;                   -> quantize each hidden vector (caller thread)
 *   3. a chunk of one expert's down rows;      -> the weighted sum over the experts (caller thread)
 * Each thread's chunks of a stage are one contiguous run of experts' rows (the pool's home ranges).
 */
#include <math.h>
#include <stdlib.h>

#include "runtime.h"

typedef struct {
    const uint8_t *gate, *up, *down;
    int gate_type, up_type, down_type;
    size_t ff;
    float *g, *u, *h;      /* ff each */
    float *y;              /* d: this expert's down output */
    dd_acts acts;          /* h quantized */
    float weight;          /* routing weight, or the shared expert's sigmoid gate */
    size_t first_chunk;    /* of the gate/up stage */
    size_t first_down;     /* of the down stage */
} expert;

typedef struct {
    const dd_kernels *kt;
    const dd_moe_weights *mw;
    const float *x;
    const dd_acts *xacts;
    float *logits;
    expert ex[DD_MOE_MAX_USED + 1];   /* the n_used routed experts, then the shared one */
    size_t n_ex;
    size_t router_rows, gate_up_rows, down_rows;   /* rows per chunk of each stage */
    size_t gate_up_chunks, down_chunks;
    float *out;
} moe_job;

static size_t row_bytes(size_t k, int wtype)
{
    return dd_row_bytes(wtype, k);
}

static void router_chunk(void *ctx, size_t chunk)
{
    moe_job *j = ctx;
    const size_t r0 = chunk * j->router_rows, r1 = dd_min_size(r0 + j->router_rows, j->mw->n_expert);
    j->kt->dots_f32(j->mw->router + r0 * j->mw->d, r1 - r0, j->x, 1, j->mw->d, j->logits + r0, 0);
}

/* The expert whose chunks of a stage start at or before `chunk` (the last such). */
static expert *expert_of(moe_job *j, size_t chunk, int down)
{
    size_t i = 0;
    while (i + 1 < j->n_ex && (down ? j->ex[i + 1].first_down : j->ex[i + 1].first_chunk) <= chunk)
        i++;
    return &j->ex[i];
}

int dd_moe_swiglu(int isa, const float *g, const float *u, size_t n, float *h)
{
    const dd_kernels *kt = dd_kernels_for(isa);
    if (kt == NULL)
        return DD_ERR_ISA;
    kt->swiglu(g, u, n, h);
    return DD_OK;
}

/* A chunk of one expert's gate and up rows, then SwiGLU on them. */
static void gate_up_chunk(void *ctx, size_t chunk)
{
    moe_job *j = ctx;
    const size_t d = j->mw->d;
    expert *e = expert_of(j, chunk, 0);
    const size_t r0 = (chunk - e->first_chunk) * j->gate_up_rows, r1 = dd_min_size(r0 + j->gate_up_rows, e->ff);
    const size_t rbg = row_bytes(d, e->gate_type), rbu = row_bytes(d, e->up_type);
    j->kt->gemm[e->gate_type](e->gate + r0 * rbg, rbg, r1 - r0, e->ff - r0, j->xacts, e->g + r0, e->ff);
    j->kt->gemm[e->up_type](e->up + r0 * rbu, rbu, r1 - r0, e->ff - r0, j->xacts, e->u + r0, e->ff);
    j->kt->swiglu(e->g + r0, e->u + r0, r1 - r0, e->h + r0);
}

/* A chunk of one expert's down rows. */
static void down_chunk(void *ctx, size_t chunk)
{
    moe_job *j = ctx;
    const size_t d = j->mw->d;
    expert *e = expert_of(j, chunk, 1);
    const size_t rb = row_bytes(e->ff, e->down_type);
    const size_t r0 = (chunk - e->first_down) * j->down_rows, r1 = dd_min_size(r0 + j->down_rows, d);
    j->kt->gemm[e->down_type](e->down + r0 * rb, rb, r1 - r0, d - r0, &e->acts, e->y + r0, d);
}

/* out[r] = sum over the experts in order of weight * down output, from 0 (each out[r] one f32 chain). */
static void weighted_sum(const moe_job *j)
{
    for (size_t r = 0; r < j->mw->d; r++)
        j->out[r] = 0.0f;
    for (size_t i = 0; i < j->n_ex; i++)
        for (size_t r = 0; r < j->mw->d; r++)
            j->out[r] = j->out[r] + j->ex[i].weight * j->ex[i].y[r];
}

/* Softmax over the logits, the n_used largest probabilities (ties: lower index first), their
 * weights renormalised to sum 1 (the sum clamped at >= 2^-14 as llama.cpp does). A NaN probability (an inf
 * or NaN logit, e.g. from a damaged router tensor) ranks after every number, NaNs among themselves by
 * index, as the numpy twin's stable argsort ranks them: every pick is a valid expert and the weights
 * come out NaN. A picked expert's p is set to -1 (no probability is negative). */
void dd_moe_route(const float *logits, size_t n_expert, size_t n_used, int32_t *sel, float *weights, float *p)
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
        for (size_t e = 0; best == n_expert && e < n_expert; e++)   /* only NaNs left: the lowest index */
            if (p[e] != -1.0f)
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

/* 1 unless wtype is a row-grouped layout (DD_Q4_0_IL, DD_MXFP4_IL, DD_Q4_K_IL: stripes of 8 rows, DD_Q2_K_RL,
 * DD_Q3_K_RL: groups of 4) and a stacked expert's `rows` would not start its groups on its first row. */
static int experts_whole_stripes(int wtype, size_t rows)
{
    const int striped = wtype == DD_Q4_0_IL || wtype == DD_MXFP4_IL || wtype == DD_Q4_K_IL;
    return (!striped || rows % 8 == 0) && ((wtype != DD_Q2_K_RL && wtype != DD_Q3_K_RL) || rows % 4 == 0);
}

int dd_moe_valid(const dd_moe_weights *w)
{
    const int types_ok = dd_wtype_fits(w->gate_type, w->d) && dd_wtype_fits(w->up_type, w->d) &&
                         dd_wtype_fits(w->down_type, w->ff) && experts_whole_stripes(w->gate_type, w->ff) &&
                         experts_whole_stripes(w->up_type, w->ff) && experts_whole_stripes(w->down_type, w->d);
    const int shared_ok = w->sh_gate == NULL ||
                          (w->sh_up != NULL && w->sh_down != NULL && w->sh_gate_inp != NULL &&
                           dd_wtype_fits(w->sh_gate_type, w->d) && dd_wtype_fits(w->sh_up_type, w->d) &&
                           dd_wtype_fits(w->sh_down_type, w->ff_sh));
    return types_ok && shared_ok && w->d > 0 && w->d % DD_QK == 0 && w->ff > 0 && w->ff % DD_QK == 0 &&
           (w->sh_gate == NULL || (w->ff_sh > 0 && w->ff_sh % DD_QK == 0)) && w->n_used >= 1 &&
           w->n_used <= w->n_expert && w->n_used <= DD_MOE_MAX_USED;
}

/* The routed experts chosen by sel/weights, then the shared one (its sigmoid gate of x), into j->ex;
 * their g/u/h/y buffers from fbuf; the chunks of the gate/up stage and the rows per chunk of both. */
static void set_experts(moe_job *j, const int32_t *sel, const float *weights, float *fbuf)
{
    const dd_moe_weights *mw = j->mw;
    const size_t d = mw->d, n_used = mw->n_used;
    size_t gate_up_row_bytes = 0, down_row_bytes = 0, chunks = 0;   /* the largest of the experts' */
    for (size_t i = 0; i < j->n_ex; i++) {
        expert *e = &j->ex[i];
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
            float logit;
            j->kt->dots_f32(mw->sh_gate_inp, 1, j->x, 1, d, &logit, 0);
            *e = (expert){
                .gate = mw->sh_gate, .up = mw->sh_up, .down = mw->sh_down, .gate_type = mw->sh_gate_type,
                .up_type = mw->sh_up_type, .down_type = mw->sh_down_type, .ff = mw->ff_sh,
                .weight = 1.0f / (1.0f + expf(-logit)),
            };
        }
        e->g = fbuf;
        e->u = e->g + e->ff;
        e->h = e->u + e->ff;
        e->y = e->h + e->ff;
        fbuf = e->y + d;
        const size_t gu = row_bytes(d, e->gate_type) + row_bytes(d, e->up_type), dn = row_bytes(e->ff, e->down_type);
        gate_up_row_bytes = gu > gate_up_row_bytes ? gu : gate_up_row_bytes;
        down_row_bytes = dn > down_row_bytes ? dn : down_row_bytes;
    }
    j->gate_up_rows = dd_chunk_rows(gate_up_row_bytes);
    j->down_rows = dd_chunk_rows(down_row_bytes);
    for (size_t i = 0; i < j->n_ex; i++) {
        j->ex[i].first_chunk = chunks;
        j->ex[i].first_down = i * dd_div_up(d, j->down_rows);
        chunks += dd_div_up(j->ex[i].ff, j->gate_up_rows);
    }
    j->gate_up_chunks = chunks;
    j->down_chunks = j->n_ex * dd_div_up(d, j->down_rows);
}

/* All of a call's memory, from the thread's scratch (no allocation call after call): the router logits
 * and probabilities, each expert's g, u, h and y, x's and each hidden vector's prepared activations. */
static size_t moe_bytes(const dd_kernels *kt, const dd_moe_weights *mw, size_t n_ex, size_t hidden)
{
    const size_t floats = 2 * mw->n_expert + 3 * hidden + n_ex * mw->d;
    size_t bytes = ((floats * sizeof(float) + 63) & ~(size_t)63) + dd_acts_bytes(kt, 1, mw->d);
    for (size_t i = 0; i < n_ex; i++)
        bytes += dd_acts_bytes(kt, 1, i < mw->n_used ? mw->ff : mw->ff_sh);
    return bytes;
}

int dd_moe_ffn(int isa, const dd_moe_weights *mw, const float *x, float *out, int32_t *sel_out, float *weights_out)
{
    const dd_kernels *kt = dd_kernels_for(isa);
    if (kt == NULL)
        return DD_ERR_ISA;
    if (!dd_moe_valid(mw))
        return DD_ERR_ARG;
    const size_t d = mw->d, n_used = mw->n_used, has_sh = mw->sh_gate != NULL;
    const size_t hidden = n_used * mw->ff + (has_sh ? mw->ff_sh : 0);
    moe_job j = { .kt = kt, .mw = mw, .x = x, .n_ex = n_used + has_sh, .out = out };
    uint8_t *mem = dd_scratch(DD_SCRATCH_MOE, moe_bytes(kt, mw, j.n_ex, hidden));
    if (mem == NULL)
        return DD_ERR_NOMEM;
    const size_t floats = 2 * mw->n_expert + 3 * hidden + j.n_ex * d;
    float *p = (float *)mem + mw->n_expert;
    uint8_t *acts_mem = mem + ((floats * sizeof(float) + 63) & ~(size_t)63);
    int32_t sel[DD_MOE_MAX_USED];
    float weights[DD_MOE_MAX_USED];
    dd_acts xacts;
    dd_acts_prepare(kt, x, 1, d, acts_mem, &xacts);
    acts_mem += dd_acts_bytes(kt, 1, d);
    j.xacts = &xacts;
    j.logits = (float *)mem;

    j.router_rows = dd_chunk_rows(d * sizeof(float));
    dd_pool_for(router_chunk, &j, dd_div_up(mw->n_expert, j.router_rows));
    dd_moe_route(j.logits, mw->n_expert, n_used, sel, weights, p);
    set_experts(&j, sel, weights, p + mw->n_expert);
    dd_pool_for(gate_up_chunk, &j, j.gate_up_chunks);
    for (size_t i = 0; i < j.n_ex; i++) {
        dd_acts_prepare(kt, j.ex[i].h, 1, j.ex[i].ff, acts_mem, &j.ex[i].acts);
        acts_mem += dd_acts_bytes(kt, 1, j.ex[i].ff);
    }
    dd_pool_for(down_chunk, &j, j.down_chunks);
    weighted_sum(&j);
    for (size_t i = 0; i < n_used; i++) {
        if (sel_out != NULL)
            sel_out[i] = sel[i];
        if (weights_out != NULL)
            weights_out[i] = weights[i];
    }
    return DD_OK;
}
