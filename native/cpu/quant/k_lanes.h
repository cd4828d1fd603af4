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

/* Defines a rows-as-lanes layout's repack from MOVE(g, rows, to_rl), the move of one super-block of 4 rows (BYTES
 * each at rows[r]) to or from its 4 * BYTES bytes at g: the static group copy NAME##_copy (a dd_group_copy_fn; src
 * and dst do not overlap) and dd_##NAME##_pack / dd_##NAME##_unpack (in place through dd_permute_groups, DD_ERR_ARG
 * for rows that are not whole super-blocks or longer than MAX_ROW_BYTES) and dd_##NAME##_unpack_groups. */
#define DD_DEFINE_RL_REPACK(NAME, BYTES, MAX_ROW_BYTES, MOVE)                                                  \
    static void NAME##_copy(uint8_t *dst, const uint8_t *src, size_t groups, size_t row_bytes, int to_rl)     \
    {                                                                                                          \
        const size_t group = 4 * row_bytes, nsb = row_bytes / (BYTES);                                        \
        for (size_t s = 0; s < groups; s++) {                                                                  \
            uint8_t *lanes = to_rl ? dst + s * group : (uint8_t *)src + s * group;                             \
            uint8_t *rm = to_rl ? (uint8_t *)src + s * group : dst + s * group;                                \
            for (size_t j = 0; j < nsb; j++) {                                                                 \
                uint8_t *rows[4];                                                                              \
                for (int r = 0; r < 4; r++)                                                                    \
                    rows[r] = rm + r * row_bytes + j * (BYTES);                                                \
                MOVE(lanes + j * 4 * (BYTES), rows, to_rl);                                                    \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    static int NAME##_permute(uint8_t *w, size_t nrows, size_t row_bytes, int to_rl)                          \
    {                                                                                                          \
        if (row_bytes == 0 || row_bytes % (BYTES) != 0 || row_bytes > (MAX_ROW_BYTES))                         \
            return DD_ERR_ARG;                                                                                 \
        return dd_permute_groups(w, nrows, row_bytes, 4, NAME##_copy, to_rl);                                  \
    }                                                                                                          \
    int dd_##NAME##_pack(uint8_t *w, size_t nrows, size_t row_bytes)                                           \
    {                                                                                                          \
        return NAME##_permute(w, nrows, row_bytes, 1);                                                         \
    }                                                                                                          \
    int dd_##NAME##_unpack(uint8_t *w, size_t nrows, size_t row_bytes)                                         \
    {                                                                                                          \
        return NAME##_permute(w, nrows, row_bytes, 0);                                                         \
    }                                                                                                          \
    void dd_##NAME##_unpack_groups(uint8_t *dst, const uint8_t *src, size_t groups, size_t row_bytes)          \
    {                                                                                                          \
        NAME##_copy(dst, src, groups, row_bytes, 0);                                                           \
    }

#endif
