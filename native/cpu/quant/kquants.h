/* K-quant weight kernels (Q4_K, Q5_K, Q6_K) that read the stored super-blocks directly, against
 * Q8_0 activations: one definition, included by the scalar, SSSE3 and AVX2 kernel files after each
 * defines its integer dot product DD_KQ_DOT8 (the only ISA-specific part), so these levels differ in
 * that instruction choice only (AVX-512 has its own register tile, with the same f32 operations).
 *
 * Super-block layouts (ggml-common.h; values and scales as ggml-quants.c dequantize_row_q*_K):
 *   block_q4_K (144 bytes, 256 values): f16 d, f16 dmin, scales[12], qs[128]. Sub-block i (32 values)
 *     has 6-bit scale sc_i and min m_i packed in scales (get_scale_min_k4); chunk j = 0..3 of 64
 *     values: value l < 32 is the low nibble of qs[32j + l] (sub-block 2j), value 32 + l its high
 *     nibble (sub-block 2j + 1); x = d * sc_i * q - dmin * m_i.
 *   block_q5_K (176 bytes): f16 d, f16 dmin, scales[12], qh[32], qs[128]; as Q4_K with a fifth bit:
 *     bit 2j of qh[l] for value l of chunk j, bit 2j + 1 for value 32 + l.
 *   block_q6_K (210 bytes): ql[128], qh[64], int8 scales[16], f16 d. Half n = 0, 1 of 128 values,
 *     l < 32: q(l) = ql[l] low | qh[l] bits 0-1 << 4, q(32 + l) = ql[32 + l] low | bits 2-3,
 *     q(64 + l) = ql[l] high | bits 4-5, q(96 + l) = ql[32 + l] high | bits 6-7 (ql += 64, qh += 32
 *     per half); x = d * scales[v / 16] * (q - 32).
 *
 * The f32 contract. An activation block b (32 values a_j, f32 scale da, sum bs) meets sub-block b of the
 * weights; its integer parts are exact in int32: Q4_K/Q5_K S = sum(q a) (|S| < 2^17); Q6_K
 * I = sum over its two 16-value halves h of sc_h (sum(q a) - 32 sum(a)) (|I| <= 2 * 128 * 16 * 32 * 127 < 2^24).
 * Its terms, each f32 operation rounded on its own (a multiply then an add, never fused):
 *   Q4_K/Q5_K  t = ((d sc) da) S, the product d sc exact (17 bits), then rounded once with da, then once
 *              with S; u = (dmin m)(da bs), both factors exact (17 and 23 bits), rounded once;
 *   Q6_K       t = (d da) I, d da exact (22 bits), rounded once.
 * Lane b % 8 of the (row, column) accumulator, from +0, adds t (then subtracts u) super-block by
 * super-block; the 8 lanes are added as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). This order shows
 * in the bits, so every level, tile and thread count follows it exactly (AVX-512's kq_tile_avx512.h,
 * kq_gemm_avx512.h, kqh_few_avx512.h, q4k_il_avx512.h; and engine.kernels.cpu_twins' numpy twin). A high
 * nibble's 16 S (a kernel that masks and does not shift) meets ((d sc) da) / 16: the same product. Error:
 * at most 2 + 2 nsb + 3 roundings a term, |y - exact| <= gamma(2 nsb + 5) sum(|t| + |u|), gamma(n) =
 * n 2^-24 / (1 - n 2^-24) (docs/design/native-cpu.md).
 */
#ifndef DELTADESK_KQUANTS_H
#define DELTADESK_KQUANTS_H

#include "gemm_tiles.h"
#include "kernels.h"

/* A level defines DD_KQ_DOT8(w, a, sc, out): for the 8 consecutive 32-value blocks of a super-block
 * unpacked to bytes (w, value order),
 *   out[i] = sc[2i] * sum_{j<16} w[32i + j] a[32i + j] + sc[2i+1] * sum_{16<=j<32} w[32i + j] a[32i + j]
 * with w unsigned (0..63), a signed int8, sc int16 in -128..127 (no int16 overflow: pairs of
 * products stay within 2 * 63 * 128). (The AVX-512 level has its own register tile in
 * kernels_avx512vnni.c and does not include this file.) */
#ifndef DD_KQ_DOT8
#error "define DD_KQ_DOT8 before including kquants.h"
#endif


/* One super-block of up to 4 rows unpacked: unsigned quants in value order; Q6_K its integer scales
 * (per 16 values) and d; Q4_K / Q5_K scales of 1 for DD_KQ_DOT8 (which then gives S) and the exact
 * f32 products d sc and dmin m (per 32 values). */
