/* The AVX-512 Q4_0 and Q8_0 GEMM (m > 1, prefill) in one-row, eight-column tiles (included by
 * kernels_avx512vnni.c after its group helpers).
 *
 * A call unpacks its rows range by range, once: each stored group becomes 8 vectors of unsigned weight bytes
 * and its 16 scales widened to f32 (q4x_group, 576 bytes for 288 stored Q4_0 or 544 Q8_0 bytes; a range's
 * groups fill at most 192 KiB of the stack and stay in L2). A tile then meets one unpacked row with up to 8
 * columns (group_dot, the scale, the f32 term), its accumulators in registers; the walk takes 8 columns at a time
 * (their activations, ~20 KiB at k = 2048, stay in L1) against every row of the range. Each block's integer dot
 * is exact, so it equals the GEMV tile's (which sums the same products in another order); the scale dw da, the
 * rounded term, its lane and the lanes' tree are the GEMV's (kernels.h's order), so every output keeps the bits
 * of the one-column call.
 */
#ifndef DELTADESK_Q4_GEMM_AVX512_H
#define DELTADESK_Q4_GEMM_AVX512_H

/* The lane layout: block b = 4 (L % 4) + L / 4 of a group sits in int32 lane L, as in the GEMV's tile.
 * Vector t (t = 0..3) holds nibble bytes 4t .. 4t + 3 of every block in its lane, gathered by word
 * permutes from three windows of the group (blocks 0-6 from bytes 0..127, 7-13 from 128..255, 14-15
 * from 224..287); its low and high nibbles meet the activations' values 4t .. 4t + 3 and 16 + 4t ..
 * 19 + 4t of the same blocks (dd_acts groups, m > 1), so 8 vpdpbusd leave each block's exact dot in
 * its own lane, with no reduction between lanes (the GEMV's transpose-add).
 * Word w of vector t, lane L = w / 2, block b = 4 (L % 4) + L / 4: word 9b + 1 + 2t + w % 2 of the group,
 * indexed within its window (words 0..63 of bytes 0..127, 64..127 of 128..255, 112..143 of 224..287).
 * The table is t = 0's; vector t adds 2t. */
static const uint16_t q4_dword_words[32] = {
    1, 2, 37, 38, 9, 10, 45, 46, 10, 11, 46, 47, 18, 19, 54, 55,
    19, 20, 55, 56, 27, 28, 15, 16, 28, 29, 0, 1, 36, 37, 24, 25,
};
#define Q4_WIN_A 0x030f0f0fu   /* words of the lanes of blocks 0-6 */
#define Q4_WIN_C 0xc0c00000u   /* of blocks 14, 15 */

/* A group's weight bytes in lane order (lo[t], hi[t]: values 4t .. 4t + 3 and 16 + 4t .. 19 + 4t of each
 * block, as unsigned bytes: Q4_0 nibbles, Q8_0 int8 + 128) and its scales. Q4_0 gathers them by word permutes;
 * Q8_0 transposes the GEMV's quad vectors (group_quad: block 4j + k in 128-bit lane k of quad j's vectors; the
 * transpose leaves dword t of it in lane 4k + j of vector t). */
