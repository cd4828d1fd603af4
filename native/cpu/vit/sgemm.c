/* The float32 GEMM's portable half (deltadesk_cpu.h dd_sgemm, dd_vit_attention): weight packing, argument
 * checks and the dispatch to the AVX-512 kernels (sgemm_avx512.c, vit_attention_avx512.c). There is no
 * portable kernel: without AVX-512 the entry points return DD_ERR_ISA and the caller keeps its own float32
 * path (numpy's BLAS). */
#include "runtime.h"

#ifdef DD_X86_ISAS
int sgemm_avx512(const float *x, size_t ldx, size_t m, size_t k, const float *packed, size_t n,
                 const float *bias, int act, const float *add, size_t ld_add, float *out, size_t ldo, int threads);
int sgemm_act_avx512(int act, const float *x, size_t n, float *y);
int vit_attention_avx512(const float *qkv, size_t ldq, const size_t *starts, size_t n_piece, size_t n_head,
                         size_t hd, float *out, size_t ldo, int threads);
int vit_layer_norm_avx512(const float *x, size_t ldx, size_t m, size_t d, const float *w, const float *b, float eps,
                          float *out, size_t ldo, int threads);
#endif

size_t dd_sgemm_packed_floats(size_t n, size_t k)
{
    return dd_div_up(n, DD_SGEMM_NR) * DD_SGEMM_NR * k;
}

/* Value i of a row of type dtype as float32 (exact). Inlined with a constant dtype in pack_panel. */
static inline float pack_load(const void *row, int dtype, size_t i)
{
    if (dtype == DD_DTYPE_F16)
        return dd_f16_to_f32(((const uint16_t *)row)[i]);
    if (dtype == DD_DTYPE_BF16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)row)[i] << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    return ((const float *)row)[i];
}

static inline size_t dtype_size(int dtype)
{
    return dtype == DD_DTYPE_F32 ? 4 : 2;
}

/* One pack job: the weight rows [row0, row0 + rows) of an (n, k) weight into its panels. */
typedef struct {
    const char *w;
    int dtype;
    size_t ldw, rows, k, row0, n, first;   /* first: the first panel's first column (row0 rounded down to NR) */
    float *packed;
} pack_job;

/* The panel at columns [j0, j0 + NR) of a pack job, for one dtype (a constant after inlining): k by k, so the
 * writes are in order and the panel's (at most) 32 source rows stay in L1. */
static inline void pack_panel(const pack_job *p, int dtype, size_t j0)
{
    const size_t end = p->row0 + p->rows, pitch = p->ldw * dtype_size(dtype), k = p->k;
    float *panel = p->packed + j0 * k;
    const size_t c0 = p->row0 > j0 ? p->row0 - j0 : 0, c1 = end - j0 < DD_SGEMM_NR ? end - j0 : DD_SGEMM_NR;
    const size_t pad = end == p->n ? DD_SGEMM_NR : c1;   /* the last rows' call zeroes columns past n */
    const char *src = p->w + (j0 + c0 - p->row0) * pitch;
    for (size_t kk = 0; kk < k; kk++) {
        for (size_t c = c0; c < c1; c++)
            panel[kk * DD_SGEMM_NR + c] = pack_load(src + (c - c0) * pitch, dtype, kk);
        for (size_t c = c1; c < pad; c++)
            panel[kk * DD_SGEMM_NR + c] = 0.0f;
    }
}

/* Pool chunk i: the job's i-th panel. Panels are disjoint memory and a copy has one result, so the packed
 * buffer is the same whichever thread packs a panel (a tower's 2.2 GB of panels is seconds of one core). */
static void pack_chunk(void *ctx, size_t i)
{
    const pack_job *p = ctx;
    const size_t j0 = p->first + i * DD_SGEMM_NR;
    if (p->dtype == DD_DTYPE_F32)
        pack_panel(p, DD_DTYPE_F32, j0);
    else if (p->dtype == DD_DTYPE_F16)
        pack_panel(p, DD_DTYPE_F16, j0);
    else
        pack_panel(p, DD_DTYPE_BF16, j0);
}