typedef struct {
    uint8_t q[4][DD_QK_K];
    int16_t sc[4][16];
    dd_v8f dsc[4], dmm[4];
    float d[4];
} dd_kq_rows;

/* The scales of a super-block's row r. */
DD_INLINE void dd_kq_scales(const uint8_t *blk, int wtype, dd_kq_rows *u, int r)
{
    if (wtype == DD_Q6_K) {
        for (int i = 0; i < 16; i++)
            u->sc[r][i] = (int8_t)blk[192 + i];
        u->d[r] = dd_f16_to_f32(dd_load_u16(blk + 208));
        return;
    }
    uint32_t w[4];
    dd_kq_scale_words(blk, w);
    const float d = dd_f16_to_f32(dd_load_u16(blk)), dmin = dd_f16_to_f32(dd_load_u16(blk + 2));
    for (int i = 0; i < 8; i++) {
        u->sc[r][2 * i] = u->sc[r][2 * i + 1] = 1;
        u->dsc[r][i] = d * (float)((w[i / 4] >> (8 * (i % 4))) & 0xff);
        u->dmm[r][i] = dmin * (float)((w[2 + i / 4] >> (8 * (i % 4))) & 0xff);
    }
}

/* The unsigned quants of a super-block in value order, into u->q[r]. */
DD_INLINE void dd_kq_quants(const uint8_t *blk, int wtype, dd_kq_rows *u, int r)
{
    uint8_t *q = u->q[r];
    if (wtype == DD_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        for (int n = 0; n < 2; n++, ql += 64, qh += 32, q += 128)
            for (int l = 0; l < 32; l++) {
                q[l] = (uint8_t)((ql[l] & 0x0f) | ((qh[l] & 3) << 4));
                q[l + 32] = (uint8_t)((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4));
                q[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                q[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        return;
    }
    const uint8_t *qs = blk + (wtype == DD_Q5_K ? 48 : 16), *qh = blk + 16;
    for (int j = 0; j < 4; j++, qs += 32, q += 64) {
        for (int l = 0; l < 32; l++) {
            q[l] = qs[l] & 0x0f;
            q[l + 32] = qs[l] >> 4;
        }
        if (wtype == DD_Q5_K)
            for (int l = 0; l < 32; l++) {
                q[l] |= (uint8_t)(((qh[l] >> (2 * j)) & 1) << 4);
                q[l + 32] |= (uint8_t)(((qh[l] >> (2 * j + 1)) & 1) << 4);
            }
    }
}

DD_INLINE size_t dd_kq_bytes(int wtype)
{
    return wtype == DD_Q4_K ? DD_Q4_K_BYTES : wtype == DD_Q5_K ? DD_Q5_K_BYTES : DD_Q6_K_BYTES;
}

/* Prefetch every cache line of a super-block of `bytes` wherever it starts. */
DD_INLINE void dd_kq_prefetch(const uint8_t *p, size_t bytes)
{
    for (size_t at = 0; at < bytes; at += 64)
        dd_prefetch_weight(p + at);
    dd_prefetch_weight(p + bytes - 1);
}

/* y[(c0 + c) * ldy + r] for R x C accumulators of 8 f32 lanes in block order: the contract's tree. */
DD_INLINE void dd_kq_store(dd_v8f acc[4][4], size_t c0, float *y, size_t ldy, const int R, const int C)
{
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const dd_v8f s = acc[r][c];
            y[(c0 + c) * ldy + r] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        }
}

/* acc += the f32 terms of row r of u's super-block against the column's activation blocks b0 .. b0 + 7
 * (scales da, sums bs, half sums s16), in the order of the contract above. */
DD_INLINE void dd_kq_terms(const dd_kq_rows *u, int r, const dd_acts *a, size_t b0, const int32_t *s16, dd_v8f da,
                           dd_v8i bs, int wtype, dd_v8f *acc)
{
    int32_t d8[8];
    DD_KQ_DOT8(u->q[r], a->q + b0 * DD_QK, u->sc[r], d8);
    if (wtype == DD_Q6_K) {
        const int16_t *sc = u->sc[r];
        for (int i = 0; i < 8; i++)
            d8[i] -= 32 * (sc[2 * i] * s16[2 * i] + sc[2 * i + 1] * s16[2 * i + 1]);
    }
    dd_v8i dot;
    memcpy(&dot, d8, sizeof dot);
    const dd_v8f t = __builtin_convertvector(dot, dd_v8f);
    if (wtype == DD_Q6_K) {
        *acc += (da * u->d[r]) * t;
        return;
    }
    *acc += (u->dsc[r] * da) * t;
    *acc -= u->dmm[r] * (da * __builtin_convertvector(bs, dd_v8f));
}

DD_INLINE void dd_kq_tile(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, int wtype, size_t c0,
                          float *y, size_t ldy, const int R, const int C)
{
    const size_t bytes = dd_kq_bytes(wtype), nsb = a->nb / 8;
    dd_kq_rows u;
    dd_v8f acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = (dd_v8f){ 0 };
    for (size_t sb = 0; sb < nsb; sb++) {
        for (int r = 0; r < R; r++) {
            dd_kq_prefetch(pf + r * rb + sb * bytes, bytes);
            dd_kq_scales(w + r * rb + sb * bytes, wtype, &u, r);
            dd_kq_quants(w + r * rb + sb * bytes, wtype, &u, r);
        }
        for (int c = 0; c < C; c++) {
            const size_t b0 = (c0 + c) * a->nbp + 8 * sb;
            dd_v8f da;
            memcpy(&da, a->bd + b0, sizeof da);
            dd_v8i bs;
            memcpy(&bs, a->bs + b0, sizeof bs);
            for (int r = 0; r < R; r++)
                dd_kq_terms(&u, r, a, b0, a->s16 + 2 * b0, da, bs, wtype, &acc[r][c]);
        }
    }
    dd_kq_store(acc, c0, y, ldy, R, C);
}

/* ---- m > 1: each row's super-blocks unpacked once per call --------------------------------
 * dd_kq_tile unpacks a super-block again for every 4-column tile (128 times in a 512-column
 * product). For m > 1 a row range is unpacked once, four rows to a dd_kq_rows per super-block, into
 * DD_KQ_SCRATCH bytes on the stack (a caller's range, ~64 KiB of stored weights by
 * dd_gemm_chunk_rows, unpacks to ~164 KiB: it stays in L2) and meets every column block from there
 * through dd_kq_terms, in dd_kq_tile's order: the same bits. A row longer than the scratch holds
 * for four rows keeps dd_kq_tile's walk. */
#define DD_KQ_SCRATCH (192 * 1024)
#define DD_KQ_SCRATCH_SB (DD_KQ_SCRATCH / sizeof(dd_kq_rows))
#define DD_KQ_FITS(a) ((a)->nb / 8 <= DD_KQ_SCRATCH_SB)
/* A level may define DD_KQ_WALK_ONLY to keep dd_kq_tile's walk for m > 1 as well. SSSE3 does: GCC's
 * code for the unpacked Q6_K tile there ran 2.7x slower than the walk (C harness, Q6_K 512 x 2048,
 * m = 64, thread CPU time: 18.8 ms vs 6.8) and its Q4_K gained 2 %. The scalar level does: with the
 * split its Q6_K GEMV (m = 1) compiled ~12 % slower, for a 13 % gain at m = 64. */

/* Rows s0 .. s0 + R - 1 of the unpacked quads e (super-block sb at e[sb]) x columns [c0, c0 + C). */
DD_INLINE void dd_kq_unpacked_tile(const dd_kq_rows *e, int s0, size_t nsb, const dd_acts *a, int wtype,
                                   size_t c0, float *y, size_t ldy, const int R, const int C)
{
    dd_v8f acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = (dd_v8f){ 0 };
    for (size_t sb = 0; sb < nsb; sb++) {
        const dd_kq_rows *u = &e[sb];
        for (int c = 0; c < C; c++) {
            const size_t b0 = (c0 + c) * a->nbp + 8 * sb;
            dd_v8f da;
            memcpy(&da, a->bd + b0, sizeof da);
            dd_v8i bs;
            memcpy(&bs, a->bs + b0, sizeof bs);
            for (int r = 0; r < R; r++)
                dd_kq_terms(u, s0 + r, a, b0, a->s16 + 2 * b0, da, bs, wtype, &acc[r][c]);
        }
    }
    dd_kq_store(acc, c0, y, ldy, R, C);
}

/* Unpacked rows s0 .. s0 + R - 1 against columns [c0, c1): 4-column tiles, then the 1-3 left over. */
DD_INLINE void dd_kq_unpacked_cols(const dd_kq_rows *e, int s0, size_t nsb, const dd_acts *a, int wtype,
                                   size_t c0, size_t c1, float *y, size_t ldy, const int R)
{
    size_t c = c0;
    for (; c + 4 <= c1; c += 4)
        dd_kq_unpacked_tile(e, s0, nsb, a, wtype, c, y, ldy, R, 4);
    switch (c1 - c) {
    case 3: dd_kq_unpacked_tile(e, s0, nsb, a, wtype, c, y, ldy, R, 3); break;
    case 2: dd_kq_unpacked_tile(e, s0, nsb, a, wtype, c, y, ldy, R, 2); break;
    case 1: dd_kq_unpacked_tile(e, s0, nsb, a, wtype, c, y, ldy, R, 1); break;
    default: break;
    }
}

/* Rows [0, nrows) x all columns: ranges of rows unpacked once (row r of a range in slot r % 4 of
 * e[r / 4 * nsb + sb]), then walked in column blocks of DD_GEMM_BLOCK_COLS (their activations stay
 * in L2) and 2-row tiles. */
DD_INLINE void dd_kq_gemm_unpacked(const uint8_t *w, size_t rb, size_t nrows, const dd_acts *a, float *y,
                                   size_t ldy, int wtype)
{
    dd_kq_rows e[DD_KQ_SCRATCH_SB];
    const size_t nsb = a->nb / 8, bytes = dd_kq_bytes(wtype), range = DD_KQ_SCRATCH_SB / nsb * 4;
    for (size_t r0 = 0; r0 < nrows; r0 += range) {
        const size_t nr = nrows - r0 < range ? nrows - r0 : range;
        for (size_t r = 0; r < nr; r++)
            for (size_t sb = 0; sb < nsb; sb++) {
                dd_kq_scales(w + (r0 + r) * rb + sb * bytes, wtype, &e[r / 4 * nsb + sb], (int)(r % 4));
                dd_kq_quants(w + (r0 + r) * rb + sb * bytes, wtype, &e[r / 4 * nsb + sb], (int)(r % 4));
            }
        for (size_t c0 = 0; c0 < a->m; c0 += DD_GEMM_BLOCK_COLS) {
            const size_t c1 = a->m - c0 < DD_GEMM_BLOCK_COLS ? a->m : c0 + DD_GEMM_BLOCK_COLS;
            size_t r = 0;
            for (; r + 2 <= nr; r += 2)
                dd_kq_unpacked_cols(e + r / 4 * nsb, (int)(r % 4), nsb, a, wtype, c0, c1, y + r0 + r, ldy, 2);
            if (r < nr)
                dd_kq_unpacked_cols(e + r / 4 * nsb, (int)(r % 4), nsb, a, wtype, c0, c1, y + r0 + r, ldy, 1);
        }
    }
}

#define DD_KQ_TILE_Q4_K(w, pf, rb, a, c0, y, ldy, R, C) dd_kq_tile(w, pf, rb, a, DD_Q4_K, c0, y, ldy, R, C)
#define DD_KQ_TILE_Q5_K(w, pf, rb, a, c0, y, ldy, R, C) dd_kq_tile(w, pf, rb, a, DD_Q5_K, c0, y, ldy, R, C)
#define DD_KQ_TILE_Q6_K(w, pf, rb, a, c0, y, ldy, R, C) dd_kq_tile(w, pf, rb, a, DD_Q6_K, c0, y, ldy, R, C)
#define DD_KQ_GEMM_Q4_K(w, rb, n, a, y, ldy) dd_kq_gemm_unpacked(w, rb, n, a, y, ldy, DD_Q4_K)
#define DD_KQ_GEMM_Q5_K(w, rb, n, a, y, ldy) dd_kq_gemm_unpacked(w, rb, n, a, y, ldy, DD_Q5_K)
#define DD_KQ_GEMM_Q6_K(w, rb, n, a, y, ldy) dd_kq_gemm_unpacked(w, rb, n, a, y, ldy, DD_Q6_K)

#ifdef DD_KQ_WALK_ONLY
DD_DEFINE_GEMM(gemm_q4_K, DD_KQ_TILE_Q4_K)
DD_DEFINE_GEMM(gemm_q5_K, DD_KQ_TILE_Q5_K)
DD_DEFINE_GEMM(gemm_q6_K, DD_KQ_TILE_Q6_K)
#else
DD_DEFINE_GEMM(dd_kq_tiles_q4_K, DD_KQ_TILE_Q4_K)
DD_DEFINE_GEMM(dd_kq_tiles_q5_K, DD_KQ_TILE_Q5_K)
DD_DEFINE_GEMM(dd_kq_tiles_q6_K, DD_KQ_TILE_Q6_K)
DD_DEFINE_GEMM_SPLIT(gemm_q4_K, dd_kq_tiles_q4_K, DD_KQ_FITS, DD_KQ_GEMM_Q4_K)
DD_DEFINE_GEMM_SPLIT(gemm_q5_K, dd_kq_tiles_q5_K, DD_KQ_FITS, DD_KQ_GEMM_Q5_K)
DD_DEFINE_GEMM_SPLIT(gemm_q6_K, dd_kq_tiles_q6_K, DD_KQ_FITS, DD_KQ_GEMM_Q6_K)
#endif
#endif