DD_INLINE void group_unpack(const uint8_t *p, int wtype, __m512i lo[4], __m512i hi[4], __m512 *dw)
{
    *dw = group_scales(p, wtype);
    if (wtype == DD_Q8_0) {
        for (int j = 0; j < 4; j++)
            group_quad(p, j, wtype, &lo[j], &hi[j]);
        dd_lane_transpose4(lo);
        dd_lane_transpose4(hi);
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0f), idx0 = _mm512_loadu_si512(q4_dword_words);
    const __m512i a0 = _mm512_loadu_si512(p), a1 = _mm512_loadu_si512(p + 64);
    const __m512i b0 = _mm512_loadu_si512(p + 128), b1 = _mm512_loadu_si512(p + 192);
    const __m512i c0 = _mm512_loadu_si512(p + 224);
    for (int t = 0; t < 4; t++) {
        const __m512i idx = _mm512_add_epi16(idx0, _mm512_set1_epi16((short)(2 * t)));
        const __m512i v = _mm512_ternarylogic_epi32(
            _mm512_maskz_permutex2var_epi16(Q4_WIN_A, a0, idx, a1),
            _mm512_maskz_permutex2var_epi16(~(Q4_WIN_A | Q4_WIN_C), b0, idx, b1),
            _mm512_maskz_permutexvar_epi16(Q4_WIN_C, idx, c0), 0xfe);
        lo[t] = _mm512_and_si512(v, low);
        hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
}

/* Column c's exact block dots of group g (the activation bias included), from group_unpack's bytes: two
 * chains of vpdpbusd (values 0-15 and 16-31) added at the end, an exact int32 sum in any order. */
DD_INLINE __m512i group_dot(const __m512i lo[4], const __m512i hi[4], const dd_acts *a, size_t c, size_t g, int wtype)
{
    const int8_t *q = a->gq + (c * a->ng + g) * 8 * 64;
    __m512i dlo = group_bias(a->gbias + (c * a->ng + g) * 16, wtype), dhi = _mm512_setzero_si512();
    for (int t = 0; t < 4; t++) {
        dlo = _mm512_dpbusd_epi32(dlo, lo[t], _mm512_load_si512(q + 128 * t));
        dhi = _mm512_dpbusd_epi32(dhi, hi[t], _mm512_load_si512(q + 128 * t + 64));
    }
    return _mm512_add_epi32(dlo, dhi);
}

#define Q4_WIDE_COLS 8

/* acc[c] += the f32 terms of group g of columns [c0, c0 + C) against one row's group: its bytes (lo, hi)
 * and its 16 scales widened to f32, in lane order. */
DD_INLINE void group_columns(const __m512i lo[4], const __m512i hi[4], __m512 dw, const dd_acts *a,
                             size_t c0, size_t g, int wtype, __m512 acc[Q4_WIDE_COLS], const int C)
{
    /* unrolled: GCC keeps a rolled loop's accumulators on the stack (a load and store per column) */
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) {
        const __m512i dot = group_dot(lo, hi, a, c0 + c, g, wtype);
        acc[c] = acc_f32(acc[c], dot, _mm512_mul_ps(dw, _mm512_load_ps(a->gd + ((c0 + c) * a->ng + g) * 16)));
    }
}

/* One stored group (group_bytes at grp) unpacked: its weight vectors and widened scales. */
typedef struct {
    __m512i lo[4], hi[4];
    __m512 dw;
} q4x_group;

DD_INLINE void q4x_unpack(const uint8_t *grp, int wtype, q4x_group *e)
{
    group_unpack(grp, wtype, e->lo, e->hi, &e->dw);
}

/* Group g of row w unpacked into *e (a short last group padded with zero blocks, as tile_groups: their
 * weights (Q8_0: 128 after the flip) meet zero padding values, bias and scales), prefetching pf's group g if
 * pf is set. */
DD_INLINE void q4x_unpack_group(const uint8_t *w, const uint8_t *pf, const dd_acts *a, size_t g, int wtype,
                                q4x_group *e)
{
    const size_t gb = group_bytes(wtype);
    if (pf != NULL)
        prefetch_group(pf + g * gb, wtype);
    if (g < a->nb / 16) {
        q4x_unpack(w + g * gb, wtype, e);
        return;
    }
    uint8_t tail[Q8_GROUP_BYTES];
    memset(tail, 0, gb);
    memcpy(tail, w + g * gb, (a->nb % 16) * (gb / 16));
    q4x_unpack(tail, wtype, e);
}

/* One row against columns [c0, c0 + C) into y[(c0 + c) * ldy]: from its groups unpacked once per call (e,
 * ng of them) or, if e is NULL, from the stored row w, unpacked here (prefetching pf's row if set). */
