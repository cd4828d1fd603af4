/* The 8-row interleaved Q4_K layout (deltadesk_cpu.h, dd_q4_k_interleave): the repack in place, its inverse,
 * and the products of the weight type DD_Q4_K_IL (dd_gemm_q4_k_il, kernels.h).
 *
 * As for Q4_0 (q4_interleave.c): the repack moves one stripe (8 rows) at a time through a scratch of the
 * stripe's size, rows past the last multiple of 8 stay as they are; a product runs the level's interleaved
 * GEMV on the stripes where it has one (up to DD_IL_GEMV_COLS columns: a batched decode step), else the row-major Q4_K kernel on the stripes de-interleaved
 * a few at a time into a stack buffer (by the level's SIMD de-interleave where it has one), and that kernel on
 * the row-major tail. The scales and mins are moved as
 * their 6-bit values (ggml's get_scale_min_k4), which the 12 stored bytes hold with no bit to spare, so both
 * directions are exact.
 */

#include "q4k_interleave.h"

#define KIL_BLOCK (8 * DD_Q4_K_BYTES)
_Static_assert(8 * DD_Q4_K_IL_MAX_ROW_BYTES <= DD_UNPACK_PIECE, "a Q4_K stripe must fit DD_UNPACK_PIECE");

/* The 6-bit scales and mins of a super-block's 12 scale bytes s (ggml-quants.c get_scale_min_k4). */
static void kil_scales_get(const uint8_t *s, uint8_t sc[8], uint8_t mn[8])
{
    for (int i = 0; i < 4; i++) {
        sc[i] = s[i] & 63;
        mn[i] = s[i + 4] & 63;
        sc[i + 4] = (uint8_t)((s[i + 8] & 15) | (s[i] >> 6) << 4);
        mn[i + 4] = (uint8_t)((s[i + 8] >> 4) | (s[i + 4] >> 6) << 4);
    }
}

/* The inverse: the 12 bytes that hold these scales and mins (ggml-quants.c quantize_row_q4_K_ref's packing). */
static void kil_scales_put(uint8_t *s, const uint8_t sc[8], const uint8_t mn[8])
{
    for (int i = 0; i < 4; i++) {
        s[i] = (uint8_t)(sc[i] | (sc[i + 4] >> 4) << 6);
        s[i + 4] = (uint8_t)(mn[i] | (mn[i + 4] >> 4) << 6);
        s[i + 8] = (uint8_t)((sc[i + 4] & 15) | (mn[i + 4] & 15) << 4);
    }
}

/* Row r's super-block (144 bytes at rm, row-major) <-> its bytes in the interleaved super-block blk. */
static void kil_move(uint8_t *blk, uint8_t *rm, size_t r, int to_il)
{
    uint8_t sc[8], mn[8];
    memcpy(to_il ? blk + 2 * r : rm, to_il ? rm : blk + 2 * r, 2);
    memcpy(to_il ? blk + 16 + 2 * r : rm + 2, to_il ? rm + 2 : blk + 16 + 2 * r, 2);
    if (to_il) {
        kil_scales_get(rm + 4, sc, mn);
        for (int i = 0; i < 4; i++) {
            blk[32 + 8 * i + r] = (uint8_t)((sc[i] & 15) | (sc[i + 4] & 15) << 4);
            blk[64 + 8 * i + r] = (uint8_t)((mn[i] & 15) | (mn[i + 4] & 15) << 4);
            blk[96 + 8 * i + r] = (uint8_t)(sc[i] >> 4 | (sc[i + 4] >> 4) << 2 | (mn[i] >> 4) << 4 | (mn[i + 4] >> 4) << 6);
        }
    } else {
        for (int i = 0; i < 4; i++) {
            const uint8_t s = blk[32 + 8 * i + r], m = blk[64 + 8 * i + r], h = blk[96 + 8 * i + r];
            sc[i] = (uint8_t)((s & 15) | (h & 3) << 4);
            sc[i + 4] = (uint8_t)((s >> 4) | ((h >> 2) & 3) << 4);
            mn[i] = (uint8_t)((m & 15) | ((h >> 4) & 3) << 4);
            mn[i + 4] = (uint8_t)((m >> 4) | (h >> 6) << 4);
        }
        kil_scales_put(rm + 4, sc, mn);
    }
    for (size_t j = 0; j < 4; j++)
        for (size_t u = 0; u < 8; u++) {
            uint8_t *at = blk + 128 + 256 * j + 32 * u + 4 * r, *run = rm + 16 + 32 * j + 4 * u;
            memcpy(to_il ? at : run, to_il ? run : at, 4);
        }
}

/* `stripes` stripes from src into dst (row-major to interleaved when to_il is 1, else the reverse); src and
 * dst do not overlap. */
static void kil_copy(uint8_t *dst, const uint8_t *src, size_t stripes, size_t row_bytes, int to_il)
{
    const size_t stripe = 8 * row_bytes, nsb = row_bytes / DD_Q4_K_BYTES;
    for (size_t s = 0; s < stripes; s++) {
        uint8_t *il = to_il ? dst + s * stripe : (uint8_t *)src + s * stripe;
        uint8_t *rows = to_il ? (uint8_t *)src + s * stripe : dst + s * stripe;
        for (size_t r = 0; r < 8; r++)
            for (size_t b = 0; b < nsb; b++)
                kil_move(il + b * KIL_BLOCK, rows + r * row_bytes + b * DD_Q4_K_BYTES, r, to_il);
    }
}

/* Every stripe of w rewritten in place: to_il 1 rewrites row-major as interleaved, 0 the reverse. */
static int kil_permute(uint8_t *w, size_t nrows, size_t row_bytes, int to_il)
{
    if (row_bytes == 0 || row_bytes % DD_Q4_K_BYTES != 0 || row_bytes > DD_Q4_K_IL_MAX_ROW_BYTES)
        return DD_ERR_ARG;
    return dd_permute_groups(w, nrows, row_bytes, 8, kil_copy, to_il);
}

int dd_q4_k_interleave(uint8_t *w, size_t nrows, size_t row_bytes)
{
    return kil_permute(w, nrows, row_bytes, 1);
}

int dd_q4_k_deinterleave(uint8_t *w, size_t nrows, size_t row_bytes)
{
    return kil_permute(w, nrows, row_bytes, 0);
}

/* kil_copy's unpacking, as dd_deil_fn. */
static void kil_unpack(uint8_t *dst, const uint8_t *src, size_t stripes, size_t row_bytes)
{
    kil_copy(dst, src, stripes, row_bytes, 0);
}

void dd_gemm_q4_k_il(dd_gemm_fn row_major, dd_gemv_cols_fn il, dd_deil_fn deil, const uint8_t *w, size_t row_bytes,
                     size_t nrows, size_t rows_avail, const dd_acts *a, float *y, size_t ldy)
{
    const size_t stripes = nrows / 8, r0 = 8 * stripes;
    if (stripes > 0 && a->m <= DD_IL_GEMV_COLS && il != NULL) {
        il(w, row_bytes, stripes, rows_avail / 8, a, y, ldy);
        if (nrows > r0)
            row_major(w + r0 * row_bytes, row_bytes, nrows - r0, rows_avail - r0, a, y + r0, ldy);
        return;
    }
    dd_gemm_unpacked(row_major, deil != NULL ? deil : kil_unpack, 8, w, row_bytes, nrows, rows_avail, a, y, ldy);
}
