/* The IQ super-block types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) unpacked for lowbit.h:
 * each value v = d_eff * sc_h * (u - off), u an unsigned byte, sc_h an integer per 16 values, d_eff the
 * f16 d times a power of two (exact in f32). Layouts: ggml-common.h block_iq*; values as ggml-quants.c
 * dequantize_row_iq* (the engine's numpy twin is checked against gguf-py's decoder):
 *   IQ2_XXS (66 bytes): f16 d, then per 32 values 8 bytes: 4 grid indices (8 values each of iq2xxs_grid)
 *     and a u32 whose bits 7l .. 7l + 6 index the sign pattern of entry l and whose top 4 bits are ls:
 *     v = d (0.5 + ls) / 4 * grid * sign = d / 8 * (2 ls + 1) * (+-grid), off 43 (grid values 8, 25, 43).
 *   IQ2_XS (74): f16 d, u16 qs[32] (9-bit iq2xs_grid index, 7-bit sign index), scales[8] (a 4-bit ls per
 *     16 values): v = d / 8 * (2 ls + 1) * (+-grid), off 43.
 *   IQ2_S (82): f16 d, qs[32] (index low bytes), signs[32] (a bit per value), qh[8] (2 index bits per
 *     entry), scales[8]: as IQ2_XS with iq2s_grid (10-bit index), off 43.
 *   IQ3_XXS (98): f16 d, qs[64] (indices of 4 values of iq3xxs_grid), u32 per 32 values (signs as IQ2_XXS,
 *     ls in the top 4 bits): v = d (0.5 + ls) / 2 * (+-grid) = d / 4 * (2 ls + 1) * (+-grid), off 62.
 *   IQ3_S (110): f16 d, qs[64], qh[8] (index bit 8), signs[32], scales[4] (a 4-bit ls per 32 values):
 *     v = d * (2 ls + 1) * (+-grid) with iq3s_grid (odd values 1..15), off 15.
 *   IQ1_S (50): f16 d, qs[32], u16 qh[8] per 32 values (3 index bits per entry, ls in bits 12-14, the sign
 *     of delta in bit 15): v = d (2 ls + 1) (grid + delta), grid in {-1, 0, 1}, delta = -+1/8, i.e.
 *     d / 8 * (2 ls + 1) * (8 grid -+ 1), off 9.
 *   IQ1_M (56): qs[32], qh[16] (a nibble per 8 values: 3 index bits, delta's sign), u16 scales[4] (3-bit ls
 *     per 16 values; their top nibbles make the f16 d): v as IQ1_S with the IQ1_S grid.
 * The sign patterns of IQ2_XXS, IQ2_XS and IQ3_XXS are ggml's ksigns_iq2xs: 7 bits and their parity as bit 7.
 */
#ifndef DELTADESK_IQUANTS_H
#define DELTADESK_IQUANTS_H

#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "kernels.h"

#define DD_IQ2_OFF 43
#define DD_IQ3XXS_OFF 62
#define DD_IQ3S_OFF 15
#define DD_IQ1_OFF 9

/* Byte offsets of each grid in dd_iq_pos8 (entries of 8 or 4 values, one byte each). */
#define DD_IQ2XXS_AT 0
#define DD_IQ2XS_AT (DD_IQ2XXS_AT + 256 * 8)
#define DD_IQ2S_AT (DD_IQ2XS_AT + 512 * 8)
#define DD_IQ3XXS_AT (DD_IQ2S_AT + 1024 * 8)
#define DD_IQ3S_AT (DD_IQ3XXS_AT + 256 * 4)
#define DD_IQ1S_AT (DD_IQ3S_AT + 512 * 4)
#define DD_IQ1S_NEG_AT (DD_IQ1S_AT + 2048 * 8)
#define DD_IQ_GRID_BYTES (DD_IQ1S_NEG_AT + 2048 * 8)

/* The registered grids (iq_grids.c) as unsigned bytes off + g (IQ1_S: 8g + 1 + 9, the code of a positive
 * delta; the same entries with a negative delta, 8g - 1 + 9, at DD_IQ1S_NEG_AT); sign_mask[b] has byte j all
 * ones where bit j of b is set. */
extern uint64_t dd_iq_pos8[DD_IQ_GRID_BYTES / 8];
extern uint64_t dd_iq_sign_mask[256];
/* ksigns_iq2xs: dd_iq_ksign of 0 .. 127. */
extern uint8_t dd_iq_ksigns[128];
/* The grids of IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S (t = 0 .. 3, looked up in registers) as codes: entry e's value j
 * is levels[t][(code >> (b j)) & (2^b - 1)], code = dd_iq_codes[dd_iq_code_at[t] + e], b = 2 for the 8-wide
 * grids (3 distinct values), 3 for the 4-wide ones (8 distinct values). */
