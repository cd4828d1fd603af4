/* The 8-row interleaved Q4_0 layout (deltadesk_cpu.h, dd_q4_0_interleave): the repack in place, its inverse,
 * and the products of the weight type DD_Q4_0_IL (dd_gemm_q4_0_il, kernels.h).
 *
 * The repack moves the bytes of one stripe (8 rows) at a time through a scratch of the stripe's size, so it
 * needs no second copy of the matrix; rows past the last multiple of 8 are left as they are. A product runs
 * the level's interleaved GEMV on the stripes where it has one (m == 1), else the row-major Q4_0 kernel on
 * the stripes de-interleaved a few at a time into a stack buffer (by the level's SIMD de-interleave where it
 * has one), and that kernel on the row-major tail: a row's result
 * depends only on its bytes and the activations, never on the chunk it falls in.
 */
#include <stdlib.h>

#include "kernels.h"

#define IL_BLOCK (8 * DD_Q4_0_BYTES)
/* Bytes of row-major rows a product de-interleaves at a time: whole stripes of rows up to
 * DD_Q4_0_IL_MAX_ROW_BYTES (the repack refuses longer rows) */
#define IL_PIECE (8 * DD_Q4_0_IL_MAX_ROW_BYTES)

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

/* `stripes` stripes from src into dst (row-major to interleaved when to_il is 1, else the reverse); src and
 * dst do not overlap. */
static void il_copy(uint8_t *dst, const uint8_t *src, size_t stripes, size_t row_bytes, int to_il)
{
    const size_t stripe = 8 * row_bytes, nb = row_bytes / DD_Q4_0_BYTES;
    for (size_t s = 0; s < stripes; s++) {
        uint8_t *il = to_il ? dst + s * stripe : (uint8_t *)src + s * stripe;
        uint8_t *rows = to_il ? (uint8_t *)src + s * stripe : dst + s * stripe;
        for (size_t r = 0; r < 8; r++)
            for (size_t b = 0; b < nb; b++)
                il_move(il, rows + r * row_bytes + b * DD_Q4_0_BYTES, b, r, to_il);
    }
}

/* Every stripe of w through a scratch: to_il 1 rewrites row-major as interleaved, 0 the reverse. */
static int il_permute(uint8_t *w, size_t nrows, size_t row_bytes, int to_il)
{
    if (row_bytes == 0 || row_bytes % DD_Q4_0_BYTES != 0 || row_bytes > DD_Q4_0_IL_MAX_ROW_BYTES)
        return DD_ERR_ARG;
    const size_t stripe = 8 * row_bytes;
    if (nrows < 8)
        return DD_OK;
    uint8_t *tmp = malloc(stripe);
    if (tmp == NULL)
        return DD_ERR_NOMEM;
    for (size_t s = 0; s < nrows / 8; s++) {
        memcpy(tmp, w + s * stripe, stripe);
        il_copy(w + s * stripe, tmp, 1, row_bytes, to_il);
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

void dd_gemm_q4_0_il(dd_gemm_fn row_major, dd_gemv_il_fn il, dd_deil_fn deil, const uint8_t *w, size_t row_bytes,
                     size_t nrows, size_t rows_avail, const dd_acts *a, float *y, size_t ldy)
{
    const size_t stripes = nrows / 8, r0 = 8 * stripes, stripe = 8 * row_bytes;
    if (stripes > 0 && a->m == 1 && il != NULL) {
        il(w, row_bytes, stripes, rows_avail / 8, a, y);
    } else if (stripes > 0) {
        uint8_t rows[IL_PIECE];   /* on the stack, as kq_gemm_avx512.h's scratch: nothing to allocate or fail */
        const size_t per = IL_PIECE / stripe;
        for (size_t s = 0; s < stripes; s += per) {
            const size_t n = per < stripes - s ? per : stripes - s;
            if (deil != NULL)
                deil(rows, w + s * stripe, n, row_bytes);
            else
                il_copy(rows, w + s * stripe, n, row_bytes, 0);
            row_major(rows, row_bytes, 8 * n, 8 * n, a, y + 8 * s, ldy);
        }
    }
    if (nrows > r0)
        row_major(w + r0 * row_bytes, row_bytes, nrows - r0, rows_avail - r0, a, y + r0, ldy);
}