DD_INLINE void q4_0_wide_tile(const q4x_group *e, const uint8_t *w, const uint8_t *pf, const dd_acts *a, size_t c0,
                              float *y, size_t ldy, int wtype, const int C)
{
    __m512 acc[Q4_WIDE_COLS];
    for (int c = 0; c < C; c++)
        acc[c] = _mm512_setzero_ps();
    for (size_t g = 0; g < a->ng; g++) {
        q4x_group own;
        if (e == NULL)
            q4x_unpack_group(w, pf, a, g, wtype, &own);
        const q4x_group *x = e != NULL ? e + g : &own;
        group_columns(x->lo, x->hi, x->dw, a, c0, g, wtype, acc, C);
    }
    for (int c = 0; c < C; c++)
        y[(c0 + c) * ldy] = reduce_lanes(acc[c]);
}

/* Rows [0, nrows) against columns [c0, c0 + C): from e (row r's groups at e + r * ng) or, e NULL, from
 * the stored rows, prefetching DD_PREFETCH_ROWS rows ahead on the first column pass. */
DD_INLINE void q4_0_wide_rows(const q4x_group *e, const uint8_t *w, size_t rb, size_t nrows, size_t rows_avail,
                              const dd_acts *a, size_t c0, float *y, size_t ldy, int wtype, const int C)
{
    for (size_t r = 0; r < nrows; r++)
        q4_0_wide_tile(e != NULL ? e + r * a->ng : NULL, w + r * rb,
                       e == NULL && c0 == 0 ? DD_PREFETCH_BASE(w, rb, r, 1, rows_avail) : NULL, a, c0, y + r, ldy,
                       wtype, C);
}

/* Rows [0, nrows) against every column, in 8-column blocks and then the 1-7 left over. */
DD_INLINE void q4_0_wide_blocks(const q4x_group *e, const uint8_t *w, size_t rb, size_t nrows, size_t rows_avail,
                                const dd_acts *a, float *y, size_t ldy, int wtype)
{
    size_t c0 = 0;
    for (; c0 + Q4_WIDE_COLS <= a->m; c0 += Q4_WIDE_COLS)
        q4_0_wide_rows(e, w, rb, nrows, rows_avail, a, c0, y, ldy, wtype, Q4_WIDE_COLS);
    switch (a->m - c0) {
    case 7: q4_0_wide_rows(e, w, rb, nrows, rows_avail, a, c0, y, ldy, wtype, 7); break;
    case 6: q4_0_wide_rows(e, w, rb, nrows, rows_avail, a, c0, y, ldy, wtype, 6); break;
    case 5: q4_0_wide_rows(e, w, rb, nrows, rows_avail, a, c0, y, ldy, wtype, 5); break;
    case 4: q4_0_wide_rows(e, w, rb, nrows, rows_avail, a, c0, y, ldy, wtype, 4); break;
    case 3: q4_0_wide_rows(e, w, rb, nrows, rows_avail, a, c0, y, ldy, wtype, 3); break;
    case 2: q4_0_wide_rows(e, w, rb, nrows, rows_avail, a, c0, y, ldy, wtype, 2); break;
    case 1: q4_0_wide_rows(e, w, rb, nrows, rows_avail, a, c0, y, ldy, wtype, 1); break;
    default: break;
    }
}

/* The unpacked groups of one row range (stack): 192 KiB (341 groups: ~96 KiB of stored Q4_0, ~181 KiB of Q8_0),
 * in L2. */
#define Q4X_GROUPS (192 * 1024 / sizeof(q4x_group))

/* The GEMM (m > 1) of a Q4_0 or Q8_0 matrix: row ranges whose groups are unpacked once per call (each stored
 * group read and unpacked once, not once per 8 columns) and met by every column block; a row longer than
 * Q4X_GROUPS groups (k > 174,592 values) is unpacked per 8 columns instead. Every path runs group_columns on
 * the same unpacked values: the same bits. */
