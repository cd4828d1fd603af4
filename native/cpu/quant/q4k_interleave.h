/* The products of the weight type DD_Q4_K_IL that the kernel files' tables name (q4k_interleave.c). Apart from
 * kernels.h, so that q4_interleave.c (which includes kernels.h) and q4k_interleave.c do not name each other's
 * functions.
 */
#ifndef DELTADESK_Q4K_INTERLEAVE_H
#define DELTADESK_Q4K_INTERLEAVE_H

#include "kernels.h"

/* Columns up to which gemm[DD_Q4_K_IL] runs the interleaved GEMV (a batched decode step's rows; a chunk's stripes
 * stay in L2 from one column pair to the next); more columns (a prompt) de-interleave for the row-major GEMM,
 * whose per-column work is smaller. */
#define DD_IL_GEMV_COLS 8

/* A level's GEMV of interleaved stripes for up to DD_IL_GEMV_COLS columns: y[c * ldy + r] for r < 8 * stripes. */
typedef void (*dd_gemv_cols_fn)(const uint8_t *w, size_t row_bytes, size_t stripes, size_t stripes_avail,
                                const dd_acts *a, float *y, size_t ldy);

/* gemm[DD_Q4_K_IL] of every level (q4k_interleave.c): dd_gemm_il for the interleaved Q4_K layout, except
 * that `il` serves up to DD_IL_GEMV_COLS columns (deil: the level's de-interleave of that layout, or NULL for
 * the portable copy); row_major is the level's gemm[DD_Q4_K]. The bits of row_major on the row-major matrix. */
void dd_gemm_q4_k_il(dd_gemm_fn row_major, dd_gemv_cols_fn il, dd_deil_fn deil, const uint8_t *w, size_t row_bytes,
                     size_t nrows, size_t rows_avail, const dd_acts *a, float *y, size_t ldy);

/* Defines NAME, a dd_gemm_fn: dd_gemm_q4_k_il with the level's ROW_MAJOR, IL and DEIL (NULL where it has none). */
#define DD_DEFINE_GEMM_Q4_K_IL(NAME, ROW_MAJOR, IL, DEIL)                                                  \
    static void NAME(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a, \
                     float *y, size_t ldy)                                                                 \
    {                                                                                                      \
        dd_gemm_q4_k_il(ROW_MAJOR, IL, DEIL, w, row_bytes, nrows, rows_avail, a, y, ldy);                  \
    }

#endif