#define DD_IQ_CODES (256 + 512 + 256 + 512)
extern uint16_t dd_iq_codes[DD_IQ_CODES];
extern uint8_t dd_iq_levels[4][16];
static const int dd_iq_code_at[4] = { 0, 256, 768, 1024 };

static inline uint8_t dd_iq_ksign(uint32_t i)
{
    return (uint8_t)(i | (uint32_t)__builtin_parity(i) << 7);
}

/* Values 8 slot .. 8 slot + 7 from an 8-value grid entry (table byte offset at + 8 e), their sign byte s. */
static inline void dd_iq_put8(uint8_t *q, uint8_t *sgn, int slot, size_t at, size_t e, uint8_t s)
{
    memcpy(q + 8 * slot, (const uint8_t *)dd_iq_pos8 + at + 8 * e, 8);
    sgn[slot] = s;
}

/* The same from two 4-value entries e0, e1 of a 4-wide grid. */
static inline void dd_iq_put4x2(uint8_t *q, uint8_t *sgn, int slot, size_t at, size_t e0, size_t e1, uint8_t s)
{
    memcpy(q + 8 * slot, (const uint8_t *)dd_iq_pos8 + at + 4 * e0, 4);
    memcpy(q + 8 * slot + 4, (const uint8_t *)dd_iq_pos8 + at + 4 * e1, 4);
    sgn[slot] = s;
}

/* Where value j's sign bit (bit j % 8 of sgn[j / 8]) is set, u becomes 2 off - u (off + g -> off - g), or
 * for IQ1 (two_off = 0) u - 2 (8g + 1 + 9 -> 8g - 1 + 9). No byte borrows: u <= 2 off, and IQ1's u >= 2. */
static inline void dd_iq_signs(uint8_t *q, const uint8_t *sgn, int two_off)
{
#ifdef __AVX512F__
    for (int g = 0; g < 4; g++) {
        uint64_t m;
        memcpy(&m, sgn + 8 * g, 8);
        const __m512i u = _mm512_loadu_si512(q + 64 * g);
        _mm512_storeu_si512(q + 64 * g, two_off ? _mm512_mask_sub_epi8(u, m, _mm512_set1_epi8((char)two_off), u)
                                                 : _mm512_mask_sub_epi8(u, m, u, _mm512_set1_epi8(2)));
    }
#else
    const uint64_t ones = 0x0101010101010101ull;
    for (int slot = 0; slot < 32; slot++) {
        uint64_t u;
        memcpy(&u, q + 8 * slot, 8);
        const uint64_t m = dd_iq_sign_mask[sgn[slot]], n = two_off ? (uint64_t)two_off * ones - u : u - 2 * ones;
        u = (u & ~m) | (n & m);
        memcpy(q + 8 * slot, &u, 8);
    }
#endif
}

