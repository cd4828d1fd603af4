/* Kernels for the low-bit super-block types (Q2_K, Q3_K, and the IQ types of iquants.h) read as stored (no conversion at load),
 * against Q8_0 activations. One definition, included by every kernel file after it defines its
 * integer dot product DD_LB_DOT8 (the contract of kquants.h's DD_KQ_DOT8, with weights of up to
 * 127: no pmaddubsw pair exceeds 2 * 127 * 127); the levels differ only in that instruction choice.
 * (The AVX-512 level reads Q2_K and Q3_K in registers instead, lowbit_avx512.h, the same bits: it defines
 * DD_LB_K_IN_REGISTERS; from 6 columns, and for the IQ types from 2, its rows expand once per call for
 * kq_gemm_avx512.h's walk where they fit KQX_FITS.)
 *
 * Super-block layouts (ggml-common.h block_q2_K, block_q3_K; values as ggml-quants.c
 * dequantize_row_q2_K / _q3_K; the engine's numpy twin is checked against gguf-py's decoder):
 *   block_q2_K (84 bytes, 256 values): scales[16], qs[64], f16 d, f16 dmin. Value v = 128n + 32j + l
 *     (n < 2, j < 4, l < 32) has q = (qs[32n + l] >> 2j) & 3; scales[v / 16] holds its scale (low
 *     nibble) and min (high nibble): x = d * sc * q - dmin * mn.
 *   block_q3_K (110 bytes): hmask[32], qs[64], scales[12], f16 d. Value v as above has the two low
 *     bits (qs[32n + l] >> 2j) & 3 and the high bit (hmask[l] >> (4n + j)) & 1: u = low | high << 2
 *     in 0..7; 6-bit scale s_i (i = v / 16) = (scales[i % 8] >> 4 (i / 8)) & 15 | ((scales[8 + i % 4]
 *     >> 2 (i / 4)) & 3) << 4; x = d * (s_i - 32) * (u - 4).
 *
 * Exactness. A super-block is unpacked to unsigned bytes u (value + off,
 * off = 0 for Q2_K, 4 for Q3_K, iquants.h's for the IQ types), integer scales sc and (Q2_K) mins mn per 16
 * values; the IQ types' d is their f16 d times a power of two (exact). Activation
 * block b (32 values, scale da, half sums s16) meets values 32b .. 32b + 31: the integer part
 *   I_b = sum over its halves h of sc_h * (sum(u a) - off * s16_h),  M_b = sum_h mn_h * s16_h
 * is exact in int32, scaled by the exact f32 products d * da (and dmin * da) into exact f64 products
 * that lane b % 8 of the (row, column) accumulator adds (then subtracts (dmin da) M_b). The 8 lanes
 * are added in a fixed tree and rounded to f32 once. Every level runs these f64 operations in this
 * order, so results are bit-identical across levels, thread counts and tiles, and equal the numpy
 * twin (engine.kernels.cpu_twins.lowbit_product_np), which replays the same order.
 */
#ifndef DELTADESK_LOWBIT_H
#define DELTADESK_LOWBIT_H

#include "gemm_tiles.h"
#include "iquants.h"
#include "kernels.h"

#ifndef DD_LB_DOT8
#error "define DD_LB_DOT8 before including lowbit.h"
#endif

/* The IQ unpacker: iquants.h's, unless the level brings its own of the same bytes (iquants_avx512.h). */
#ifndef DD_IQ_UNPACK
#define DD_IQ_UNPACK dd_iq_unpack
#endif

/* Up to 4 rows of one super-block unpacked (see the exactness note). */
typedef struct {
    uint8_t q[4][DD_QK_K];
    int16_t sc[4][16];
    int16_t mn[4][16];
    float d[4], dmin[4];
} dd_lb_rows;

DD_INLINE size_t dd_lb_bytes(int wtype)
{
    switch (wtype) {
    case DD_Q2_K: return DD_Q2_K_BYTES;
    case DD_Q3_K: return DD_Q3_K_BYTES;
    case DD_IQ2_XXS: return DD_IQ2_XXS_BYTES;
    case DD_IQ2_XS: return DD_IQ2_XS_BYTES;
    case DD_IQ2_S: return DD_IQ2_S_BYTES;
    case DD_IQ3_XXS: return DD_IQ3_XXS_BYTES;
    case DD_IQ3_S: return DD_IQ3_S_BYTES;
    case DD_IQ1_S: return DD_IQ1_S_BYTES;
    default: return DD_IQ1_M_BYTES;
    }
}