DD_INLINE void groups_gemm(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a,
                           float *y, size_t ldy, int wtype)
{
    dd_prefetch_rows(w, row_bytes, nrows < DD_PREFETCH_ROWS ? nrows : DD_PREFETCH_ROWS);
    dd_prefetched_next[0] = dd_prefetched_next[1] = NULL;
    if (a->ng > Q4X_GROUPS) {
        q4_0_wide_blocks(NULL, w, row_bytes, nrows, rows_avail, a, y, ldy, wtype);
        return;
    }
    q4x_group e[Q4X_GROUPS];
    const size_t range = Q4X_GROUPS / a->ng;
    for (size_t r0 = 0; r0 < nrows; r0 += range) {
        const size_t nr = nrows - r0 < range ? nrows - r0 : range;
        for (size_t r = 0; r < nr; r++) {
            const size_t at = r0 + r, ahead = at + DD_PREFETCH_ROWS;
            for (size_t g = 0; g < a->ng; g++)
                q4x_unpack_group(w + at * row_bytes, ahead < rows_avail ? w + ahead * row_bytes : NULL, a, g,
                                 wtype, e + r * a->ng + g);
        }
        q4_0_wide_blocks(e, w + r0 * row_bytes, row_bytes, nr, rows_avail - r0, a, y + r0, ldy, wtype);
    }
}

/* The dd_gemm_fns of kernels.h for Q4_0 and Q8_0: the GEMV's 4-row tiles (tile_groups) for m == 1, else
 * groups_gemm, the same lanes, terms and tree: the bits of the one-column call. */
#define GROUPS_GEMM(NAME, GEMV, WTYPE)                                                                       \
    static void NAME(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a, \
                     float *y, size_t ldy)                                                                   \
    {                                                                                                        \
        if (a->m == 1)                                                                                       \
            GEMV(w, row_bytes, nrows, rows_avail, a, y, ldy);                                                \
        else                                                                                                 \
            groups_gemm(w, row_bytes, nrows, rows_avail, a, y, ldy, WTYPE);                                  \
    }
GROUPS_GEMM(gemm_q4_0, gemm_q4_0_gemv, DD_Q4_0)
GROUPS_GEMM(gemm_q8_0, gemm_q8_0_gemv, DD_Q8_0)

/* Interleaved stripes (DD_Q4_0_IL) read directly: a stripe's group g (16 blocks of 8 rows, 144 bytes each)
 * becomes its 8 rows' q4x_groups with no row-major copy between. A block holds its 8 rows' f16 scales in
 * bytes 0..15, then dword 8 q + r of its runs = bytes 4 q .. 4 q + 3 of row r. group_unpack wants, for row r,
 * lane L = block 4 (L % 4) + L / 4's dword. So 16 bytes from each of the 16 blocks are gathered four blocks
 * to a vector (vector k, 128-bit lane j: block 4 k + j), and a 4 x 4 dword transpose within the 128-bit
 * lanes leaves dword m of every block in lane order in output m. The values are those group_unpack takes
 * from the same row's row-major bytes, so every product keeps its bits. */

/* Output m (m = 0..3), lane 4 j + k: dword m of the 16 bytes at byte `at` of block 4 k + j (blocks of
 * 8 * DD_Q4_0_BYTES at p). */
DD_INLINE void q4il_quads(const uint8_t *p, size_t at, __m512i out[4])
{
    for (int k = 0; k < 4; k++) {
        const uint8_t *q = p + (size_t)(4 * k) * 8 * DD_Q4_0_BYTES + at;
        out[k] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)q));
        out[k] = _mm512_inserti32x4(out[k], _mm_loadu_si128((const __m128i *)(q + 8 * DD_Q4_0_BYTES)), 1);
        out[k] = _mm512_inserti32x4(out[k], _mm_loadu_si128((const __m128i *)(q + 16 * DD_Q4_0_BYTES)), 2);
        out[k] = _mm512_inserti32x4(out[k], _mm_loadu_si128((const __m128i *)(q + 24 * DD_Q4_0_BYTES)), 3);
    }
    dd_lane_transpose4(out);
}

/* One full stripe group (16 blocks at p) -> rows 0..7's q4x_group at e[r * ng]. */
DD_INLINE void q4il_unpack_group(const uint8_t *p, q4x_group *e, size_t ng)
{
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i v[4];
    q4il_quads(p, 0, v);   /* v[i]: rows 2 i (low half) and 2 i + 1 (high half) */
    for (int r = 0; r < 8; r++) {
        const __m512i d = r % 2 ? _mm512_srli_epi32(v[r / 2], 16) : v[r / 2];
        e[r * ng].dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d));
    }
    for (int t = 0; t < 4; t++)
        for (int h = 0; h < 2; h++) {
            q4il_quads(p, 16 + 32 * t + 16 * h, v);   /* v[m]: run t of row 4 h + m */
            for (int m = 0; m < 4; m++) {
                q4x_group *x = e + (size_t)(4 * h + m) * ng;
                x->lo[t] = _mm512_and_si512(v[m], low);
                x->hi[t] = _mm512_and_si512(_mm512_srli_epi16(v[m], 4), low);
            }
        }
}

