/* The products of prepared activations: dd_matmul (deltadesk_cpu.h), dd_matvec_set (runtime.h), several
 * products of one input vector in one pool job, and dd_scratch, the per-thread buffers that decode and the
 * tower's GEMM and attention reuse call after call. The activations come from dispatch.c.
 *
 * Why one job: a decode token's products are small (a GDN layer's beta and alpha are 32 rows, 2
 * chunks), and each separate product pays the activation preparation on the calling thread while the
 * other threads wait, a pool dispatch, and the tail where one thread finishes the last chunk alone.
 * Products that read the same vector (a GDN layer's qkv, z, beta, alpha; attention's q, k, v; the dense
 * FFN's gate and up) share one preparation and one job, whose chunks are each product's chunks in turn.
 *
 * Why the bits do not change: the activations are the bytes dd_matmul prepares for that vector, and
 * product i is cut into the chunks dd_matmul cuts it into (dd_chunk_rows of its row size, from its row
 * 0), each run by the same kernel call with the same rows and the same rows_avail; a chunk's result
 * depends only on its rows, never on the thread or the order. dd_matmul_set does the same for m columns
 * (batched decode's N rows, a prompt's projections of one input: dd_matmul_many): the columns prepared once,
 * each product cut as dd_matmul cuts an m-column product (dd_gemm_chunk_rows), each chunk the same kernel call.
 */
#include <pthread.h>
#include <stdlib.h>

#include "runtime.h"

typedef struct {
    void *p[DD_SCRATCH_COUNT];
    size_t bytes[DD_SCRATCH_COUNT];
} scratch_set;

static pthread_key_t scratch_key;
static int scratch_key_ok;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_release(void *v)
{
    scratch_set *s = v;
    for (int i = 0; i < DD_SCRATCH_COUNT; i++)
        free(s->p[i]);
    free(s);
}

static void scratch_init(void)
{
    scratch_key_ok = pthread_key_create(&scratch_key, scratch_release) == 0;
}