/* The offset added to a type's values to make them unsigned. */
DD_INLINE int dd_lb_offset(int wtype)
{
    switch (wtype) {
    case DD_Q2_K: return 0;
    case DD_Q3_K: return 4;
    case DD_IQ2_XXS: case DD_IQ2_XS: case DD_IQ2_S: return DD_IQ2_OFF;
    case DD_IQ3_XXS: return DD_IQ3XXS_OFF;
    case DD_IQ3_S: return DD_IQ3S_OFF;
    default: return DD_IQ1_OFF;
    }
}

DD_INLINE void dd_lb_unpack_q2_K(const uint8_t *blk, dd_lb_rows *u, int r)
{
    const uint8_t *sc = blk, *qs = blk + 16;
    uint8_t *q = u->q[r];
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                q[128 * n + 32 * j + l] = (uint8_t)((qs[32 * n + l] >> (2 * j)) & 3);
    for (int i = 0; i < 16; i++) {
        u->sc[r][i] = (int16_t)(sc[i] & 15);
        u->mn[r][i] = (int16_t)(sc[i] >> 4);
    }
    u->d[r] = dd_f16_to_f32(dd_load_u16(blk + 80));
    u->dmin[r] = dd_f16_to_f32(dd_load_u16(blk + 82));
}

DD_INLINE void dd_lb_unpack_q3_K(const uint8_t *blk, dd_lb_rows *u, int r)
{
    const uint8_t *hm = blk, *qs = blk + 32, *sc = blk + 96;
    uint8_t *q = u->q[r];
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                q[128 * n + 32 * j + l] = (uint8_t)(((qs[32 * n + l] >> (2 * j)) & 3) |
                                                    (((hm[l] >> (4 * n + j)) & 1) << 2));
    for (int i = 0; i < 16; i++) {
        const int s = ((sc[i % 8] >> (4 * (i / 8))) & 15) | (((sc[8 + i % 4] >> (2 * (i / 4))) & 3) << 4);
        u->sc[r][i] = (int16_t)(s - 32);
    }
    u->d[r] = dd_f16_to_f32(dd_load_u16(blk + 108));
}

DD_INLINE void dd_lb_unpack(const uint8_t *blk, int wtype, dd_lb_rows *u, int r)
{
    if (wtype == DD_Q2_K)
        dd_lb_unpack_q2_K(blk, u, r);
    else if (wtype == DD_Q3_K)
        dd_lb_unpack_q3_K(blk, u, r);
    else
        DD_IQ_UNPACK(blk, wtype, u->q[r], u->sc[r], &u->d[r]);
}

/* acc += the f64 terms of row r of u against the column's activation blocks b0 .. b0 + 7 (a level may bring
 * its own of the same operations for the IQ types: DD_LB_TERMS). */
DD_INLINE void dd_lb_terms(const dd_lb_rows *u, int r, const dd_acts *a, size_t b0, dd_v8f da, int wtype,
                           dd_v8d *acc)
{
    const int32_t *s16 = a->s16 + 2 * b0;
    const int16_t *sc = u->sc[r], *mn = u->mn[r];
    const int off = dd_lb_offset(wtype);
    int32_t d8[8];
    DD_LB_DOT8(u->q[r], a->q + b0 * DD_QK, sc, d8);
    dd_v8i dot, mb;
    for (int i = 0; i < 8; i++)
        dot[i] = d8[i] - off * (sc[2 * i] * s16[2 * i] + sc[2 * i + 1] * s16[2 * i + 1]);
    /* lane i: (d da_i) I_i, exact in f64; then (Q2_K) minus (dmin da_i) M_i */
    *acc += __builtin_convertvector(da * u->d[r], dd_v8d) * __builtin_convertvector(dot, dd_v8d);
    if (wtype == DD_Q2_K) {
        for (int i = 0; i < 8; i++)
            mb[i] = mn[2 * i] * s16[2 * i] + mn[2 * i + 1] * s16[2 * i + 1];
        *acc -= __builtin_convertvector(da * u->dmin[r], dd_v8d) * __builtin_convertvector(mb, dd_v8d);
    }
}