#define Q4IL_GROUP_BYTES (16 * 8 * DD_Q4_0_BYTES)

/* Stripe st's groups (its row r's at e[r * ng + g]); a short last group is padded with zero blocks (zero
 * nibbles and scales, as q4x_unpack_group pads a row); pf, if set, is prefetched group by group. */
DD_INLINE void q4il_unpack_stripe(const uint8_t *st, const uint8_t *pf, const dd_acts *a, q4x_group *e)
{
    for (size_t g = 0; g < a->ng; g++) {
        if (pf != NULL)
            for (int l = 0; l < Q4IL_GROUP_BYTES / 64; l++)
                dd_prefetch_weight(pf + g * Q4IL_GROUP_BYTES + 64 * l);
        if (g < a->nb / 16) {
            q4il_unpack_group(st + g * Q4IL_GROUP_BYTES, e + g, a->ng);
            continue;
        }
        uint8_t tail[Q4IL_GROUP_BYTES];
        memset(tail, 0, sizeof tail);
        memcpy(tail, st + g * Q4IL_GROUP_BYTES, (a->nb % 16) * 8 * DD_Q4_0_BYTES);
        q4il_unpack_group(tail, e + g, a->ng);
    }
}

/* Stripes [0, stripes) at w against every column: ranges of whole stripes unpacked straight from the layout
 * into gemm_q4_0's row groups (on this frame's stack, kept apart from gemm_q4_0's), met by its column blocks. */
__attribute__((noinline)) static void q4il_stripes(const uint8_t *w, size_t row_bytes, size_t stripes,
                                                   size_t rows_avail, const dd_acts *a, float *y, size_t ldy)
{
    const size_t stripe = 8 * row_bytes, per = Q4X_GROUPS / (8 * a->ng);
    dd_prefetch_rows(w, row_bytes, 8);
    q4x_group e[Q4X_GROUPS];
    for (size_t s0 = 0; s0 < stripes; s0 += per) {
        const size_t n = stripes - s0 < per ? stripes - s0 : per;
        for (size_t s = 0; s < n; s++) {
            const size_t at = s0 + s;
            const uint8_t *pf = 8 * (at + 2) <= rows_avail ? w + (at + 1) * stripe : NULL;
            q4il_unpack_stripe(w + at * stripe, pf, a, e + 8 * s * a->ng);
        }
        q4_0_wide_blocks(e, w + s0 * stripe, row_bytes, 8 * n, rows_avail - 8 * s0, a, y + 8 * s0, ldy, DD_Q4_0);
    }
}

/* gemm[DD_Q4_0_IL] of this level: for m > 1 the stripes by q4il_stripes and the row-major tail by gemm_q4_0;
 * m == 1 (the interleaved GEMV) and rows too long for a stripe's groups in the range buffer (k > 21,504)
 * go to dd_gemm_il. */
static void gemm_q4_0_il(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a,
                         float *y, size_t ldy)
{
    const size_t stripes = nrows / 8;
    if (a->m == 1 || stripes == 0 || 8 * a->ng > Q4X_GROUPS) {
        dd_gemm_il(DD_Q4_0, gemm_q4_0, gemv_q4_0_il, deil_q4_0, w, row_bytes, nrows, rows_avail, a, y, ldy);
        return;
    }
    q4il_stripes(w, row_bytes, stripes, rows_avail, a, y, ldy);
    if (nrows > 8 * stripes)
        gemm_q4_0(w + 8 * stripes * row_bytes, row_bytes, nrows - 8 * stripes, rows_avail - 8 * stripes, a,
                  y + 8 * stripes, ldy);
}

#endif
