/* The 4-row rows-as-lanes Q2_K layout (deltadesk_cpu.h, dd_q2_k_rl_pack): the repack in place, its inverse,
 * and the products of the weight type DD_Q2_K_RL that do not read the layout directly (dd_gemm_unpacked
 * through k_lanes.h's DD_DEFINE_GEMM_RL).
 *
 * The layout is a byte permutation within each super-block of a group of 4 rows, so the repack moves one
 * group at a time through a scratch of the group's size and needs no second copy of the matrix; rows past the
 * last multiple of 4 are left as they are. A product of a level without the layout's kernel unpacks the groups a
 * few at a time into a stack buffer and runs the row-major Q2_K kernel on them, and that kernel on the row-major
 * tail: a row's result depends only on its bytes and the activations, never on the chunk it falls in.
 */

#include "k_lanes.h"

_Static_assert(4 * DD_Q2_K_RL_MAX_ROW_BYTES <= DD_UNPACK_PIECE, "a Q2_K group must fit DD_UNPACK_PIECE");

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

DD_DEFINE_RL_REPACK(q2_k_rl, DD_Q2_K_BYTES, DD_Q2_K_RL_MAX_ROW_BYTES, rl_move)