#ifndef DD_LB_TERMS
#define DD_LB_TERMS dd_lb_terms
#endif

/* Rows [0, R) x columns [c0, c0 + C): each super-block of the R rows unpacked, then met by the C columns (a GEMV
 * tile goes to the level's DD_LB_GEMV where it has one and takes the type: the same bits). */
DD_INLINE void dd_lb_tile(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, int wtype, size_t c0,
                          float *y, size_t ldy, const int R, const int C)
{
#ifdef DD_LB_GEMV
    if (C == 1 && a->m == 1 && DD_LB_GEMV(w, pf, rb, a, wtype, y, R))
        return;
#endif
    const size_t bytes = dd_lb_bytes(wtype), nsb = a->nb / 8;
    dd_lb_rows u;
    dd_v8d acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = (dd_v8d){ 0 };
    for (size_t sb = 0; sb < nsb; sb++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *p = pf + r * rb + sb * bytes;   /* every line: 84 or 110 bytes may span three */
            for (size_t at = 0; at < bytes; at += 64)
                dd_prefetch_weight(p + at);
            dd_prefetch_weight(p + bytes - 1);
            dd_lb_unpack(w + r * rb + sb * bytes, wtype, &u, r);
        }
        for (int c = 0; c < C; c++) {
            const size_t b0 = (c0 + c) * a->nbp + 8 * sb;
            dd_v8f da;
            memcpy(&da, a->bd + b0, sizeof da);
            for (int r = 0; r < R; r++)
                DD_LB_TERMS(&u, r, a, b0, da, wtype, &acc[r][c]);
        }
    }
    dd_store_lanes(acc, c0, y, ldy, R, C);
}

/* ---- m > 1: a row range unpacked once per call (kquants.h's dd_kq_gemm_unpacked, the same bits) ---- */
#define DD_LB_SCRATCH (192 * 1024)
#define DD_LB_SCRATCH_SB (DD_LB_SCRATCH / sizeof(dd_lb_rows))
#define DD_LB_FITS(a) ((a)->nb / 8 <= DD_LB_SCRATCH_SB)

DD_INLINE void dd_lb_unpacked_tile(const dd_lb_rows *e, int s0, size_t nsb, const dd_acts *a, int wtype, size_t c0,
                                   float *y, size_t ldy, const int R, const int C)
{
    dd_v8d acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = (dd_v8d){ 0 };
    for (size_t sb = 0; sb < nsb; sb++)
        for (int c = 0; c < C; c++) {
            const size_t b0 = (c0 + c) * a->nbp + 8 * sb;
            dd_v8f da;
            memcpy(&da, a->bd + b0, sizeof da);
            for (int r = 0; r < R; r++)
                DD_LB_TERMS(&e[sb], s0 + r, a, b0, da, wtype, &acc[r][c]);
        }
    dd_store_lanes(acc, c0, y, ldy, R, C);
}

DD_INLINE void dd_lb_unpacked_cols(const dd_lb_rows *e, int s0, size_t nsb, const dd_acts *a, int wtype, size_t c0,
                                   size_t c1, float *y, size_t ldy, const int R)
{
    size_t c = c0;
    for (; c + 4 <= c1; c += 4)
        dd_lb_unpacked_tile(e, s0, nsb, a, wtype, c, y, ldy, R, 4);
    switch (c1 - c) {
    case 3: dd_lb_unpacked_tile(e, s0, nsb, a, wtype, c, y, ldy, R, 3); break;
    case 2: dd_lb_unpacked_tile(e, s0, nsb, a, wtype, c, y, ldy, R, 2); break;
    case 1: dd_lb_unpacked_tile(e, s0, nsb, a, wtype, c, y, ldy, R, 1); break;
    default: break;
    }
}

/* Rows [0, nrows) x all columns: ranges of rows unpacked once (row r of a range in slot r % 4 of
 * e[r / 4 * nsb + sb]), then walked in column blocks of DD_GEMM_BLOCK_COLS and 2-row tiles. */
