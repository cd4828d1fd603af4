/* Causal gated GQA attention over the KV cache, for one query (decode) or many (prefill): the
 * kernel body, compiled once per ISA level. attention.c includes it for the portable build,
 * attention_avx2.c and attention_avx512.c with their own -m flags; ATTN_SUFFIX names the copy.
 *
 * Arithmetic (the same at every level and for every split; deltadesk_cpu.h dd_attn_prefill): the
 * cache is cut into blocks of DD_ATTN_BLOCK positions at absolute positions (block b holds rows
 * [b*256, b*256 + 256)). For one query row (a q head at cache position p) and each block it sees:
 *   s_t  = dot(q, k_t) * (1/sqrt(hd)), float: DD_ATTN_LANES partial sums, lane l fused-multiply-
 *          adding q[i] k_t[i] for i = l, l+16, ... in order, then the lanes in double by a fixed
 *          tree (l + l+8, + l+4, + l+2, + l+1) rounded to float;
 *   mx   = max_t s_t;  p_t = attn_exp(s_t - mx), float (exp in double, rounded);
 *   l_b  = sum of p_t in double: lane (t % 16) partial sums in order, then the same tree;
 *   o_b  = sum_t p_t v_t in float, one fused multiply-add per t in order;
 * then the blocks in order are merged in double (M, L, A: running max, sum and output):
 *   M' = max(M, mx); L = L exp(M - M') + l_b exp(mx - M'); A = A exp(M - M') + o_b exp(mx - M'),
 * and out = A / L * sigmoid(gate). Only IEEE + - * /, fused multiply-adds (the instruction, or
 * libm's fmaf where the build lacks it), contraction off and no fast-math, and libm's exp in
 * double: the compiler vectorises across lanes, keys or head dims, never inside one sum, so every
 * build gives the same bits, and a row's result depends only on its q, gate and the cache rows
 * 0..p, not on which call or tile it came in.
 *
 * Speed: prefill jobs are (kv head, 16 query positions); per block, sets of 8 query rows (the heads
 * of consecutive positions sharing the kv head) take their scores 8 rows x 2 keys at a time (16
 * accumulators, the 16 dots' lane trees done together by shuffles) and their weighted sums 8 rows
 * x 32 head dims at a time, so each key and value row read serves 8 rows. A row set spanning two
 * positions computes the later position's extra key for the earlier one too and weighs it by +0,
 * which leaves its sums unchanged bit for bit (a sum that starts at +0 never becomes -0).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include "runtime.h"
#include "vexp.h"

#pragma GCC diagnostic ignored "-Wpsabi"   /* 64-byte vectors in inlined helpers only, no ABI crossing */

#define ATTN_CAT2(a, b) a##_##b
#define ATTN_CAT(a, b) ATTN_CAT2(a, b)
#define ATTN_FN(name) ATTN_CAT(name, ATTN_SUFFIX)

#define AI static inline __attribute__((always_inline))
#define BLOCK DD_ATTN_BLOCK
#define LANES DD_ATTN_LANES

typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int vi __attribute__((vector_size(4 * LANES)));

