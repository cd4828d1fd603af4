/* Causal gated GQA attention over the KV cache, for one query (decode) or many (prefill): the
 * kernel body, compiled once per ISA level. attention.c includes it for the portable build,
 * attention_avx2.c and attention_avx512.c with their own -m flags; ATTN_SUFFIX names the copy.
 *
 * Arithmetic (the same at every level and for every split; deltadesk_cpu.h dd_attn_prefill): the
 * cache is cut into blocks of DD_ATTN_BLOCK positions at absolute positions (block b holds rows
 * [b*256, b*256 + 256)). For one query row (a q head at cache position p) and each block it sees:
 *   s_t  = dot(q, k_t) * (1/sqrt(hd)), float: DD_ATTN_LANES partial sums, lane l fused-multiply-
 *          adding q[i] k_t[i] for i = l, l+16, ... in order, then the lanes in float by a fixed
 *          tree (l + l+8, + l+4, + l+2, + l+1);
 *   mx   = max_t s_t;  p_t = attn_exp(s_t - mx), float (a float polynomial, attn_exp's comment);
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
 * Speed: decode splits the blocks over the pool, one query row at a time; prefill (attn_prefill.h)
 * runs jobs of (kv head, 16 to 64 positions) that copy each block's k and v rows into an aligned
 * scratch once and take the job's rows through it in sets of 8, with the scores, the softmax and the
 * weighted sums vectorised across the set, so each key and value row read serves 8 rows.
 * The AVX2 build (16 ymm registers) takes its inner loops from attn_avx2.h and attn_prefill_avx2.h:
 * the same operations in the same order, in register-sized pieces.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include "runtime.h"

#pragma GCC diagnostic ignored "-Wpsabi"   /* 64-byte vectors in inlined helpers only, no ABI crossing */

#define ATTN_CAT2(a, b) a##_##b
#define ATTN_CAT(a, b) ATTN_CAT2(a, b)
#define ATTN_FN(name) ATTN_CAT(name, ATTN_SUFFIX)

#define AI static inline __attribute__((always_inline))
/* The AVX2 build: its inner loops shaped for 16 ymm registers (attn_avx2.h, attn_prefill_avx2.h). */
#if defined(__FMA__) && !defined(__AVX512F__)
#define ATTN_AVX2 1
#else
#define ATTN_AVX2 0
#endif
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

/* a * b + c rounded once, lane by lane: the FMA instruction with AVX-512, else libm's fmaf (exact
 * too, in software on a CPU without FMA), so every build gives the same bits. (The AVX2 build's loops
 * call _mm256_fmadd_ps themselves.) */
#if defined(__AVX512F__)
AI vf vfma(vf a, vf b, vf c)
{
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
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

/* Float -> double of vector halves (exact). With AVX-512 the instructions are named: GCC's generic
 * lowering of these conversions goes through 128-bit pieces, four shuffles per half, which cost more
 * than the softmax's double additions they feed. */
#if defined(__AVX512F__)
AI vd lo_d(vf a)
{
    return (vd)_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)a));
}

AI vd hi_d(vf a)
{
    return (vd)_mm512_cvtps_pd((__m256)_mm512_extractf64x4_pd((__m512d)a, 1));
}
#else
AI vd lo_d(vf a)
{
    return __builtin_convertvector(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7), vd);
}

AI vd hi_d(vf a)
{
    return __builtin_convertvector(__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15), vd);
}
#endif

/* The dot's lane tree of one partial-sum vector, in float: (l + l+8), then + l+4, + l+2, + l+1. */
AI float tree16(vf a)
{
    float s[8], t[4];
    for (int l = 0; l < 8; l++)
        s[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++)
        t[l] = s[l] + s[l + 4];
    return (t[0] + t[2]) + (t[1] + t[3]);
}

/* tree16 of 16 partial-sum vectors at once (the same additions, paired across vectors by
 * two-source shuffles): lane j of the result is tree16(a[j]). */