/* q[256] unsigned values, sc[16] scales per 16 values, *d the f32 d_eff of a super-block. */
static inline void dd_iq_unpack(const uint8_t *blk, int wtype, uint8_t *q, int16_t *sc, float *d)
{
    uint8_t sgn[32];
    switch (wtype) {
    case DD_IQ2_XXS:
        for (int ib = 0; ib < 8; ib++) {
            uint32_t aux;
            memcpy(&aux, blk + 2 + 8 * ib + 4, 4);
            sc[2 * ib] = sc[2 * ib + 1] = (int16_t)(2 * (aux >> 28) + 1);
            for (int l = 0; l < 4; l++)
                dd_iq_put8(q, sgn, 4 * ib + l, DD_IQ2XXS_AT, blk[2 + 8 * ib + l], dd_iq_ksign((aux >> (7 * l)) & 127));
        }
        *d = dd_f16_to_f32(dd_load_u16(blk)) * 0.125f;
        break;
    case DD_IQ2_XS:
        for (int ib = 0; ib < 8; ib++) {
            sc[2 * ib] = (int16_t)(2 * (blk[66 + ib] & 15) + 1);
            sc[2 * ib + 1] = (int16_t)(2 * (blk[66 + ib] >> 4) + 1);
            for (int l = 0; l < 4; l++) {
                const uint16_t v = dd_load_u16(blk + 2 + 2 * (4 * ib + l));
                dd_iq_put8(q, sgn, 4 * ib + l, DD_IQ2XS_AT, v & 511, dd_iq_ksign(v >> 9));
            }
        }
        *d = dd_f16_to_f32(dd_load_u16(blk)) * 0.125f;
        break;
    case DD_IQ2_S:
        for (int ib = 0; ib < 8; ib++) {
            sc[2 * ib] = (int16_t)(2 * (blk[74 + ib] & 15) + 1);
            sc[2 * ib + 1] = (int16_t)(2 * (blk[74 + ib] >> 4) + 1);
            for (int l = 0; l < 4; l++)
                dd_iq_put8(q, sgn, 4 * ib + l, DD_IQ2S_AT, blk[2 + 4 * ib + l] | ((blk[66 + ib] >> (2 * l)) & 3) << 8,
                           blk[34 + 4 * ib + l]);
        }
        *d = dd_f16_to_f32(dd_load_u16(blk)) * 0.125f;
        break;
    case DD_IQ3_XXS:
        for (int ib = 0; ib < 8; ib++) {
            uint32_t aux;
            memcpy(&aux, blk + 66 + 4 * ib, 4);
            sc[2 * ib] = sc[2 * ib + 1] = (int16_t)(2 * (aux >> 28) + 1);
            for (int l = 0; l < 4; l++)
                dd_iq_put4x2(q, sgn, 4 * ib + l, DD_IQ3XXS_AT, blk[2 + 8 * ib + 2 * l], blk[2 + 8 * ib + 2 * l + 1],
                             dd_iq_ksign((aux >> (7 * l)) & 127));
        }
        *d = dd_f16_to_f32(dd_load_u16(blk)) * 0.25f;
        break;
    case DD_IQ3_S:
        for (int ib = 0; ib < 8; ib++) {
            sc[2 * ib] = sc[2 * ib + 1] = (int16_t)(2 * ((blk[106 + ib / 2] >> (4 * (ib % 2))) & 15) + 1);
            const int h = blk[66 + ib];
            for (int l = 0; l < 4; l++)
                dd_iq_put4x2(q, sgn, 4 * ib + l, DD_IQ3S_AT, blk[2 + 8 * ib + 2 * l] | ((h >> (2 * l)) & 1) << 8,
                             blk[2 + 8 * ib + 2 * l + 1] | ((h >> (2 * l + 1)) & 1) << 8, blk[74 + 4 * ib + l]);
        }
        *d = dd_f16_to_f32(dd_load_u16(blk));
        break;
    case DD_IQ1_S:
        for (int ib = 0; ib < 8; ib++) {
            const uint16_t h = dd_load_u16(blk + 34 + 2 * ib);
            sc[2 * ib] = sc[2 * ib + 1] = (int16_t)(2 * ((h >> 12) & 7) + 1);
            for (int l = 0; l < 4; l++)   /* delta's sign bit set: -1/8, the code 8g - 1 */
                dd_iq_put8(q, sgn, 4 * ib + l, DD_IQ1S_AT, blk[2 + 4 * ib + l] | ((h >> (3 * l)) & 7) << 8,
                           h & 0x8000 ? 0xff : 0);
        }
        *d = dd_f16_to_f32(dd_load_u16(blk)) * 0.125f;
        break;
    default: {   /* DD_IQ1_M */
        uint16_t s[4];
        memcpy(s, blk + 48, 8);
        for (int h = 0; h < 16; h++)
            sc[h] = (int16_t)(2 * ((s[h / 4] >> (3 * (h % 4))) & 7) + 1);
        for (int e = 0; e < 32; e++) {
            const int nib = (blk[32 + e / 2] >> (4 * (e % 2))) & 15;
            dd_iq_put8(q, sgn, e, DD_IQ1S_AT, blk[e] | (nib & 7) << 8, nib & 8 ? 0xff : 0);
        }
        const uint16_t dbits = (uint16_t)((s[0] >> 12) | ((s[1] >> 8) & 0x00f0) | ((s[2] >> 4) & 0x0f00) | (s[3] & 0xf000));
        *d = dd_f16_to_f32(dbits) * 0.125f;
        break;
    }
    }
    dd_iq_signs(q, sgn, wtype == DD_IQ1_S || wtype == DD_IQ1_M ? 0
                        : 2 * (wtype == DD_IQ3_XXS ? DD_IQ3XXS_OFF : wtype == DD_IQ3_S ? DD_IQ3S_OFF : DD_IQ2_OFF));
}

#endif