int dd_sgemm_pack_rows(const void *w, int dtype, size_t ldw, size_t rows, size_t k, size_t row0, size_t n,
                       float *packed)
{
    if (rows == 0 || k == 0 || ldw < k || row0 > n || rows > n - row0)
        return DD_ERR_ARG;
    if (dtype != DD_DTYPE_F32 && dtype != DD_DTYPE_F16 && dtype != DD_DTYPE_BF16)
        return DD_ERR_ARG;
    pack_job p = { .w = w, .dtype = dtype, .ldw = ldw, .rows = rows, .k = k, .row0 = row0, .n = n,
                   .first = row0 - row0 % DD_SGEMM_NR, .packed = packed };
    dd_pool_for(pack_chunk, &p, dd_div_up(row0 + rows - p.first, DD_SGEMM_NR));
    return DD_OK;
}

int dd_sgemm_supported(void)
{
#ifdef DD_X86_ISAS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
#else
    return 0;
#endif
}

static int sgemm_level_ok(int act)
{
    if (act != DD_ACT_NONE && act != DD_ACT_GELU_TANH && act != DD_ACT_GELU_ERF)
        return DD_ERR_ARG;
    return dd_sgemm_supported() ? DD_OK : DD_ERR_ISA;
}

int dd_sgemm(const float *x, size_t ldx, size_t m, size_t k, const float *packed, size_t n, const float *bias,
             int act, const float *add, size_t ld_add, float *out, size_t ldo, int threads)
{
    const int rc = sgemm_level_ok(act);
    if (rc != DD_OK)
        return rc;
    if (k == 0 || ldx < k || ldo < n || (add != NULL && ld_add < n))
        return DD_ERR_ARG;
    if (m == 0 || n == 0)
        return DD_OK;
#ifdef DD_X86_ISAS
    return sgemm_avx512(x, ldx, m, k, packed, n, bias, act, add, ld_add, out, ldo, threads);
#else
    return DD_ERR_ISA;
#endif
}

int dd_sgemm_act(int act, const float *x, size_t n, float *y)
{
    const int rc = sgemm_level_ok(act);
    if (rc != DD_OK)
        return rc;
#ifdef DD_X86_ISAS
    return sgemm_act_avx512(act, x, n, y);
#else
    return DD_ERR_ISA;
#endif
}

int dd_vit_attention(const float *qkv, size_t ldq, const size_t *starts, size_t n_piece, size_t n_head, size_t hd,
                     float *out, size_t ldo, int threads)
{
    const int rc = sgemm_level_ok(DD_ACT_NONE);
    if (rc != DD_OK)
        return rc;
    if (hd == 0 || hd > 256 || n_head == 0 || ldq < 3 * n_head * hd || ldo < n_head * hd || starts[0] != 0)
        return DD_ERR_ARG;
    for (size_t p = 0; p < n_piece; p++)
        if (starts[p + 1] < starts[p])
            return DD_ERR_ARG;
#ifdef DD_X86_ISAS
    return vit_attention_avx512(qkv, ldq, starts, n_piece, n_head, hd, out, ldo, threads);
#else
    return DD_ERR_ISA;
#endif
}

int dd_vit_layer_norm(const float *x, size_t ldx, size_t m, size_t d, const float *w, const float *b, float eps,
                      float *out, size_t ldo, int threads)
{
    const int rc = sgemm_level_ok(DD_ACT_NONE);
    if (rc != DD_OK)
        return rc;
    if (d == 0 || ldx < d || ldo < d || !(eps >= 0.0f))
        return DD_ERR_ARG;
    if (m == 0)
        return DD_OK;
#ifdef DD_X86_ISAS
    return vit_layer_norm_avx512(x, ldx, m, d, w, b, eps, out, ldo, threads);
#else
    return DD_ERR_ISA;
#endif
}
