/* The 8-row interleaved Q4_0 layout (deltadesk_cpu.h, dd_q4_0_interleave): the repack in place, its inverse,
 * and the GEMV over it, cut into pool chunks of whole stripes.
 *
 * The repack moves the bytes of one stripe (8 rows) at a time through a scratch of the stripe's size, so it
 * needs no second copy of the matrix; rows past the last multiple of 8 are left as they are. The GEMV runs
 * the level's gemv_q4_0_il on the stripes and the row-major Q4_0 kernel on those last rows; a row's result
 * depends only on its bytes and the activations, never on the chunk it falls in.
 */
#include <stdlib.h>

#include "runtime.h"

#define IL_BLOCK (8 * DD_Q4_0_BYTES)

/* Row r's block b (18 bytes at rm, row-major) <-> its 2 + 4 x 4 bytes in the interleaved stripe p. */
static void il_move(uint8_t *p, uint8_t *rm, size_t b, size_t r, int to_il)
{
    uint8_t *blk = p + b * IL_BLOCK;
    uint8_t *dst = to_il ? blk + 2 * r : rm, *src = to_il ? rm : blk + 2 * r;
    memcpy(dst, src, 2);
    for (size_t q = 0; q < 4; q++) {
        uint8_t *at = blk + 16 + 32 * q + 4 * r, *run = rm + 2 + 4 * q;
        memcpy(to_il ? at : run, to_il ? run : at, 4);
    }
}

/* Every stripe of w through a scratch: to_il 1 rewrites row-major as interleaved, 0 the reverse. */
static int il_permute(uint8_t *w, size_t nrows, size_t row_bytes, int to_il)
{
    if (row_bytes == 0 || row_bytes % DD_Q4_0_BYTES != 0)
        return DD_ERR_ARG;
    const size_t stripe = 8 * row_bytes, nb = row_bytes / DD_Q4_0_BYTES;
    if (nrows < 8)
        return DD_OK;
    uint8_t *tmp = malloc(stripe);
    if (tmp == NULL)
        return DD_ERR_NOMEM;
    for (size_t s = 0; s < nrows / 8; s++) {
        uint8_t *p = w + s * stripe;
        memcpy(tmp, p, stripe);
        uint8_t *il = to_il ? p : tmp, *rows = to_il ? tmp : p;
        for (size_t r = 0; r < 8; r++)
            for (size_t b = 0; b < nb; b++)
                il_move(il, rows + r * row_bytes + b * DD_Q4_0_BYTES, b, r, to_il);
    }
    free(tmp);
    return DD_OK;
}

int dd_q4_0_interleave(uint8_t *w, size_t nrows, size_t row_bytes)
{
    return il_permute(w, nrows, row_bytes, 1);
}

int dd_q4_0_deinterleave(uint8_t *w, size_t nrows, size_t row_bytes)
{
    return il_permute(w, nrows, row_bytes, 0);
}

typedef struct {
    const dd_kernels *kt;
    const uint8_t *w;
    size_t row_bytes, rows, stripes, chunk_stripes, il_chunks;
    const dd_acts *acts;
    float *y;
} il_job;

/* Chunk c < il_chunks: chunk_stripes stripes; the one after them: the rows % 8 row-major rows. */
static void il_chunk(void *ctx, size_t c)
{
    const il_job *j = ctx;
    if (c == j->il_chunks) {
        const size_t r0 = 8 * j->stripes;
        j->kt->gemm[DD_Q4_0](j->w + r0 * j->row_bytes, j->row_bytes, j->rows - r0, j->rows - r0, j->acts,
                             j->y + r0, j->rows);
        return;
    }
    const size_t s0 = c * j->chunk_stripes, n = dd_min_size(j->chunk_stripes, j->stripes - s0);
    j->kt->gemv_q4_0_il(j->w + s0 * 8 * j->row_bytes, j->row_bytes, n, j->stripes - s0, j->acts, j->y + 8 * s0);
}

int dd_matvec_q4_0_il(int isa, const uint8_t *w, size_t rows, size_t k, const float *x, float *y)
{
    const dd_kernels *kt = dd_kernels_for(isa);
    if (kt == NULL || kt->gemv_q4_0_il == NULL)
        return DD_ERR_ISA;
    if (k == 0 || k % DD_QK != 0)
        return DD_ERR_ARG;
    void *mem = dd_scratch(DD_SCRATCH_ACTS, dd_acts_bytes(kt, 1, k));
    if (mem == NULL)
        return DD_ERR_NOMEM;
    dd_acts acts;
    dd_acts_prepare(kt, x, 1, k, mem, &acts);
    const size_t row_bytes = k / DD_QK * DD_Q4_0_BYTES;
    il_job job = { .kt = kt, .w = w, .row_bytes = row_bytes, .rows = rows, .stripes = rows / 8,
                   .chunk_stripes = dd_div_up(dd_chunk_rows(row_bytes), 8), .acts = &acts, .y = y };
    job.il_chunks = dd_div_up(job.stripes, job.chunk_stripes);
    dd_pool_for(il_chunk, &job, job.il_chunks + (rows % 8 != 0));
    return DD_OK;
}