void *dd_scratch(int slot, size_t bytes)
{
    pthread_once(&scratch_once, scratch_init);
    if (!scratch_key_ok || slot < 0 || slot >= DD_SCRATCH_COUNT)
        return NULL;
    scratch_set *s = pthread_getspecific(scratch_key);
    if (s == NULL) {
        s = calloc(1, sizeof *s);
        if (s == NULL || pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (s->bytes[slot] < bytes) {
        const size_t n = (bytes + bytes / 4 + 63) & ~(size_t)63;   /* a little room: shapes vary by layer */
        free(s->p[slot]);
        s->p[slot] = aligned_alloc(64, n);
        s->bytes[slot] = s->p[slot] != NULL ? n : 0;
        if (s->p[slot] != NULL)
            memset(s->p[slot], 0, n);
    }
    return s->p[slot];
}

typedef struct {
    const dd_kernels *kt;
    const dd_matvec_out *p;
    size_t k;
    size_t first[DD_MATVEC_SET_MAX + 1];   /* product i's chunks are [first[i], first[i + 1]) */
    size_t chunk_rows[DD_MATVEC_SET_MAX];
    const dd_acts *acts;
} set_job;

static void set_chunk(void *ctx, size_t chunk)
{
    const set_job *j = ctx;
    size_t i = 0;
    while (chunk >= j->first[i + 1])
        i++;
    const dd_matvec_out *p = &j->p[i];
    const size_t rb = dd_row_bytes(p->wtype, j->k), r0 = (chunk - j->first[i]) * j->chunk_rows[i];
    const size_t n = p->rows - r0 < j->chunk_rows[i] ? p->rows - r0 : j->chunk_rows[i];
    j->kt->gemm[p->wtype](p->w + r0 * rb, rb, n, p->rows - r0, j->acts, p->y + r0, p->rows);
}

#define DD_SCRATCH_ACTS_COLS 8   /* columns up to which dd_matmul_set prepares in the thread's scratch */

int dd_matmul_set(int isa, const dd_matvec_out *p, size_t n, size_t k, const float *x, size_t m)
{
    const dd_kernels *kt = dd_kernels_for(isa);
    if (kt == NULL)
        return DD_ERR_ISA;
    if (n > DD_MATVEC_SET_MAX || k == 0 || k % DD_QK != 0 || m == 0)
        return DD_ERR_ARG;
    set_job job = { .kt = kt, .p = p, .k = k };
    for (size_t i = 0; i < n; i++) {
        if (!dd_wtype_fits(p[i].wtype, k))
            return DD_ERR_ARG;
        job.chunk_rows[i] = dd_gemm_chunk_rows(dd_row_bytes(p[i].wtype, k), m);
        job.first[i + 1] = job.first[i] + dd_div_up(p[i].rows, job.chunk_rows[i]);
    }
    /* a batched decode step's few columns in the thread's reused scratch; a prompt's in memory of its own, so
     * the scratch does not keep a prompt-sized buffer for the thread's lifetime */
    const size_t bytes = dd_acts_bytes(kt, m, k);
    void *mem = m <= DD_SCRATCH_ACTS_COLS ? dd_scratch(DD_SCRATCH_ACTS, bytes) : aligned_alloc(64, bytes);
    if (mem == NULL)
        return DD_ERR_NOMEM;
    dd_acts acts;
    dd_acts_prepare_pooled(kt, x, m, k, mem, &acts);
    job.acts = &acts;
    dd_pool_for(set_chunk, &job, job.first[n]);
    if (m > DD_SCRATCH_ACTS_COLS)
        free(mem);
    return DD_OK;
}

int dd_matvec_set(int isa, const dd_matvec_out *p, size_t n, size_t k, const float *x)
{
    return dd_matmul_set(isa, p, n, k, x, 1);
}

int dd_matmul_many(int isa, size_t n, const int *wtypes, const uint8_t *const *w, const size_t *rows, size_t k,
                   const float *x, size_t m, float *const *y)
{
    if (n == 0 || n > DD_MATVEC_SET_MAX || m == 0)
        return DD_ERR_ARG;
    dd_matvec_out p[DD_MATVEC_SET_MAX];
    for (size_t i = 0; i < n; i++)
        p[i] = (dd_matvec_out){ .wtype = wtypes[i], .w = w[i], .rows = rows[i], .y = y[i] };
    return dd_matmul_set(isa, p, n, k, x, m);
}

typedef struct {
    dd_gemm_fn gemm;
    const uint8_t *w;
    size_t row_bytes, rows, chunk_rows;
    const dd_acts *acts;
    float *y;
} matmul_job;

static void matmul_chunk(void *ctx, size_t chunk)
{
    const matmul_job *j = ctx;
    const size_t r0 = chunk * j->chunk_rows;
    const size_t n = j->rows - r0 < j->chunk_rows ? j->rows - r0 : j->chunk_rows;
    j->gemm(j->w + r0 * j->row_bytes, j->row_bytes, n, j->rows - r0, j->acts, j->y + r0, j->rows);
}

int dd_matmul(int isa, int wtype, const uint8_t *w, size_t rows, size_t k, const float *x, size_t m, float *y)
{
    const dd_kernels *kt = dd_kernels_for(isa);
    if (kt == NULL)
        return DD_ERR_ISA;
    if (k % DD_QK != 0 || !dd_wtype_fits(wtype, k))
        return DD_ERR_ARG;
    if (rows == 0 || m == 0 || k == 0) {
        for (size_t i = 0; i < rows * m; i++)
            y[i] = 0.0f;
        return DD_OK;
    }
    if (m == 1) {
        const dd_matvec_out one = { .wtype = wtype, .w = w, .rows = rows, .y = y };
        return dd_matvec_set(isa, &one, 1, k, x);
    }
    dd_acts acts;
    const int rc = dd_acts_new_pooled(kt, x, m, k, &acts);
    if (rc != DD_OK)
        return rc;
    const size_t row_bytes = dd_row_bytes(wtype, k);
    matmul_job job = {
        .gemm = kt->gemm[wtype], .w = w, .row_bytes = row_bytes, .rows = rows,
        .chunk_rows = dd_gemm_chunk_rows(row_bytes, m), .acts = &acts, .y = y,
    };
    dd_pool_for(matmul_chunk, &job, dd_div_up(rows, job.chunk_rows));
    dd_acts_free(&acts);
    return DD_OK;
}
