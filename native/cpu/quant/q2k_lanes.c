/* The 4-row rows-as-lanes Q2_K layout (deltadesk_cpu.h, dd_q2_k_rl_pack): the repack in place, its inverse,
 * and the products of the weight type DD_Q2_K_RL that do not read the layout directly (dd_gemm_unpacked
 * through k_lanes.h's DD_DEFINE_GEMM_RL).
 *
 * The layout is a byte permutation within each super-block of a group of 4 rows, so the repack moves one
 * group at a time through a scratch of the group's size and needs no second copy of the matrix; rows past the
 * last multiple of 4 are left as they are. A product of a level without the layout's kernel unpacks the groups a few
 * at a time into a stack buffer and runs the row-major Q2_K kernel on them, and that kernel on the row-major tail: a row's result depends only
 * on its bytes and the activations, never on the chunk it falls in.
 */

#include "k_lanes.h"

#define RL_SB (4 * DD_Q2_K_BYTES)   /* one super-block of a group's 4 rows */
/* Bytes of row-major rows a product unpacks at a time: whole groups of rows up to DD_Q2_K_RL_MAX_ROW_BYTES */
#define RL_PIECE (4 * DD_Q2_K_RL_MAX_ROW_BYTES)

/* The super-block whose scale bytes 2 b .. 2 b + 1 land at 32 p + 8 q of a group's scale bytes (q < 4). */
static const uint8_t rl_block_of[2][4] = { { 0, 4, 1, 5 }, { 2, 6, 3, 7 } };

/* One super-block of 4 rows: the 4 stored blocks at rows[r] (84 bytes each) <-> its 336 bytes at g. */
static void rl_move(uint8_t *g, uint8_t *const rows[4], int to_rl)
{
    for (int r = 0; r < 4; r++) {
        uint8_t *blk = rows[r];
        for (int c = 0; c < 4; c++)
            for (int q = 0; q < 4; q++) {   /* qs dword 4 q + c of row r <-> lane 4 q + r of chunk c */
                uint8_t *at = g + 64 * c + 4 * (4 * q + r), *run = blk + 16 + 4 * (4 * q + c);
                memcpy(to_rl ? at : run, to_rl ? run : at, 4);
            }
        for (int p = 0; p < 2; p++)
            for (int q = 0; q < 4; q++) {
                uint8_t *at = g + 256 + 32 * p + 2 * (4 * q + r), *sc = blk + 2 * rl_block_of[p][q];
                memcpy(to_rl ? at : sc, to_rl ? sc : at, 2);
            }
        memcpy(to_rl ? g + 320 + 2 * r : blk + 80, to_rl ? blk + 80 : g + 320 + 2 * r, 2);
        memcpy(to_rl ? g + 328 + 2 * r : blk + 82, to_rl ? blk + 82 : g + 328 + 2 * r, 2);
    }
}

/* `groups` groups from src into dst (row-major to the layout when to_rl is 1, else the reverse); src and dst
 * do not overlap. */
static void rl_copy(uint8_t *dst, const uint8_t *src, size_t groups, size_t row_bytes, int to_rl)
{
    const size_t group = 4 * row_bytes, nsb = row_bytes / DD_Q2_K_BYTES;
    for (size_t s = 0; s < groups; s++) {
        uint8_t *lanes = to_rl ? dst + s * group : (uint8_t *)src + s * group;
        uint8_t *rm = to_rl ? (uint8_t *)src + s * group : dst + s * group;
        for (size_t j = 0; j < nsb; j++) {
            uint8_t *rows[4];
            for (int r = 0; r < 4; r++)
                rows[r] = rm + r * row_bytes + j * DD_Q2_K_BYTES;
            rl_move(lanes + j * RL_SB, rows, to_rl);
        }
    }
}

/* Every group of w rewritten in place: to_rl 1 rewrites row-major as the layout, 0 the reverse. */
static int rl_permute(uint8_t *w, size_t nrows, size_t row_bytes, int to_rl)
{
    if (row_bytes == 0 || row_bytes % DD_Q2_K_BYTES != 0 || row_bytes > DD_Q2_K_RL_MAX_ROW_BYTES)
        return DD_ERR_ARG;
    return dd_permute_groups(w, nrows, row_bytes, 4, rl_copy, to_rl);
}

int dd_q2_k_rl_pack(uint8_t *w, size_t nrows, size_t row_bytes)
{
    return rl_permute(w, nrows, row_bytes, 1);
}

int dd_q2_k_rl_unpack(uint8_t *w, size_t nrows, size_t row_bytes)
{
    return rl_permute(w, nrows, row_bytes, 0);
}

void dd_q2_k_rl_unpack_groups(uint8_t *dst, const uint8_t *src, size_t groups, size_t row_bytes)
{
    rl_copy(dst, src, groups, row_bytes, 0);
}
