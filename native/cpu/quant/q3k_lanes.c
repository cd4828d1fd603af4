/* The 4-row rows-as-lanes Q3_K layout (deltadesk_cpu.h, dd_q3_k_rl_pack): the repack in place, its inverse, and
 * the unpacking of groups for the products of the weight type DD_Q3_K_RL that do not read the layout directly
 * (dd_gemm_unpacked through k_lanes.h's DD_DEFINE_GEMM_RL).
 *
 * As Q2_K's (q2k_lanes.c): one group of 4 rows at a time through a scratch of the group's size, rows past the last
 * multiple of 4 as they are. The qs and hmask bytes and the d are moved whole; the 16 6-bit scales of a row (ggml's
 * 12 packed bytes, lowbit.h) are moved as their low nibbles and top two bits, which the 12 bytes hold with no bit to
 * spare, so both directions are exact.
 */

#include "k_lanes.h"

_Static_assert(4 * DD_Q3_K_RL_MAX_ROW_BYTES <= DD_UNPACK_PIECE, "a Q3_K group must fit DD_UNPACK_PIECE");

/* The scale whose low nibble the layout's scale byte 8 q + 2 r + t holds in its low nibble: 2 B[q] + t (its high
 * nibble: that scale's + 4). */
static const uint8_t rl3_nibble_of[4] = { 0, 8, 2, 10 };

/* Row r's 6-bit scales of a super-block (the 12 bytes at s) <-> their places in the group's super-block g. */
static void rl3_scales(uint8_t *g, uint8_t *s, int r, int to_rl)
{
    uint8_t sc[16];
    if (to_rl) {
        for (int i = 0; i < 16; i++)
            sc[i] = (uint8_t)(((s[i % 8] >> (4 * (i / 8))) & 15) | ((s[8 + i % 4] >> (2 * (i / 4))) & 3) << 4);
        for (int q = 0; q < 4; q++)
            for (int t = 0; t < 2; t++) {
                const int i = rl3_nibble_of[q] + t;
                g[384 + 8 * q + 2 * r + t] = (uint8_t)((sc[i] & 15) | (sc[i + 4] & 15) << 4);
            }
        for (int qq = 0; qq < 2; qq++)
            for (int t = 0; t < 2; t++) {
                uint8_t h = 0;
                for (int f = 0; f < 4; f++)
                    h |= (uint8_t)((sc[8 * qq + 2 * f + t] >> 4) << (2 * f));
                g[416 + 8 * qq + 2 * r + t] = h;
            }
    } else {
        for (int q = 0; q < 4; q++)
            for (int t = 0; t < 2; t++) {
                const int i = rl3_nibble_of[q] + t;
                const uint8_t b = g[384 + 8 * q + 2 * r + t];
                sc[i] = b & 15;
                sc[i + 4] = b >> 4;
            }
        for (int qq = 0; qq < 2; qq++)
            for (int t = 0; t < 2; t++)
                for (int f = 0; f < 4; f++)
                    sc[8 * qq + 2 * f + t] |= (uint8_t)(((g[416 + 8 * qq + 2 * r + t] >> (2 * f)) & 3) << 4);
        memset(s, 0, 12);
        for (int i = 0; i < 16; i++) {
            s[i % 8] |= (uint8_t)((sc[i] & 15) << (4 * (i / 8)));
            s[8 + i % 4] |= (uint8_t)((sc[i] >> 4) << (2 * (i / 4)));
        }
    }
}

/* One super-block of 4 rows: the 4 stored blocks at rows[r] (110 bytes each) <-> its 440 bytes at g. */
static void rl3_move(uint8_t *g, uint8_t *const rows[4], int to_rl)
{
    for (int r = 0; r < 4; r++) {
        uint8_t *blk = rows[r];
        for (int c = 0; c < 4; c++) {
            for (int q = 0; q < 4; q++) {   /* qs dword 4 q + c of row r <-> lane 4 q + r of chunk c */
                uint8_t *at = g + 64 * c + 4 * (4 * q + r), *run = blk + 32 + 4 * (4 * q + c);
                memcpy(to_rl ? at : run, to_rl ? run : at, 4);
            }
            for (int t = 0; t < 2; t++) {   /* hmask dword 4 t + c of row r <-> dword 4 t + r of hmask chunk c */
                uint8_t *at = g + 256 + 32 * c + 4 * (4 * t + r), *run = blk + 4 * (4 * t + c);
                memcpy(to_rl ? at : run, to_rl ? run : at, 4);
            }
        }
        rl3_scales(g, blk + 96, r, to_rl);
        memcpy(to_rl ? g + 432 + 2 * r : blk + 108, to_rl ? blk + 108 : g + 432 + 2 * r, 2);
    }
}

DD_DEFINE_RL_REPACK(q3_k_rl, DD_Q3_K_BYTES, DD_Q3_K_RL_MAX_ROW_BYTES, rl3_move)
