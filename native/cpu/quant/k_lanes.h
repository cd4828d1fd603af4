/* The unpacking of the 4-row rows-as-lanes layouts of Q2_K and Q3_K (q2k_lanes.c, q3k_lanes.c) and the products of
 * their weight types DD_Q2_K_RL and DD_Q3_K_RL that read them unpacked, for the kernel files' tables. Apart from
 * kernels.h, so that q4_interleave.c (which includes kernels.h) and the layouts' files do not name each other's
 * functions.
 */
#ifndef DELTADESK_K_LANES_H
#define DELTADESK_K_LANES_H

#include "kernels.h"

/* `groups` 4-row groups at src in dd_q2_k_rl_pack's (dd_q3_k_rl_pack's) layout -> their 4 * groups row-major rows
 * at dst (row_bytes each; src and dst do not overlap): the unpacking of dd_gemm_unpacked. */
void dd_q2_k_rl_unpack_groups(uint8_t *dst, const uint8_t *src, size_t groups, size_t row_bytes);
void dd_q3_k_rl_unpack_groups(uint8_t *dst, const uint8_t *src, size_t groups, size_t row_bytes);

/* Defines NAME, a dd_gemm_fn: gemm[DD_Q2_K_RL] (UNPACK dd_q2_k_rl_unpack_groups, ROW_MAJOR the level's
 * gemm[DD_Q2_K]) or gemm[DD_Q3_K_RL] of the levels without a rows-as-lanes kernel, and the avx512vnni level's
 * without its columns' scratch: dd_gemm_unpacked of 4-row groups (w starts on a group; chunks are whole groups).
 * The bits of ROW_MAJOR on the row-major matrix. */
#define DD_DEFINE_GEMM_RL(NAME, ROW_MAJOR, UNPACK)                                                         \
    static void NAME(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a, \
                     float *y, size_t ldy)                                                                 \
    {                                                                                                      \
        dd_gemm_unpacked(ROW_MAJOR, UNPACK, 4, w, row_bytes, nrows, rows_avail, a, y, ldy);                \
    }

#endif
