/* The decode step: one token through every layer, the final norm and the LM head in one call
 * (dd_step in deltadesk_cpu.h; Python builds the dd_step_model once at load and only samples).
 *
 * It computes exactly what engine/arch/qwen35/cpu.py's per-hook forward pass computes for one token,
 * bit for bit, so a token decoded here equals the same token read by any prefill piece (the split
 * invariance of engine/arch/qwen35/model.py):
 *   - the GDN step, attention and the MoE FFN are the very C calls the hooks make (dd_gdn_decode,
 *     dd_attn_decode, dd_moe_ffn); the products are dd_matmul's, those that read the same vector (qkv,
 *     z, beta, alpha; q, k, v; gate, up) in one dd_matvec_set, which gives each dd_matmul's bits;
 *   - what the hooks leave to numpy is redone here in numpy's own arithmetic: RMSNorm in float64 with
 *     numpy's pairwise summation of the squares (np_sum_squares), residual adds in float32, RoPE as
 *     float64 x1 cos - x2 sin on the cos/sin table the caller computed with the reference's own numpy
 *     code (engine.ops.reference.rope_tables: numpy's SIMD cos/sin are not libm's), and the dense
 *     FFN's SiLU through dd_silu_mul, which the hook uses too.
 * Every piece is bit-identical across ISA levels and thread counts (the kernels' rule), so the step is.
 *
 * dd_step_batch runs n tokens of n sequences through the same pieces: the products over all n rows
 * (dd_matmul_set of n columns, dd_matmul's bits, each column with the one-column bits; the routed experts by
 * dd_moe_prefill, each expert's weights read once for the rows routed to it), the norms, RoPE, the
 * recurrence (dd_gdn_decode_rows: each row's one-token arithmetic), the KV append and attention row by row on
 * each row's own state, position and cache. So row i gets the bits dd_step gives that token of
 * that sequence alone, whatever the other rows (docs/design/batched-decode.md).
 */
#include <math.h>
#include <stdlib.h>

#include "runtime.h"

/* numpy's pairwise sum of x[i]^2 in float64 (numpy/_core/src/umath/loops_utils.h.src, pairwise_sum with
 * PW_BLOCKSIZE 128: below 8 values one running sum; up to 128 eight running sums combined as
 * ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then the rest one by one; above, split at n/2 rounded down to
 * a multiple of 8), which np.mean(x * x, axis=-1) adds to its identity 0.0. */
static double np_sum_squares(const float *x, size_t n)
{
    if (n < 8) {
        double res = -0.0;
        for (size_t i = 0; i < n; i++)
            res += (double)x[i] * x[i];
        return res;
    }
    if (n <= 128) {
        double r[8];
        size_t i;
        for (int l = 0; l < 8; l++)
            r[l] = (double)x[l] * x[l];
        for (i = 8; i < n - n % 8; i += 8)
            for (int l = 0; l < 8; l++)
                r[l] += (double)x[i + l] * x[i + l];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res += (double)x[i] * x[i];
        return res;
    }
    size_t n2 = n / 2;
    n2 -= n2 % 8;
    return np_sum_squares(x, n2) + np_sum_squares(x + n2, n - n2);
}

/* engine.ops.reference.rmsnorm of one row: float64 x / sqrt(mean(x^2) + eps) * w (w NULL: no weight),
 * rounded to float32. */
static void rmsnorm_row(const float *x, const float *w, size_t n, double eps, float *y)
{
    const double r = sqrt((0.0 + np_sum_squares(x, n)) / (double)n + eps);
    for (size_t i = 0; i < n; i++)
        y[i] = w != NULL ? (float)((double)x[i] / r * (double)w[i]) : (float)((double)x[i] / r);
}

typedef struct {
    const float *x, *w;
    size_t n, d, rows;   /* rows: a chunk's */
    double eps;
    float *y;
} norm_job;

static void norm_chunk(void *ctx, size_t chunk)
{
    const norm_job *j = ctx;
    const size_t r1 = dd_min_size((chunk + 1) * j->rows, j->n);
    for (size_t r = chunk * j->rows; r < r1; r++)
        rmsnorm_row(j->x + r * j->d, j->w, j->d, j->eps, j->y + r * j->d);
}