AI vf tree16x16(const vf *a)
{
    vf c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)   /* c[i]: a[2i]'s (l + l+8) in lanes 0-7, a[2i+1]'s in 8-15 */
        c[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int i = 0; i < 4; i++)   /* d[i]: + l+4, four dots of 4 lanes */
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++)   /* e[i]: + l+2, eight dots of 2 lanes */
        e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* e^x in float for a vector V of floats (VI: its int lanes) and x <= 0, 0 below -87 (e^-87 < 2^-125,
 * below any sum it would join) and for NaN: x = n ln2 + r with n = round(x log2e) (by adding and
 * subtracting 1.5 * 2^23, exact in round-to-nearest for |n| < 2^22), ln2 in two parts (Cody and Waite:
 * 0.693359375 has 9 significant bits, so n * it is exact for |n| <= 2^15) and |r| <= ln2/2 + 2^-24;
 * the Taylor series of e^r to degree 7 by Horner (truncation r^8/8! < 5.2e-9 < 0.1 ulp of e^r), times
 * 2^n from the exponent bits (n >= -126: a normal float). Every step an IEEE float + - or * (contraction
 * off, build.py), so each build gives the same bits; within 1.22 ulp of e^x (every float in [-87, 0]
 * checked against libm's double exp), e^0 = 1 exactly. The tower's sg_exp (sgemm_kernel.h) is the same
 * reduction with fused multiply-adds and AVX-512 only: its bits may differ by level, these may not. */
#define ATTN_DEFINE_EXP(NAME, V, VI)                                                                          \
    AI V NAME(V x)                                                                                            \
    {                                                                                                         \
        const V zero = { 0 }, magic = zero + 12582912.0f;                                                     \
        const VI live = x >= zero - 87.0f;                                                                    \
        x = (V)((VI)x & live);                                                                                \
        const V t = x * 1.44269504088896341f + magic;                                                         \
        const V n = t - magic;                                                                                \
        const V r = (x - n * 0.693359375f) - n * -2.12194440e-4f;                                             \
        V y = zero + 1.0f / 5040.0f;                                                                          \
        y = y * r + 1.0f / 720.0f;                                                                            \
        y = y * r + 1.0f / 120.0f;                                                                            \
        y = y * r + 1.0f / 24.0f;                                                                             \
        y = y * r + 1.0f / 6.0f;                                                                              \
        y = y * r + 0.5f;                                                                                     \
        y = y * r + 1.0f;                                                                                     \
        y = y * r + 1.0f;                                                                                     \
        return (V)((VI)(y * (V)(((VI)t - (VI)magic + 127) << 23)) & live);                                    \
    }

/* e^x of LANES floats for x <= 0 (the softmax's p_t). */
ATTN_DEFINE_EXP(attn_exp, vf, vi)

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

/* Bytes of n cache elements of kv_type (Q8_0: n a multiple of DD_Q8_BLOCK, DD_Q8_BYTES per block). */
static size_t kv_bytes(int kv_type, size_t n)
{
    return kv_type == DD_KV_Q8_0 ? n / DD_Q8_BLOCK * DD_Q8_BYTES : n * (kv_type == DD_KV_F16 ? 2 : 4);
}

/* One Q8_0 row of hd values -> d[hd] floats: d * q per block, exact (a half's 11 significant bits times
 * an int8's 8 fit a float), so the vectorised and scalar forms of this loop give the same values. */
static void widen_q8_0(float *d, const uint8_t *src, size_t hd)
{
    for (size_t b = 0; b < hd / DD_Q8_BLOCK; b++) {
        const uint8_t *blk = src + b * DD_Q8_BYTES;
        const float scale = dd_f16_to_f32((uint16_t)(blk[0] | blk[1] << 8));
        const int8_t *q = (const int8_t *)(blk + 2);
        for (size_t i = 0; i < DD_Q8_BLOCK; i++)
            d[b * DD_Q8_BLOCK + i] = scale * (float)q[i];
    }
}

/* len cache rows of hd elements of kv_type, src_row elements apart -> dst, hd floats per row, contiguous.
 * Halves are widened exactly (vcvtph2ps with AVX-512 or F16C, else dd_f16_to_f32: the same values), Q8_0
 * blocks by widen_q8_0. */
static void pack_rows_kv(float *dst, const void *src, int kv_type, size_t src_row, size_t len, size_t hd)
{
    if (kv_type == DD_KV_F32) {
        for (size_t t = 0; t < len; t++)
            memcpy(dst + t * hd, (const float *)src + t * src_row, hd * sizeof(float));
        return;
    }
    if (kv_type == DD_KV_Q8_0) {
        for (size_t t = 0; t < len; t++)
            widen_q8_0(dst + t * hd, (const uint8_t *)src + kv_bytes(kv_type, t * src_row), hd);
        return;
    }
    for (size_t t = 0; t < len; t++) {
        const uint16_t *h = (const uint16_t *)src + t * src_row;
        float *d = dst + t * hd;
#if defined(__AVX512F__)
        for (size_t i = 0; i < hd; i += 16)
            _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#elif defined(__F16C__)
        for (size_t i = 0; i < hd; i += 8)
            _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#else
        for (size_t i = 0; i < hd; i++)
            d[i] = dd_f16_to_f32(h[i]);
#endif
    }
}

#if ATTN_AVX2
#include "attn_avx2.h"
#else
/* o[hd] = sum_{t < len} p[t] v_t (float, t in order, one rounding per term), v_t = v + t * vrow;
 * 32 head dims at a time. */
static void pv_row(const float *p, const float *v, size_t vrow, size_t len, size_t hd, float *o)
{
    for (size_t c = 0; c < hd; c += 2 * LANES) {
        const size_t nv = hd - c < 2 * LANES ? 1 : 2;
        vf acc[2] = { { 0 }, { 0 } };
        for (size_t t = 0; t < len; t++)
            for (size_t x = 0; x < nv; x++)
                acc[x] = vfma(splat(p[t]), ld(v + t * vrow + c + x * LANES), acc[x]);
        for (size_t x = 0; x < nv; x++)
            st(o + c + x * LANES, acc[x]);
    }
}

/* Scaled scores s[t] of q against keys t = 0..len-1 (k_t = k + t * krow). */
static void scores_row(const float *q, const float *k, size_t krow, size_t len, size_t hd, float scale, float *s)
{
    for (size_t t = 0; t < len; t++) {
        vf acc = { 0 };
        for (size_t i = 0; i < hd; i += LANES)
            acc = vfma(ld(q + i), ld(k + t * krow + i), acc);
        s[t] = tree16(acc) * scale;
    }
}
#endif

/* ---- decode: one query, the blocks split over the pool, merged in block order --------------- */

typedef struct {
    size_t n_kv, hd, group, m, row, n_blocks;
    const float *q;
    const void *k, *v;  /* m rows of `row` elements of kv_type */
    int kv_type;
    float *part_o;      /* [kv head][block][group][hd] */
    float *part_mx;     /* [kv head][block][group] */
    double *part_sum;   /* [kv head][block][group] */
    float scale;
    int failed;         /* set by a block whose scratch could not be allocated */
} decode_job;

/* A thread's float copy of one block's k and v rows of one kv head (a half cache's rows widened): grown to
 * the largest block seen, kept while the thread lives and freed when it exits (a thread-specific key with
 * free as its destructor, so a short-lived caller thread leaks nothing); NULL if out of memory. */
typedef struct {
    size_t have;
    float data[];
} decode_buf;

static pthread_key_t decode_key;
static pthread_once_t decode_once = PTHREAD_ONCE_INIT;
static int decode_key_ok;

static void decode_key_init(void)
{
    decode_key_ok = pthread_key_create(&decode_key, free) == 0;
}

static float *decode_scratch(size_t floats)
{
    pthread_once(&decode_once, decode_key_init);
    if (!decode_key_ok)
        return NULL;
    decode_buf *b = pthread_getspecific(decode_key);
    if (b == NULL || b->have < floats) {
        decode_buf *grown = realloc(b, sizeof(decode_buf) + floats * sizeof(float));
        if (grown == NULL)
            return NULL;   /* b is untouched and still the thread's */
        /* setspecific can fail only when the thread's slot is first made, i.e. with b == NULL */
        if (pthread_setspecific(decode_key, grown) != 0) {
            free(grown);
            return NULL;
        }
        grown->have = floats;
        b = grown;
    }
    return b->data;
}

static void decode_block(void *ctx, size_t chunk)
{
    decode_job *j = ctx;
    const size_t kvh = chunk / j->n_blocks, blk = chunk % j->n_blocks, hd = j->hd;
    const size_t t0 = blk * BLOCK, len = (t0 + BLOCK < j->m ? t0 + BLOCK : j->m) - t0;
    const size_t off = kv_bytes(j->kv_type, t0 * j->row + kvh * hd);
    const char *kb = (const char *)j->k + off, *vb = (const char *)j->v + off;
    const float *k = (const float *)kb, *v = (const float *)vb;
    size_t row = j->row;
    if (j->kv_type != DD_KV_F32) {
        float *w = decode_scratch(2 * BLOCK * hd);
        if (w == NULL) {
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
            return;
        }
        pack_rows_kv(w, kb, j->kv_type, j->row, len, hd);
        pack_rows_kv(w + BLOCK * hd, vb, j->kv_type, j->row, len, hd);
        k = w;
        v = w + BLOCK * hd;
        row = hd;
    }
    float s[BLOCK];
    for (size_t g = 0; g < j->group; g++) {
        const size_t part = (kvh * j->n_blocks + blk) * j->group + g;
        const float *qg = j->q + (kvh * j->group + g) * hd;
        float *o = j->part_o + part * hd;
        scores_row(qg, k, row, len, hd, j->scale, s);
        j->part_mx[part] = softmax_block(s, len, &j->part_sum[part]);
        pv_row(s, v, row, len, hd, o);
    }
}

int ATTN_FN(attn_decode_kv)(size_t n_head, size_t n_kv, size_t hd, const float *q, const float *gate, int kv_type,
                            const void *k, const void *v, size_t m, float *out)
{
    decode_job j = { .n_kv = n_kv, .hd = hd, .group = n_head / n_kv, .m = m, .row = n_kv * hd,
                     .n_blocks = dd_div_up(m, BLOCK), .q = q, .k = k, .v = v, .kv_type = kv_type,
                     .scale = (float)(1.0 / sqrt((double)hd)), .failed = 0 };
    const size_t parts = n_kv * j.n_blocks * j.group;
    j.part_o = malloc(parts * hd * sizeof(float));
    j.part_mx = malloc(parts * sizeof(float));
    j.part_sum = malloc(parts * sizeof(double));
    double *A = malloc(hd * sizeof(double));
    int rc = DD_ERR_NOMEM;
    if (j.part_o != NULL && j.part_mx != NULL && j.part_sum != NULL && A != NULL) {
        dd_pool_for(decode_block, &j, n_kv * j.n_blocks);
        for (size_t head = 0; head < n_head && !j.failed; head++) {
            const size_t kvh = head / j.group, g = head % j.group;
            double M = 0.0, L = 0.0;
            for (size_t b = 0; b < j.n_blocks; b++) {
                const size_t part = (kvh * j.n_blocks + b) * j.group + g;
                merge_block(&M, &L, A, j.part_mx[part], j.part_sum[part], j.part_o + part * hd, hd, b == 0);
            }
            finish_row(A, L, gate + head * hd, hd, out + head * hd);
        }
        rc = j.failed ? DD_ERR_NOMEM : DD_OK;
    }
    free(j.part_o);
    free(j.part_mx);
    free(j.part_sum);
    free(A);
    return rc;
}

int ATTN_FN(attn_decode)(size_t n_head, size_t n_kv, size_t hd, const float *q, const float *gate,
                         const float *k, const float *v, size_t m, float *out)
{
    return ATTN_FN(attn_decode_kv)(n_head, n_kv, hd, q, gate, DD_KV_F32, k, v, m, out);
}

#include "attn_prefill.h"
