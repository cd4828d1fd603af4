/* The 8-row interleaved layouts of Q4_0 and MXFP4 (deltadesk_cpu.h, dd_q4_0_interleave, dd_mxfp4_interleave):
 * the repack in place, its inverse, and the products of the weight types DD_Q4_0_IL and DD_MXFP4_IL
 * (dd_gemm_il, kernels.h); also what every row-grouped layout shares (kernels.h): the in-place permutation of
 * groups (dd_permute_groups) and the product on unpacked groups (dd_gemm_unpacked). The two types' blocks differ
 * only in their scale's bytes (2 or 1) before the same 16 nibble bytes, so one layout with that width as a
 * parameter serves both.
 *
 * The repack moves the bytes of one stripe (8 rows) at a time through a scratch of the stripe's size, so it
 * needs no second copy of the matrix; rows past the last multiple of 8 are left as they are. A product runs
 * the level's interleaved GEMV on the stripes where it has one (m == 1), else the row-major kernel on
 * the stripes de-interleaved a few at a time into a stack buffer (dd_gemm_unpacked, by the level's SIMD
 * de-interleave where it has one), and that kernel on the row-major tail: a row's result
 * depends only on its bytes and the activations, never on the chunk it falls in.
 */
#include <stdlib.h>

#include "kernels.h"

_Static_assert(8 * DD_MXFP4_IL_MAX_ROW_BYTES <= DD_UNPACK_PIECE, "an MXFP4 stripe must fit DD_UNPACK_PIECE");

/* Row r's block b (sc + 16 bytes at rm, row-major) <-> its sc + 4 x 4 bytes in the interleaved stripe p. */
static void il_move(uint8_t *p, uint8_t *rm, size_t b, size_t r, size_t sc, int to_il)
{
    uint8_t *blk = p + b * 8 * (sc + 16);
    uint8_t *dst = to_il ? blk + sc * r : rm, *src = to_il ? rm : blk + sc * r;
    memcpy(dst, src, sc);
    for (size_t q = 0; q < 4; q++) {
        uint8_t *at = blk + 8 * sc + 32 * q + 4 * r, *run = rm + sc + 4 * q;
        memcpy(to_il ? at : run, to_il ? run : at, 4);
    }
}

/* `stripes` stripes from src into dst (row-major to interleaved when to_il is 1, else the reverse), blocks of
 * sc scale bytes; src and dst do not overlap. */
static void il_copy(uint8_t *dst, const uint8_t *src, size_t stripes, size_t row_bytes, size_t sc, int to_il)
{
    const size_t stripe = 8 * row_bytes, nb = row_bytes / (sc + 16);
    for (size_t s = 0; s < stripes; s++) {
        uint8_t *il = to_il ? dst + s * stripe : (uint8_t *)src + s * stripe;
        uint8_t *rows = to_il ? (uint8_t *)src + s * stripe : dst + s * stripe;
        for (size_t r = 0; r < 8; r++)
            for (size_t b = 0; b < nb; b++)
                il_move(il, rows + r * row_bytes + b * (sc + 16), b, r, sc, to_il);
    }
}

int dd_permute_groups(uint8_t *w, size_t nrows, size_t row_bytes, size_t g, dd_group_copy_fn copy, int to_layout)
{
    const size_t group = g * row_bytes;
    if (nrows < g)
        return DD_OK;
    uint8_t *tmp = malloc(group);
    if (tmp == NULL)
        return DD_ERR_NOMEM;
    for (size_t s = 0; s < nrows / g; s++) {
        memcpy(tmp, w + s * group, group);
        copy(w + s * group, tmp, 1, row_bytes, to_layout);
    }
    free(tmp);
    return DD_OK;
}

/* il_copy of Q4_0's blocks (2 scale bytes) and of MXFP4's (1), as dd_group_copy_fn. */
static void il_copy_q4_0(uint8_t *dst, const uint8_t *src, size_t stripes, size_t row_bytes, int to_il)
{
    il_copy(dst, src, stripes, row_bytes, 2, to_il);
}

