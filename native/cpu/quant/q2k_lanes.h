/* The products of the weight type DD_Q2_K_RL that unpack the 4-row rows-as-lanes groups (q2k_lanes.c), for the
 * kernel files' tables. Apart from kernels.h, so that q4_interleave.c (which includes kernels.h) and q2k_lanes.c
 * do not name each other's functions.
 */
#ifndef DELTADESK_Q2K_LANES_H
#define DELTADESK_Q2K_LANES_H

#include "kernels.h"

/* gemm[DD_Q2_K_RL] of the levels without a rows-as-lanes kernel, and the avx512vnni level's without its columns'
 * scratch (q2k_lanes.c): w starts on a 4-row group; its nrows / 4 groups are unpacked a few at a time into a stack
 * buffer for `row_major` (the level's gemm[DD_Q2_K]); the last nrows % 4 rows (the matrix's row-major tail: chunks
 * are whole groups) go to row_major as they are. The bits of row_major on the row-major matrix. */
void dd_gemm_q2_k_rl(dd_gemm_fn row_major, const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail,
                     const dd_acts *a, float *y, size_t ldy);

/* Defines NAME, a dd_gemm_fn: dd_gemm_q2_k_rl with the level's ROW_MAJOR. */
#define DD_DEFINE_GEMM_Q2_K_RL(NAME, ROW_MAJOR)                                                            \
    static void NAME(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a, \
                     float *y, size_t ldy)                                                                 \
    {                                                                                                      \
        dd_gemm_q2_k_rl(ROW_MAJOR, w, row_bytes, nrows, rows_avail, a, y, ldy);                            \
    }

#endif