DD_INLINE void dd_lb_gemm_unpacked(const uint8_t *w, size_t rb, size_t nrows, const dd_acts *a, float *y, size_t ldy,
                                   int wtype)
{
    dd_lb_rows e[DD_LB_SCRATCH_SB];
    const size_t nsb = a->nb / 8, bytes = dd_lb_bytes(wtype), range = DD_LB_SCRATCH_SB / nsb * 4;
    for (size_t r0 = 0; r0 < nrows; r0 += range) {
        const size_t nr = nrows - r0 < range ? nrows - r0 : range;
        for (size_t r = 0; r < nr; r++)
            for (size_t sb = 0; sb < nsb; sb++)
                dd_lb_unpack(w + (r0 + r) * rb + sb * bytes, wtype, &e[r / 4 * nsb + sb], (int)(r % 4));
        for (size_t c0 = 0; c0 < a->m; c0 += DD_GEMM_BLOCK_COLS) {
            const size_t c1 = a->m - c0 < DD_GEMM_BLOCK_COLS ? a->m : c0 + DD_GEMM_BLOCK_COLS;
            size_t r = 0;
            for (; r + 2 <= nr; r += 2)
                dd_lb_unpacked_cols(e + r / 4 * nsb, (int)(r % 4), nsb, a, wtype, c0, c1, y + r0 + r, ldy, 2);
            if (r < nr)
                dd_lb_unpacked_cols(e + r / 4 * nsb, (int)(r % 4), nsb, a, wtype, c0, c1, y + r0 + r, ldy, 1);
        }
    }
}

#ifdef DD_LB_K_IN_REGISTERS
/* The 16 int16 half values v (half 2i + h: block i's half h) to lanes 8r + i of out[h]. */
DD_INLINE void dd_lb_halves(__m256i v, int r, __m512i out[2])
{
    const __m512i s = _mm512_permutexvar_epi32(_mm512_loadu_si512(kqx_halves_idx), _mm512_cvtepi16_epi32(v));
    int32_t *lanes = (int32_t *)out + 8 * r;
    _mm256_storeu_si256((__m256i *)lanes, _mm512_castsi512_si256(s));
    _mm256_storeu_si256((__m256i *)(lanes + 16), _mm512_extracti64x4_epi64(s, 1));
}

/* Row r (0, 1) of a kqx_rows (kq_gemm_avx512.h) from a super-block: the unsigned values (Q2_K, Q3_K: lb_load_q2 /
 * lb_load_q3's vectors in value order, Q2_K's fourfold ones divided by 4; the IQ types: DD_IQ_UNPACK's), the half
 * scales in lanes 8r + i of sc[h] (Q2_K: the half mins' pairs in lane 8r + i of mn), d and dmin in f64 lanes.
 * kqx_tile then forms dd_lb_terms' I_b = sum_h sc_h (S_h - off s16_h) and M_b = sum_h mn_h s16_h, and the terms
 * (d da_i) I_b and (Q2_K) -(dmin da_i) M_b (exact products either way: 11 significant bits of d and dmin, the
 * f16 da), in the same order: the bits of the tiles. */