AI vf ld(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

AI void st(float *p, vf v)
{
    memcpy(p, &v, sizeof v);
}

AI vf splat(float x)
{
    return (vf){ x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x };
}

AI vf vmax(vf a, vf b)
{
    const vi gt = a > b;
    return (vf)(((vi)a & gt) | ((vi)b & ~gt));
}

/* a * b + c rounded once, lane by lane: the FMA instruction where the build has it, else libm's
 * fmaf (exact too, in software on a CPU without FMA), so every build gives the same bits. */
#if defined(__AVX512F__)
AI vf vfma(vf a, vf b, vf c)
{
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#elif defined(__FMA__)
typedef float vh __attribute__((vector_size(2 * LANES)));
AI vf vfma(vf a, vf b, vf c)
{
    const vh lo = (vh)_mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                                      (__m256)__builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                                      (__m256)__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
    const vh hi = (vh)_mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                                      (__m256)__builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                                      (__m256)__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#else
AI vf vfma(vf a, vf b, vf c)
{
    vf r;
    for (int l = 0; l < LANES; l++)
        r[l] = fmaf(a[l], b[l], c[l]);
    return r;
}
#endif

typedef double vd __attribute__((vector_size(4 * LANES)));   /* LANES / 2 doubles */
typedef long long vl __attribute__((vector_size(4 * LANES)));

AI vd lo_d(vf a)
{
    return __builtin_convertvector(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7), vd);
}

AI vd hi_d(vf a)
{
    return __builtin_convertvector(__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15), vd);
}

AI vf join_f(vd lo, vd hi)
{
    typedef float vh __attribute__((vector_size(2 * LANES)));
    return __builtin_shufflevector(__builtin_convertvector(lo, vh), __builtin_convertvector(hi, vh), 0, 1, 2, 3, 4,
                                   5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* The dot's lane tree of one partial-sum vector, in double: (l + l+8), then + l+4, + l+2, + l+1. */
AI float tree16(vf a)
{
    vd d = lo_d(a) + hi_d(a);
    d = d + __builtin_shuffle(d, (vl){ 4, 5, 6, 7, 4, 5, 6, 7 });
    d = d + __builtin_shuffle(d, (vl){ 2, 3, 2, 3, 2, 3, 2, 3 });
    d = d + __builtin_shuffle(d, (vl){ 1, 1, 1, 1, 1, 1, 1, 1 });
    return (float)d[0];
}

/* tree16 of 16 partial-sum vectors at once (the same additions, paired across vectors by
 * shuffles): lane j of the result is tree16(a[j]). */
AI vf tree16x16(const vf *a)
{
    vd c[16], d[8], e[4], f[2];
    for (int i = 0; i < 16; i++)
        c[i] = lo_d(a[i]) + hi_d(a[i]);
    for (int i = 0; i < 8; i++)
        d[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], (vl){ 0, 1, 2, 3, 8, 9, 10, 11 }) +
               __builtin_shuffle(c[2 * i], c[2 * i + 1], (vl){ 4, 5, 6, 7, 12, 13, 14, 15 });
    for (int i = 0; i < 4; i++)
        e[i] = __builtin_shuffle(d[2 * i], d[2 * i + 1], (vl){ 0, 1, 4, 5, 8, 9, 12, 13 }) +
               __builtin_shuffle(d[2 * i], d[2 * i + 1], (vl){ 2, 3, 6, 7, 10, 11, 14, 15 });
    for (int i = 0; i < 2; i++)
        f[i] = __builtin_shuffle(e[2 * i], e[2 * i + 1], (vl){ 0, 2, 4, 6, 8, 10, 12, 14 }) +
               __builtin_shuffle(e[2 * i], e[2 * i + 1], (vl){ 1, 3, 5, 7, 9, 11, 13, 15 });
    return join_f(f[0], f[1]);
}

/* e^x for x <= 0 as the float rounding of dd_exp_d (vexp.h) (so within 0.5 ulp + 3e-13); 0 below -87
 * (e^-87 < 2^-125, below any sum it would join). */
AI vf attn_exp(vf x)
{
    const vi live = x >= splat(-87.0f);
    x = (vf)((vi)x & live);
    return (vf)((vi)join_f(dd_exp_d(lo_d(x)), dd_exp_d(hi_d(x))) & live);
}

static double attn_sigmoid(double x)
{
    const double e = exp(-fabs(x));
    return x >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

/* Scores s[0..len) of one block (scaled dots) -> probabilities in place, s[len..round16(len)) set to
 * 0; returns the block max, *sum the probabilities' sum (see the file comment). */
static float softmax_block(float *s, size_t len, double *sum)
{
    const size_t padded = dd_div_up(len, LANES) * LANES;
    for (size_t t = len; t < padded; t++)
        s[t] = -INFINITY;
    vf vm = ld(s);
    for (size_t t = LANES; t < padded; t += LANES)
        vm = vmax(vm, ld(s + t));
    float mx = vm[0];
    for (int l = 1; l < LANES; l++)
        mx = vm[l] > mx ? vm[l] : mx;
    double lane[LANES] = { 0 };
    for (size_t t = 0; t < padded; t += LANES) {
        const vf p = attn_exp(ld(s + t) - splat(mx));
        st(s + t, p);
        for (int l = 0; l < LANES; l++)
            lane[l] += (double)p[l];
    }
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++)
            lane[l] += lane[l + w];
    *sum = lane[0];
    return mx;
}

/* Merge one block's (mx, sum, o[hd]) into a row's running (M, L, A[hd]); first: the row's block 0. */
static void merge_block(double *M, double *L, double *A, float mx, double sum, const float *o, size_t hd, int first)
{
    if (first) {
        *M = mx;
        *L = sum;
        for (size_t i = 0; i < hd; i++)
            A[i] = o[i];
        return;
    }
    const double m2 = *M > mx ? *M : mx, c0 = exp(*M - m2), c1 = exp(mx - m2);
    *M = m2;
    *L = *L * c0 + sum * c1;
    for (size_t i = 0; i < hd; i++)
        A[i] = A[i] * c0 + (double)o[i] * c1;
}

static void finish_row(const double *A, double L, const float *gate, size_t hd, float *out)
{
    for (size_t i = 0; i < hd; i++)
        out[i] = (float)(A[i] / L * attn_sigmoid(gate[i]));
}

#define MAX_ROWS 8   /* query rows per micro-kernel call */

/* o_r[hd] = sum_{t < len} p_r[t] v_t for R <= MAX_ROWS rows sharing the keys (float, t in order, one
 * rounding per term), v_t = v + t * vrow; 32 head dims at a time, so a tile of v stays in L1. */
static void pv_rows(size_t R, const float *const *p, const float *v, size_t vrow, size_t len, size_t hd,
                    float *const *o)
{
    for (size_t c = 0; c < hd; c += 2 * LANES) {
        const size_t nv = hd - c < 2 * LANES ? 1 : 2;
        vf acc[MAX_ROWS][2];
        for (size_t r = 0; r < MAX_ROWS; r++)
            acc[r][0] = acc[r][1] = (vf){ 0 };
        if (R == MAX_ROWS && nv == 2) {
            for (size_t t = 0; t < len; t++) {
                __builtin_prefetch(v + (t + 6) * vrow + c);
                __builtin_prefetch(v + (t + 6) * vrow + c + LANES);
                const vf v0 = ld(v + t * vrow + c), v1 = ld(v + t * vrow + c + LANES);
                for (size_t r = 0; r < MAX_ROWS; r++) {
                    const vf pr = splat(p[r][t]);
                    acc[r][0] = vfma(pr, v0, acc[r][0]);
                    acc[r][1] = vfma(pr, v1, acc[r][1]);
                }
            }
        } else {
            for (size_t t = 0; t < len; t++)
                for (size_t r = 0; r < R; r++)
                    for (size_t x = 0; x < nv; x++)
                        acc[r][x] = vfma(splat(p[r][t]), ld(v + t * vrow + c + x * LANES), acc[r][x]);
        }
        for (size_t r = 0; r < R; r++)
            for (size_t x = 0; x < nv; x++)
                st(o[r] + c + x * LANES, acc[r][x]);
    }
}

/* Scaled scores of R <= MAX_ROWS rows q_r against keys t = 0..len-1 (k_t = k + t * krow) into s_r[t];
 * 8 rows x 2 keys at a time, the 16 dots' trees taken together. */
static void scores_rows(size_t R, const float *const *q, const float *k, size_t krow, size_t len, size_t hd,
                        float scale, float *const *s)
{
    size_t t = 0;
    if (R == MAX_ROWS)
        for (; t + 2 <= len; t += 2) {
            vf acc[16];
            for (int x = 0; x < 16; x++)
                acc[x] = (vf){ 0 };
            for (size_t i = 0; i < hd; i += LANES) {
                __builtin_prefetch(k + (t + 4) * krow + i);
                __builtin_prefetch(k + (t + 5) * krow + i);
                const vf k0 = ld(k + t * krow + i), k1 = ld(k + (t + 1) * krow + i);
                for (int r = 0; r < MAX_ROWS; r++) {
                    const vf qr = ld(q[r] + i);
                    acc[2 * r] = vfma(qr, k0, acc[2 * r]);
                    acc[2 * r + 1] = vfma(qr, k1, acc[2 * r + 1]);
                }
            }
            const vf dots = tree16x16(acc) * splat(scale);
            for (int r = 0; r < MAX_ROWS; r++) {
                s[r][t] = dots[2 * r];
                s[r][t + 1] = dots[2 * r + 1];
            }
        }
    for (; t < len; t++)
        for (size_t r = 0; r < R; r++) {
            vf acc = { 0 };
            for (size_t i = 0; i < hd; i += LANES)
                acc = vfma(ld(q[r] + i), ld(k + t * krow + i), acc);
            s[r][t] = tree16(acc) * scale;
        }
}

/* ---- decode: one query, the blocks split over the pool, merged in block order --------------- */

typedef struct {
    size_t n_kv, hd, group, m, row, n_blocks;
    const float *q, *k, *v;
    float *part_o;      /* [kv head][block][group][hd] */
    float *part_mx;     /* [kv head][block][group] */
    double *part_sum;   /* [kv head][block][group] */
    float scale;
} decode_job;

static void decode_block(void *ctx, size_t chunk)
{
    const decode_job *j = ctx;
    const size_t kvh = chunk / j->n_blocks, blk = chunk % j->n_blocks, hd = j->hd;
    const size_t t0 = blk * BLOCK, len = (t0 + BLOCK < j->m ? t0 + BLOCK : j->m) - t0;
    float s[BLOCK];
    for (size_t g = 0; g < j->group; g++) {
        const size_t part = (kvh * j->n_blocks + blk) * j->group + g;
        const float *qg = j->q + (kvh * j->group + g) * hd, *p = s;
        float *sp = s, *o = j->part_o + part * hd;
        scores_rows(1, &qg, j->k + t0 * j->row + kvh * hd, j->row, len, hd, j->scale, &sp);
        j->part_mx[part] = softmax_block(s, len, &j->part_sum[part]);
        pv_rows(1, &p, j->v + t0 * j->row + kvh * hd, j->row, len, hd, &o);
    }
}

int ATTN_FN(attn_decode)(size_t n_head, size_t n_kv, size_t hd, const float *q, const float *gate,
                         const float *k, const float *v, size_t m, float *out)
{
    decode_job j = { .n_kv = n_kv, .hd = hd, .group = n_head / n_kv, .m = m, .row = n_kv * hd,
                     .n_blocks = dd_div_up(m, BLOCK), .q = q, .k = k, .v = v,
                     .scale = (float)(1.0 / sqrt((double)hd)) };
    const size_t parts = n_kv * j.n_blocks * j.group;
    j.part_o = malloc(parts * hd * sizeof(float));
    j.part_mx = malloc(parts * sizeof(float));
    j.part_sum = malloc(parts * sizeof(double));
    double *A = malloc(hd * sizeof(double));
    int rc = DD_ERR_NOMEM;
    if (j.part_o != NULL && j.part_mx != NULL && j.part_sum != NULL && A != NULL) {
        dd_pool_for(decode_block, &j, n_kv * j.n_blocks);
        for (size_t head = 0; head < n_head; head++) {
            const size_t kvh = head / j.group, g = head % j.group;
            double M = 0.0, L = 0.0;
            for (size_t b = 0; b < j.n_blocks; b++) {
                const size_t part = (kvh * j.n_blocks + b) * j.group + g;
                merge_block(&M, &L, A, j.part_mx[part], j.part_sum[part], j.part_o + part * hd, hd, b == 0);
            }
            finish_row(A, L, gate + head * hd, hd, out + head * hd);
        }
        rc = DD_OK;
    }
    free(j.part_o);
    free(j.part_mx);
    free(j.part_sum);
    free(A);
    return rc;
}

/* ---- prefill: n queries, jobs of (kv head, tile of positions), every block of a tile in order -- */

#define TILE 16   /* query positions per job */

typedef struct {
    size_t n_head, n_kv, hd, group, m, n, row, n_tiles;
    const float *q, *gate, *k, *v;
    float *out;
    float scale;
    int failed;
} prefill_job;

static void prefill_tile(void *ctx, size_t chunk)
{
    prefill_job *j = ctx;
    const size_t kvh = chunk / j->n_tiles, i0 = chunk % j->n_tiles * TILE, hd = j->hd, G = j->group;
    const size_t i1 = i0 + TILE < j->n ? i0 + TILE : j->n, rows = (i1 - i0) * G, pos0 = j->m - j->n + i0;
    double *A = malloc(rows * (hd + 2) * sizeof(double));
    float *buf = malloc(MAX_ROWS * (BLOCK + hd) * sizeof(float));
    if (A == NULL || buf == NULL) {
        free(A);
        free(buf);
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    double *ML = A + rows * hd;   /* per row: M, L */
    const float *q[MAX_ROWS];
    float *s[MAX_ROWS], *o[MAX_ROWS];
    size_t len[MAX_ROWS];
    for (size_t x = 0; x < MAX_ROWS; x++) {
        s[x] = buf + x * BLOCK;
        o[x] = buf + MAX_ROWS * BLOCK + x * hd;
    }
    /* rows r = (i - i0) * G + g in position order; block b is seen by the rows at positions >= b * BLOCK */
    for (size_t b = 0; b * BLOCK < pos0 + (i1 - i0); b++) {
        const size_t t0 = b * BLOCK, first = t0 > pos0 ? (t0 - pos0) * G : 0;
        const float *kb = j->k + t0 * j->row + kvh * hd, *vb = j->v + t0 * j->row + kvh * hd;
        for (size_t r = first; r < rows; r += MAX_ROWS) {
            const size_t R = rows - r < MAX_ROWS ? rows - r : MAX_ROWS;
            size_t keys = 0;
            for (size_t x = 0; x < R; x++) {
                const size_t i = i0 + (r + x) / G, g = (r + x) % G, seen = pos0 + (i - i0) + 1 - t0;
                q[x] = j->q + (i * j->n_head + kvh * G + g) * hd;
                len[x] = seen < BLOCK ? seen : BLOCK;
                keys = len[x] > keys ? len[x] : keys;
            }
            scores_rows(R, q, kb, j->row, keys, hd, j->scale, s);
            float mx[MAX_ROWS];
            double sum[MAX_ROWS];
            for (size_t x = 0; x < R; x++) {
                mx[x] = softmax_block(s[x], len[x], &sum[x]);
                for (size_t t = len[x]; t < keys; t++)
                    s[x][t] = 0.0f;   /* rows of earlier positions: the later keys weigh +0 */
            }
            pv_rows(R, (const float *const *)s, vb, j->row, keys, hd, o);
            for (size_t x = 0; x < R; x++)
                merge_block(&ML[2 * (r + x)], &ML[2 * (r + x) + 1], A + (r + x) * hd, mx[x], sum[x], o[x], hd, b == 0);
        }
    }
    for (size_t r = 0; r < rows; r++) {
        const size_t i = i0 + r / G, head = kvh * G + r % G;
        finish_row(A + r * hd, ML[2 * r + 1], j->gate + (i * j->n_head + head) * hd, hd,
                   j->out + (i * j->n_head + head) * hd);
    }
    free(A);
    free(buf);
}

int ATTN_FN(attn_prefill)(size_t n_head, size_t n_kv, size_t hd, size_t n, const float *q, const float *gate,
                          const float *k, const float *v, size_t m, float *out)
{
    prefill_job j = { .n_head = n_head, .n_kv = n_kv, .hd = hd, .group = n_head / n_kv, .m = m, .n = n,
                      .row = n_kv * hd, .n_tiles = dd_div_up(n, TILE), .q = q, .gate = gate, .k = k, .v = v,
                      .out = out, .scale = (float)(1.0 / sqrt((double)hd)), .failed = 0 };
    dd_pool_for(prefill_tile, &j, n_kv * j.n_tiles);
    return j.failed ? DD_ERR_NOMEM : DD_OK;
}