int dd_rmsnorm_rows(const float *x, const float *w, size_t n, size_t d, double eps, float *y)
{
    if (d == 0 || x == NULL || y == NULL)
        return DD_ERR_ARG;
    const size_t rows = d >= 8192 ? 1 : 8192 / d;   /* ~32 KiB of a chunk's values */
    norm_job j = { .x = x, .w = w, .n = n, .d = d, .rows = rows, .eps = eps, .y = y };
    dd_pool_for(norm_chunk, &j, dd_div_up(n, rows));
    return DD_OK;
}

/* engine.ops.reference.rope_multi on one head: pairs (i, i + half) of the first 2 * half values. */
static void rope_head(float *x, size_t half, const double *c, const double *s)
{
    for (size_t i = 0; i < half; i++) {
        const double x1 = x[i], x2 = x[i + half];
        x[i] = (float)(x1 * c[i] - x2 * s[i]);
        x[i + half] = (float)(x1 * s[i] + x2 * c[i]);
    }
}

static double sigmoid(double x)
{
    const double e = exp(-fabs(x));
    return x >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

void dd_silu_mul(const float *g, const float *u, size_t n, float *y)
{
    for (size_t i = 0; i < n; i++) {
        const double x = g[i];
        y[i] = (float)(x * sigmoid(x)) * u[i];
    }
}

static int mat_ok(const dd_mat *m, size_t rows, size_t k)
{
    return m->w != NULL && m->rows == rows && m->k == k && dd_wtype_fits(m->wtype, k);
}

static int matvec(int isa, const dd_mat *m, const float *x, float *y)
{
    return dd_matmul(isa, m->wtype, m->w, m->rows, m->k, x, 1, y);
}

static dd_matvec_out out_of(const dd_mat *m, float *y)
{
    return (dd_matvec_out){ .wtype = m->wtype, .w = m->w, .rows = m->rows, .y = y };
}

static void add_into(float *h, const float *t, size_t n)
{
    for (size_t i = 0; i < n; i++)
        h[i] = h[i] + t[i];
}

/* Checks one layer's shapes against the model's; returns the floats of scratch it needs, 0 if bad. */
static size_t layer_scratch(const dd_step_model *m, const dd_step_layer *L, const dd_step_state *s, size_t il)
{
    const size_t d = m->n_embd, hd = m->head_dim, nq = m->n_head * hd, nkv = m->n_head_kv * hd;
    size_t need = 0;
    if (L->attn_norm == NULL || L->post_norm == NULL)
        return 0;
    if (L->kind == DD_LAYER_GDN) {
        const dd_gdn_layer *G = L->gdn;
        if (G == NULL || s->conv[il] == NULL || s->ssm[il] == NULL)
            return 0;
        const size_t nvd = G->n_v * G->dv, conv_dim = 2 * G->n_k * G->dk + nvd;
        if (!mat_ok(&L->qkv, conv_dim, d) || !mat_ok(&L->z, nvd, d) || !mat_ok(&L->beta, G->n_v, d) ||
            !mat_ok(&L->alpha, G->n_v, d) || !mat_ok(&L->ssm_out, d, nvd))
            return 0;
        need = conv_dim + 2 * nvd + 2 * G->n_v;
    } else if (L->kind == DD_LAYER_ATTN) {
        if (m->n_head_kv == 0 || m->n_head % m->n_head_kv != 0 || hd % DD_ATTN_LANES != 0 || m->rope_dims > hd ||
            (s->kv_type == DD_KV_Q8_0 && hd % DD_Q8_BLOCK != 0) ||
            m->rope_dims % 2 != 0 || L->q_norm == NULL || L->k_norm == NULL || s->k[il] == NULL || s->v[il] == NULL)
            return 0;
        if (!mat_ok(&L->q, 2 * nq, d) || !mat_ok(&L->k, nkv, d) || !mat_ok(&L->v, nkv, d) || !mat_ok(&L->o, d, nq))
            return 0;
        need = 6 * nq + 3 * nkv;   /* qg, then q, gate, o, normed q; k, v, normed k */
    } else {
        return 0;
    }
    if (L->moe != NULL) {
        if (L->moe->d != d)
            return 0;
    } else {
        const size_t ff = L->ffn_gate.rows;
        if (!mat_ok(&L->ffn_gate, ff, d) || !mat_ok(&L->ffn_up, ff, d) || !mat_ok(&L->ffn_down, d, ff))
            return 0;
        need = need > 3 * ff ? need : 3 * ff;
    }
    return need;
}

static int gdn_mixer(int isa, const dd_step_layer *L, float *conv, float *ssm, const float *xn, float *out,
                     float *buf)
{
    const dd_gdn_layer *G = L->gdn;
    const size_t nvd = G->n_v * G->dv;
    float *mixed = buf, *z = mixed + L->qkv.rows, *b = z + nvd, *a = b + G->n_v, *y = a + G->n_v;
    const dd_matvec_out in[4] = { out_of(&L->qkv, mixed), out_of(&L->z, z), out_of(&L->beta, b),
                                  out_of(&L->alpha, a) };
    int rc;
    if ((rc = dd_matvec_set(isa, in, 4, L->qkv.k, xn)) != DD_OK ||
        (rc = dd_gdn_decode(G, mixed, z, b, a, conv, ssm, y)) != DD_OK)
        return rc;
    return matvec(isa, &L->ssm_out, y, out);
}

/* n floats (n a multiple of DD_Q8_BLOCK) -> Q8_0 blocks at dst, by engine/turn/kv_types.py quantize_q8_0's
 * rule: amax = max |x| (NaN ignored), d = half(amax / 127) to nearest even, q = clamp(roundf(x / d), -127,
 * 127) with the float quotient by that half (roundf: half away from zero), 0 where d is 0 or x / d NaN.
 * Each step is one IEEE operation, so numpy's writer stores the same bytes. */
static void q8_0_row(uint8_t *dst, const float *x, size_t n)
{
    for (size_t b = 0; b < n; b += DD_Q8_BLOCK, dst += DD_Q8_BYTES) {
        float amax = 0.0f;
        for (size_t i = 0; i < DD_Q8_BLOCK; i++) {
            const float a = fabsf(x[b + i]);
            amax = a > amax ? a : amax;
        }
        const uint16_t h = dd_f32_to_f16(amax / 127.0f);
        const float d = dd_f16_to_f32(h);
        dst[0] = (uint8_t)(h & 0xff);
        dst[1] = (uint8_t)(h >> 8);
        for (size_t i = 0; i < DD_Q8_BLOCK; i++) {
            const float y = d > 0.0f ? x[b + i] / d : 0.0f, r = y == y ? roundf(y) : 0.0f;
            dst[2 + i] = (uint8_t)(int8_t)(r > 127.0f ? 127 : r < -127.0f ? -127 : (int)r);
        }
    }
}

/* Cache row `pos` of n floats (kv_type's elements; a half rounded to nearest even, as numpy's astype;
 * Q8_0 blocks by q8_0_row). */
static void store_row(void *cache, int kv_type, size_t pos, const float *x, size_t n)
{
    if (kv_type == DD_KV_F32) {
        memcpy((float *)cache + pos * n, x, n * sizeof(float));
        return;
    }
    if (kv_type == DD_KV_Q8_0) {
        q8_0_row((uint8_t *)cache + pos * (n / DD_Q8_BLOCK * DD_Q8_BYTES), x, n);
        return;
    }
    uint16_t *h = (uint16_t *)cache + pos * n;
    for (size_t i = 0; i < n; i++)
        h[i] = dd_f32_to_f16(x[i]);
}

/* Attention of one row after its q / k / v products: qg (2 nq floats, per head [q_h | gate_h]), kk and vv
 * (nkv each) -> o (nq): q and k normed and rotated, the K/V row written at cache row pos, the query over rows
 * 0..pos. tmp: 3 nq + nkv floats. */
static int attn_row(const dd_step_model *m, const dd_step_layer *L, const dd_step_state *s, size_t il, size_t pos,
                    const double *rope_cos, const double *rope_sin, const float *qg, const float *kk,
                    const float *vv, float *o, float *tmp)
{
    const size_t hd = m->head_dim, nh = m->n_head, nq = nh * hd, nkv = m->n_head_kv * hd, half = m->rope_dims / 2;
    float *q = tmp, *gate = q + nq, *qn = gate + nq, *kn = qn + nq;
    for (size_t h = 0; h < nh; h++) {   /* attn_q rows are per head [q_h | gate_h] */
        memcpy(q + h * hd, qg + 2 * h * hd, hd * sizeof(float));
        memcpy(gate + h * hd, qg + 2 * h * hd + hd, hd * sizeof(float));
        rmsnorm_row(q + h * hd, L->q_norm, hd, m->eps, qn + h * hd);
        rope_head(qn + h * hd, half, rope_cos, rope_sin);
    }
    for (size_t h = 0; h < m->n_head_kv; h++) {
        rmsnorm_row(kk + h * hd, L->k_norm, hd, m->eps, kn + h * hd);
        rope_head(kn + h * hd, half, rope_cos, rope_sin);
    }
    store_row(s->k[il], s->kv_type, pos, kn, nkv);
    store_row(s->v[il], s->kv_type, pos, vv, nkv);
    return dd_attn_decode_kv(nh, m->n_head_kv, hd, qn, gate, s->kv_type, s->k[il], s->v[il], pos + 1, o);
}

static int attn_mixer(int isa, const dd_step_model *m, const dd_step_layer *L, const dd_step_state *s, size_t il,
                      size_t pos, const double *rope_cos, const double *rope_sin, const float *xn, float *out,
                      float *buf)
{
    const size_t nq = m->n_head * m->head_dim, nkv = m->n_head_kv * m->head_dim;
    float *qg = buf, *kk = qg + 2 * nq, *vv = kk + nkv, *o = vv + nkv, *tmp = o + nq;
    const dd_matvec_out in[3] = { out_of(&L->q, qg), out_of(&L->k, kk), out_of(&L->v, vv) };
    int rc;
    if ((rc = dd_matvec_set(isa, in, 3, L->q.k, xn)) != DD_OK ||
        (rc = attn_row(m, L, s, il, pos, rope_cos, rope_sin, qg, kk, vv, o, tmp)) != DD_OK)
        return rc;
    return matvec(isa, &L->o, o, out);
}

static int ffn(int isa, const dd_step_layer *L, const float *xn, float *out, float *buf)
{
    if (L->moe != NULL)
        return dd_moe_ffn(isa, L->moe, xn, out, NULL, NULL);
    const size_t ff = L->ffn_gate.rows;
    float *g = buf, *u = g + ff, *hh = u + ff;
    const dd_matvec_out in[2] = { out_of(&L->ffn_gate, g), out_of(&L->ffn_up, u) };
    int rc;
    if ((rc = dd_matvec_set(isa, in, 2, L->ffn_gate.k, xn)) != DD_OK)
        return rc;
    dd_silu_mul(g, u, ff, hh);
    return matvec(isa, &L->ffn_down, hh, out);
}

/* The floats of per-row scratch a step of state s at row pos needs (the largest layer's), 0 if the model,
 * the state or pos does not fit. */
static size_t step_scratch(const dd_step_model *m, const dd_step_state *s, size_t pos)
{
    size_t need = 0;
    if (s == NULL || m->n_embd == 0 || pos >= s->capacity || m->output_norm == NULL ||
        (s->kv_type != DD_KV_F32 && s->kv_type != DD_KV_F16 && s->kv_type != DD_KV_Q8_0) ||
        !mat_ok(&m->lm_head, m->lm_head.rows, m->n_embd))
        return 0;
    for (size_t il = 0; il < m->n_layer; il++) {
        const size_t n = layer_scratch(m, &m->layers[il], s, il);
        if (n == 0)
            return 0;
        need = n > need ? n : need;
    }
    return need;
}

int dd_step(int isa, const dd_step_model *m, const dd_step_state *s, size_t pos, const float *x,
            const double *rope_cos, const double *rope_sin, float *logits)
{
    if (dd_kernels_for(isa) == NULL)
        return DD_ERR_ISA;
    const size_t d = m->n_embd, need = step_scratch(m, s, pos);
    if (need == 0)
        return DD_ERR_ARG;
    float *h = malloc((3 * d + need) * sizeof(float));
    if (h == NULL)
        return DD_ERR_NOMEM;
    float *xn = h + d, *t = xn + d, *buf = t + d;
    int rc = DD_OK;
    memcpy(h, x, d * sizeof(float));
    for (size_t il = 0; il < m->n_layer && rc == DD_OK; il++) {
        const dd_step_layer *L = &m->layers[il];
        rmsnorm_row(h, L->attn_norm, d, m->eps, xn);
        rc = L->kind == DD_LAYER_GDN ? gdn_mixer(isa, L, s->conv[il], s->ssm[il], xn, t, buf)
                                     : attn_mixer(isa, m, L, s, il, pos, rope_cos, rope_sin, xn, t, buf);
        if (rc != DD_OK)
            break;
        add_into(h, t, d);
        rmsnorm_row(h, L->post_norm, d, m->eps, xn);
        if ((rc = ffn(isa, L, xn, t, buf)) != DD_OK)
            break;
        add_into(h, t, d);
    }
    if (rc == DD_OK) {
        rmsnorm_row(h, m->output_norm, d, m->eps, xn);
        rc = matvec(isa, &m->lm_head, xn, logits);
    }
    free(h);
    return rc;
}

/* ---- n rows of n sequences (dd_step_batch) ---------------------------------------------------------- */

static int matmul_rows(int isa, const dd_mat *M, const float *x, size_t n, float *y)
{
    const dd_matvec_out one = out_of(M, y);
    return dd_matmul_set(isa, &one, 1, M->k, x, n);
}

static void norm_rows(const dd_step_model *m, const float *h, const float *w, size_t n, float *y)
{
    for (size_t i = 0; i < n; i++)
        rmsnorm_row(h + i * m->n_embd, w, m->n_embd, m->eps, y + i * m->n_embd);
}

/* The GDN mixer of n rows: the four input products (one dd_matmul_set) and ssm_out over all rows, the
 * recurrence of each row on its sequence's state (dd_gdn_decode_rows). buf: n * (conv_dim + 2 nvd + 2 n_v)
 * floats. */
static int gdn_rows(int isa, const dd_step_layer *L, const dd_step_state *const *s, size_t il, size_t n,
                    const float *xn, float *out, float *buf)
{
    const dd_gdn_layer *G = L->gdn;
    const size_t C = L->qkv.rows, nvd = G->n_v * G->dv, nv = G->n_v;
    float *mixed = buf, *z = mixed + n * C, *b = z + n * nvd, *a = b + n * nv, *y = a + n * nv;
    const dd_matvec_out in[4] = { out_of(&L->qkv, mixed), out_of(&L->z, z), out_of(&L->beta, b),
                                  out_of(&L->alpha, a) };
    float **states = malloc(2 * n * sizeof *states);
    if (states == NULL)
        return DD_ERR_NOMEM;
    for (size_t i = 0; i < n; i++) {
        states[i] = s[i]->conv[il];
        states[n + i] = s[i]->ssm[il];
    }
    int rc = dd_matmul_set(isa, in, 4, L->qkv.k, xn, n);
    if (rc == DD_OK)
        rc = dd_gdn_decode_rows(isa, G, n, mixed, z, b, a, states, states + n, y);
    free(states);
    return rc != DD_OK ? rc : matmul_rows(isa, &L->ssm_out, y, n, out);
}

/* The attention mixer of n rows: q / k / v and attn_output over all rows, attn_row per row on its own KV at
 * its own position. buf: n * (3 nq + 2 nkv) + 3 nq + nkv floats (within n times layer_scratch's). */
static int attn_rows(int isa, const dd_step_model *m, const dd_step_layer *L, const dd_step_state *const *s,
                     size_t il, size_t n, const size_t *pos, const double *rope_cos, const double *rope_sin,
                     const float *xn, float *out, float *buf)
{
    const size_t nq = m->n_head * m->head_dim, nkv = m->n_head_kv * m->head_dim, half = m->rope_dims / 2;
    float *qg = buf, *kk = qg + n * 2 * nq, *vv = kk + n * nkv, *o = vv + n * nkv, *tmp = o + n * nq;
    const dd_matvec_out in[3] = { out_of(&L->q, qg), out_of(&L->k, kk), out_of(&L->v, vv) };
    int rc = dd_matmul_set(isa, in, 3, L->q.k, xn, n);
    for (size_t i = 0; i < n && rc == DD_OK; i++)
        rc = attn_row(m, L, s[i], il, pos[i], rope_cos + i * half, rope_sin + i * half, qg + i * 2 * nq,
                      kk + i * nkv, vv + i * nkv, o + i * nq, tmp);
    return rc != DD_OK ? rc : matmul_rows(isa, &L->o, o, n, out);
}

/* The FFN of n rows: dd_moe_prefill (each expert's weights once for the rows routed to it), or the dense SwiGLU
 * over all rows. buf: n * 3 ff floats. */
static int ffn_rows(int isa, const dd_step_layer *L, size_t n, const float *xn, float *out, float *buf)
{
    if (L->moe != NULL)
        return dd_moe_prefill(isa, L->moe, n, xn, out, NULL, NULL);
    const size_t ff = L->ffn_gate.rows;
    float *g = buf, *u = g + n * ff, *hh = u + n * ff;
    const dd_matvec_out in[2] = { out_of(&L->ffn_gate, g), out_of(&L->ffn_up, u) };
    int rc;
    if ((rc = dd_matmul_set(isa, in, 2, L->ffn_gate.k, xn, n)) != DD_OK)
        return rc;
    dd_silu_mul(g, u, n * ff, hh);
    return matmul_rows(isa, &L->ffn_down, hh, n, out);
}

/* Every layer of n rows: h (n x n_embd, then xn, t and the layers' scratch after it) updated in place. */
static int batch_layers(int isa, const dd_step_model *m, size_t n, const dd_step_state *const *s, const size_t *pos,
                        const double *rope_cos, const double *rope_sin, float *h)
{
    const size_t d = m->n_embd;
    float *xn = h + n * d, *t = xn + n * d, *lb = t + n * d;
    int rc = DD_OK;
    for (size_t il = 0; il < m->n_layer && rc == DD_OK; il++) {
        const dd_step_layer *L = &m->layers[il];
        norm_rows(m, h, L->attn_norm, n, xn);
        rc = L->kind == DD_LAYER_GDN ? gdn_rows(isa, L, s, il, n, xn, t, lb)
                                     : attn_rows(isa, m, L, s, il, n, pos, rope_cos, rope_sin, xn, t, lb);
        if (rc != DD_OK)
            break;
        add_into(h, t, n * d);
        norm_rows(m, h, L->post_norm, n, xn);
        if ((rc = ffn_rows(isa, L, n, xn, t, lb)) != DD_OK)
            break;
        add_into(h, t, n * d);
    }
    return rc;
}

int dd_step_batch(int isa, const dd_step_model *m, size_t n, const dd_step_state *const *s, const size_t *pos,
                  const float *x, const double *rope_cos, const double *rope_sin, float *logits)
{
    if (dd_kernels_for(isa) == NULL)
        return DD_ERR_ISA;
    const size_t d = m->n_embd;
    size_t need = 0;
    if (n == 0)
        return DD_ERR_ARG;
    for (size_t i = 0; i < n; i++) {
        const size_t r = step_scratch(m, s[i], pos[i]);
        if (r == 0)
            return DD_ERR_ARG;
        need = r > need ? r : need;
    }
    float *h = malloc(n * (3 * d + need) * sizeof(float));
    if (h == NULL)
        return DD_ERR_NOMEM;
    memcpy(h, x, n * d * sizeof(float));
    int rc = batch_layers(isa, m, n, s, pos, rope_cos, rope_sin, h);
    if (rc == DD_OK) {
        norm_rows(m, h, m->output_norm, n, h + n * d);
        rc = matmul_rows(isa, &m->lm_head, h + n * d, n, logits);
    }
    free(h);
    return rc;
}