static void il_copy_mxfp4(uint8_t *dst, const uint8_t *src, size_t stripes, size_t row_bytes, int to_il)
{
    il_copy(dst, src, stripes, row_bytes, 1, to_il);
}

/* Every stripe of w (rows of blocks of sc scale bytes, at most max_row_bytes) rewritten in place: to_il 1
 * row-major as interleaved, 0 the reverse. */
static int il_permute(uint8_t *w, size_t nrows, size_t row_bytes, size_t sc, size_t max_row_bytes, int to_il)
{
    if (row_bytes == 0 || row_bytes % (sc + 16) != 0 || row_bytes > max_row_bytes)
        return DD_ERR_ARG;
    return dd_permute_groups(w, nrows, row_bytes, 8, sc == 2 ? il_copy_q4_0 : il_copy_mxfp4, to_il);
}

int dd_q4_0_interleave(uint8_t *w, size_t nrows, size_t row_bytes)
{
    return il_permute(w, nrows, row_bytes, 2, DD_Q4_0_IL_MAX_ROW_BYTES, 1);
}

int dd_q4_0_deinterleave(uint8_t *w, size_t nrows, size_t row_bytes)
{
    return il_permute(w, nrows, row_bytes, 2, DD_Q4_0_IL_MAX_ROW_BYTES, 0);
}

int dd_mxfp4_interleave(uint8_t *w, size_t nrows, size_t row_bytes)
{
    return il_permute(w, nrows, row_bytes, 1, DD_MXFP4_IL_MAX_ROW_BYTES, 1);
}

int dd_mxfp4_deinterleave(uint8_t *w, size_t nrows, size_t row_bytes)
{
    return il_permute(w, nrows, row_bytes, 1, DD_MXFP4_IL_MAX_ROW_BYTES, 0);
}

/* il_copy's unpacking of Q4_0's and MXFP4's stripes, as dd_deil_fn. */
static void il_unpack_q4_0(uint8_t *dst, const uint8_t *src, size_t stripes, size_t row_bytes)
{
    il_copy(dst, src, stripes, row_bytes, 2, 0);
}

static void il_unpack_mxfp4(uint8_t *dst, const uint8_t *src, size_t stripes, size_t row_bytes)
{
    il_copy(dst, src, stripes, row_bytes, 1, 0);
}

void dd_gemm_unpacked(dd_gemm_fn row_major, dd_deil_fn unpack, size_t g, const uint8_t *w, size_t row_bytes,
                      size_t nrows, size_t rows_avail, const dd_acts *a, float *y, size_t ldy)
{
    const size_t groups = nrows / g, r0 = g * groups, group = g * row_bytes;
    if (groups > 0) {
        uint8_t rows[DD_UNPACK_PIECE];   /* on the stack, as kq_gemm_avx512.h's scratch: nothing to allocate or fail */
        const size_t per = DD_UNPACK_PIECE / group;
        for (size_t s = 0; s < groups; s += per) {
            const size_t n = per < groups - s ? per : groups - s;
            unpack(rows, w + s * group, n, row_bytes);
            row_major(rows, row_bytes, g * n, g * n, a, y + g * s, ldy);
        }
    }
    if (nrows > r0)
        row_major(w + r0 * row_bytes, row_bytes, nrows - r0, rows_avail - r0, a, y + r0, ldy);
}

void dd_gemm_il(int wtype, dd_gemm_fn row_major, dd_gemv_il_fn il, dd_deil_fn deil, const uint8_t *w,
                size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a, float *y, size_t ldy)
{
    const size_t stripes = nrows / 8, r0 = 8 * stripes;
    if (stripes > 0 && a->m == 1 && il != NULL) {
        il(w, row_bytes, stripes, rows_avail / 8, a, y);
        if (nrows > r0)
            row_major(w + r0 * row_bytes, row_bytes, nrows - r0, rows_avail - r0, a, y + r0, ldy);
        return;
    }
    if (deil == NULL)
        deil = wtype == DD_MXFP4 ? il_unpack_mxfp4 : il_unpack_q4_0;
    dd_gemm_unpacked(row_major, deil, 8, w, row_bytes, nrows, rows_avail, a, y, ldy);
}