DD_INLINE void dd_lb_expand_row(const uint8_t *blk, int wtype, int r, kqx_rows *e)
{
    __m512i x[4];
    if (wtype == DD_Q2_K || wtype == DD_Q3_K) {
        lb_row u;
        if (wtype == DD_Q2_K) {
            lb_load_q2(blk, &u);
            u.w[1] = _mm512_srli_epi16(u.w[1], 2);   /* 4 q, bits 2-3 of each byte: exact */
            u.w[3] = _mm512_srli_epi16(u.w[3], 2);
            _mm256_storeu_si256((__m256i *)((int32_t *)&e->mn + 8 * r), u.mn);   /* int16 lanes 2i, 2i + 1 */
        } else {
            lb_load_q3(blk, &u);
        }
        for (int v = 0; v < 2; v++) {   /* values 64v .., 128 + 64v ..: the low, high halves of w[2v], w[2v + 1] */
            x[v] = _mm512_shuffle_i64x2(u.w[2 * v], u.w[2 * v + 1], _MM_SHUFFLE(1, 0, 1, 0));
            x[2 + v] = _mm512_shuffle_i64x2(u.w[2 * v], u.w[2 * v + 1], _MM_SHUFFLE(3, 2, 3, 2));
        }
        dd_lb_halves(u.sc, r, e->sc);
        e->s[r][0] = _mm512_set1_pd(_mm256_cvtss_f32(u.d));
        e->s[r][1] = _mm512_set1_pd(wtype == DD_Q2_K ? _mm256_cvtss_f32(u.dmin) : 0.0);
    } else {
        uint8_t q[DD_QK_K] __attribute__((aligned(64)));
        int16_t sc[16];
        float d;
        DD_IQ_UNPACK(blk, wtype, q, sc, &d);
        for (int v = 0; v < 4; v++)
            x[v] = _mm512_load_si512(q + 64 * v);
        dd_lb_halves(_mm256_loadu_si256((const __m256i *)sc), r, e->sc);
        e->s[r][0] = _mm512_set1_pd(d);
        e->s[r][1] = _mm512_setzero_pd();
    }
    kqx_transpose(x, 0, (uint8_t *)e->q + 32 * r, sizeof(__m512i));
}

#endif

/* A type's product by its tiles (one column) or its rows unpacked once per call (dd_lb_gemm_unpacked). */
#define DD_LB_UNPACKED_GEMM(NAME, WTYPE)                                                          \
    DD_INLINE void NAME##_tile(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, size_t c0, \
                               float *y, size_t ldy, const int R, const int C)                        \
    {                                                                                             \
        dd_lb_tile(w, pf, rb, a, WTYPE, c0, y, ldy, R, C);                                        \
    }                                                                                             \
    DD_INLINE void NAME##_unpacked(const uint8_t *w, size_t rb, size_t n, const dd_acts *a, float *y, size_t ldy) \
    {                                                                                             \
        dd_lb_gemm_unpacked(w, rb, n, a, y, ldy, WTYPE);                                          \
    }                                                                                             \
    DD_DEFINE_GEMM(NAME##_tiles, NAME##_tile)                                                     \
    DD_DEFINE_GEMM_SPLIT(NAME, NAME##_tiles, DD_LB_FITS, NAME##_unpacked)

#ifdef DD_LB_K_IN_REGISTERS
/* From 2 columns, rows the expanded-row GEMM holds expand once per call for the K-quant walk instead. */
#define DD_LB_GEMM_OF(NAME, WTYPE)              \
    DD_LB_UNPACKED_GEMM(NAME##_rest, WTYPE)     \
    KQX_GEMM_FROM(NAME, WTYPE, 2, NAME##_rest)
#else
#define DD_LB_GEMM_OF(NAME, WTYPE) DD_LB_UNPACKED_GEMM(NAME, WTYPE)
#endif

#ifndef DD_LB_K_IN_REGISTERS
DD_LB_GEMM_OF(gemm_q2_K, DD_Q2_K)
DD_LB_GEMM_OF(gemm_q3_K, DD_Q3_K)
/* The kernel table's entries for Q2_K and Q3_K, in enum order. */
#define DD_LB_GEMMS gemm_q2_K, gemm_q3_K
#endif
DD_LB_GEMM_OF(gemm_iq2_xxs, DD_IQ2_XXS)
DD_LB_GEMM_OF(gemm_iq2_xs, DD_IQ2_XS)
DD_LB_GEMM_OF(gemm_iq2_s, DD_IQ2_S)
DD_LB_GEMM_OF(gemm_iq3_xxs, DD_IQ3_XXS)
DD_LB_GEMM_OF(gemm_iq3_s, DD_IQ3_S)
DD_LB_GEMM_OF(gemm_iq1_s, DD_IQ1_S)
DD_LB_GEMM_OF(gemm_iq1_m, DD_IQ1_M)

/* The kernel table's entries for the IQ types, in enum order (DD_IQ2_XXS .. DD_IQ1_M). */
#define DD_IQ_GEMMS gemm_iq2_xxs, gemm_iq2_xs, gemm_iq2_s, gemm_iq3_xxs, gemm_iq3_s, gemm_iq1_s, gemm_iq1_m

#endif
