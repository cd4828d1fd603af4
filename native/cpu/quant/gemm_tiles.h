/* The row/column tiling shared by the SIMD kernel files.
 *
 * DD_DEFINE_GEMM(NAME, TILE) defines a dd_gemm_fn NAME that covers an nrows x m output with calls
 * TILE(w_row0, prefetch_row0, row_bytes, acts, c0, y_row0, ldy, R, C), each computing rows [0, R)
 * x columns [c0, c0 + C) with R and C compile-time constants (TILE is always-inline, so each shape
 * gets its own register-resident accumulators) while prefetching R rows from prefetch_row0.
 * GEMV (m == 1) uses 4-row tiles so the activation loads are shared by 4 rows; GEMM (m > 1) uses
 * 2 x 4 tiles so each expanded weight register serves 4 columns, and walks the columns in blocks of
 * DD_GEMM_BLOCK_COLS: a block's activations (about 3 KiB a column at k = 2048) stay in L2 while
 * every row of the range meets them, and the range's weights (dd_gemm_chunk_rows in runtime.h
 * keeps them to ~64 KiB) are read again from L2, not DRAM, for the next block. A prefill product
 * thus reads each weight block from memory once per call, and the activations once per row range.
 * Every output element is computed by the same instruction sequence whatever tile or block it
 * falls in, so results do not depend on where a thread's row range starts or on m.
 */
#ifndef DELTADESK_GEMM_TILES_H
#define DELTADESK_GEMM_TILES_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

#define DD_INLINE static inline __attribute__((always_inline))

/* y[(c0 + c) * ldy + r] for R x C accumulators of 8 f64 lanes in block order (the low-bit tiles): the
 * lanes summed in a fixed tree, rounded to f32 once. */
DD_INLINE void dd_store_lanes(dd_v8d acc[4][4], size_t c0, float *y, size_t ldy, const int R, const int C)
{
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const dd_v8d s = acc[r][c];
            y[(c0 + c) * ldy + r] = (float)(((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));
        }
}

/* Prefetch the weight line at p into L2 (prefetcht1), the hint every kernel uses for the weights it reads
 * ahead. Into L2 and not L1 (prefetcht0): it doubled a core's Q4_0 GEMV rate from DRAM on Zen 4
 * (docs/design/native-cpu.md, "Weight prefetching"); the rows arrive in L2 either way, and the L1 is
 * left to the activations and the lines the tile is reading now. */
DD_INLINE void dd_prefetch_weight(const void *p)
{
    __builtin_prefetch(p, 0, 2);
}

/* Prefetch the first rows of a range at once: the tiles prefetch DD_PREFETCH_ROWS ahead, so
 * without this the first rows of every chunk a thread claims would arrive one miss at a time. */
DD_INLINE void dd_prefetch_rows(const uint8_t *w, size_t row_bytes, size_t rows)
{
    for (size_t at = 0; at < rows * row_bytes; at += 64)
        dd_prefetch_weight(w + at);
}

/* Per thread (and kernel file): where the rows that this thread's last two GEMV streams (m == 1 calls)
 * left prefetched begin, i.e. such a call's end when its tiles prefetched the DD_PREFETCH_ROWS rows past
 * it, else NULL; two, because the MoE's gate and up chunks alternate between two matrices. Only a
 * prefetch hint: no result depends on it. */
static __thread const uint8_t *dd_prefetched_next[2];
static __thread int dd_prefetched_last;   /* the slot the last call updated */

/* Rows a GEMV (m == 1) tile prefetches ahead: DD_PREFETCH_ROWS, or for rows shorter than
 * DD_PREFETCH_BYTES / DD_PREFETCH_ROWS as many as hold DD_PREFETCH_BYTES. A GEMV tile of short rows (an
 * expert's down matrix, k = 512: 288 bytes a Q4_0 row) finishes 8 rows sooner than DRAM answers. */
DD_INLINE size_t dd_gemv_ahead(size_t row_bytes)
{
    const size_t r = (DD_PREFETCH_BYTES + row_bytes - 1) / (row_bytes ? row_bytes : 1);
    return r < DD_PREFETCH_ROWS ? DD_PREFETCH_ROWS : r;
}

/* The start of a GEMV call's prefetching (rows [0, nrows) of w, rows [nrows, rows_avail) following; the
 * tiles prefetch `ahead` rows ahead): its first rows at once (dd_prefetch_rows), unless one of this
 * thread's two last GEMV streams ended where this call begins and already prefetched them. A thread
 * claims a product's chunks in order (pool.c), so in a long matrix only its first chunk needs the burst;
 * before, every chunk of 12-32 rows re-issued prefetches for up to `ahead` of its rows. Records where this
 * call's tiles leave off, in the slot it continued, else in the one not updated last: with nrows >= ahead,
 * the tiles at rows r prefetch row r + ahead whenever rows_avail allows the whole tile there, so
 * rows_avail >= nrows + ahead covers the next call's first `ahead` rows. */
DD_INLINE void dd_gemv_prefetch_start(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail,
                                      size_t ahead)
{
    int slot = w == dd_prefetched_next[0] ? 0 : w == dd_prefetched_next[1] ? 1 : -1;
    if (slot < 0) {
        dd_prefetch_rows(w, row_bytes, nrows < ahead ? nrows : ahead);
        slot = 1 - dd_prefetched_last;
    }
    dd_prefetched_next[slot] = nrows >= ahead && rows_avail >= nrows + ahead ? w + nrows * row_bytes : NULL;
    dd_prefetched_last = slot;
}

/* The rows AHEAD below a tile's first row r, if all R of them exist, else the tile's own. */
#define DD_PREFETCH_AHEAD(W, RB, R_, R, AVAIL, AHEAD) \
    ((W) + ((R_) + (AHEAD) + (R) <= (AVAIL) ? (R_) + (AHEAD) : (R_)) * (RB))

/* DD_PREFETCH_AHEAD at DD_PREFETCH_ROWS (the GEMM tiles'). */
#define DD_PREFETCH_BASE(W, RB, R_, R, AVAIL) DD_PREFETCH_AHEAD(W, RB, R_, R, AVAIL, DD_PREFETCH_ROWS)

/* Columns per block of the GEMM walk (a multiple of the 4-column tile). */
#define DD_GEMM_BLOCK_COLS 32

/* Rows [R_, R_ + R) against columns [C0, C1) in 4-column tiles, then the 1-3 left over. */
#define DD_GEMM_COLUMNS(TILE, W, RB, R_, AVAIL, A, Y, LDY, R, C0, C1)                              \
    do {                                                                                          \
        const uint8_t *w_ = (W) + (R_) * (RB), *pf_ = DD_PREFETCH_BASE(W, RB, R_, R, AVAIL);       \
        size_t c_ = (C0);                                                                         \
        for (; c_ + 4 <= (C1); c_ += 4)                                                           \
            TILE(w_, pf_, RB, A, c_, (Y) + (R_), LDY, R, 4);                                      \
        switch ((C1) - c_) {                                                                      \
        case 3: TILE(w_, pf_, RB, A, c_, (Y) + (R_), LDY, R, 3); break;                           \
        case 2: TILE(w_, pf_, RB, A, c_, (Y) + (R_), LDY, R, 2); break;                           \
        case 1: TILE(w_, pf_, RB, A, c_, (Y) + (R_), LDY, R, 1); break;                           \
        default: break;                                                                           \
        }                                                                                         \
    } while (0)

/* The m == 1 walk (GEMV): 4-row tiles, then the 1-3 rows left over. */
#define DD_GEMV_ROWS(TILE, w, row_bytes, nrows, rows_avail, a, y, ldy)                            \
    do {                                                                                          \
        size_t r_ = 0;                                                                            \
        const size_t ahead_ = dd_gemv_ahead(row_bytes);                                           \
        dd_gemv_prefetch_start(w, row_bytes, nrows, rows_avail, ahead_);                          \
        for (; r_ + 4 <= nrows; r_ += 4)                                                          \
            TILE(w + r_ * row_bytes, DD_PREFETCH_AHEAD(w, row_bytes, r_, 4, rows_avail, ahead_),  \
                 row_bytes, a, 0, y + r_, ldy, 4, 1);                                             \
        for (; r_ < nrows; r_++)                                                                  \
            TILE(w + r_ * row_bytes, DD_PREFETCH_AHEAD(w, row_bytes, r_, 1, rows_avail, ahead_),  \
                 row_bytes, a, 0, y + r_, ldy, 1, 1);                                             \
    } while (0)

/* DD_DEFINE_GEMV(NAME, TILE): a dd_gemm_fn NAME for m == 1 only (a kernel file whose GEMM is its own). */
#define DD_DEFINE_GEMV(NAME, TILE)                                                                \
    static void NAME(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail,         \
                     const dd_acts *a, float *y, size_t ldy)                                      \
    {                                                                                             \
        DD_GEMV_ROWS(TILE, w, row_bytes, nrows, rows_avail, a, y, ldy);                           \
    }

#define DD_DEFINE_GEMM(NAME, TILE)                                                                \
    static void NAME(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail,         \
                     const dd_acts *a, float *y, size_t ldy)                                      \
    {                                                                                             \
        size_t r = 0;                                                                             \
        if (a->m == 1) {                                                                          \
            DD_GEMV_ROWS(TILE, w, row_bytes, nrows, rows_avail, a, y, ldy);                       \
            return;                                                                               \
        }                                                                                         \
        dd_prefetch_rows(w, row_bytes, nrows < DD_PREFETCH_ROWS ? nrows : DD_PREFETCH_ROWS);      \
        dd_prefetched_next[0] = dd_prefetched_next[1] = NULL;                                   \
        for (size_t c0 = 0; c0 < a->m; c0 += DD_GEMM_BLOCK_COLS) {                                \
            const size_t c1 = a->m - c0 < DD_GEMM_BLOCK_COLS ? a->m : c0 + DD_GEMM_BLOCK_COLS;    \
            for (r = 0; r + 2 <= nrows; r += 2)                                                   \
                DD_GEMM_COLUMNS(TILE, w, row_bytes, r, rows_avail, a, y, ldy, 2, c0, c1);         \
            if (r < nrows)                                                                        \
                DD_GEMM_COLUMNS(TILE, w, row_bytes, r, rows_avail, a, y, ldy, 1, c0, c1);         \
        }                                                                                         \
    }

/* DD_DEFINE_GEMM_SPLIT(NAME, TILES, FITS, GEMM_M) defines a dd_gemm_fn NAME that runs
 * GEMM_M(w, row_bytes, nrows, a, y, ldy) for m > 1 when FITS(a), else TILES (a DD_DEFINE_GEMM):
 * the K-quant GEMMs that unpack a row range once per call (kquants.h, kq_gemm_avx512.h). */
#define DD_DEFINE_GEMM_SPLIT(NAME, TILES, FITS, GEMM_M)                                           \
    static void NAME(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail,         \
                     const dd_acts *a, float *y, size_t ldy)                                      \
    {                                                                                             \
        if (a->m > 1 && FITS(a))                                                                  \
            GEMM_M(w, row_bytes, nrows, a, y, ldy);                                               \
        else                                                                                      \
            TILES(w, row_bytes, nrows, rows_avail, a, y, ldy);                                    \
    }

/* DD_DEFINE_TYPED_GEMMS() defines gemm_q4_0 and gemm_q8_0 in a kernel file whose one tile function
 * tile(w, pf, rb, a, wtype, c0, y, ldy, R, C) takes the weight type (DD_Q4_0 or DD_Q8_0) as an argument. */
#define DD_TILE_Q4_0(w, pf, rb, a, c0, y, ldy, R, C) tile(w, pf, rb, a, DD_Q4_0, c0, y, ldy, R, C)
#define DD_TILE_Q8_0(w, pf, rb, a, c0, y, ldy, R, C) tile(w, pf, rb, a, DD_Q8_0, c0, y, ldy, R, C)
#define DD_DEFINE_TYPED_GEMMS()              \
    DD_DEFINE_GEMM(gemm_q4_0, DD_TILE_Q4_0) \
    DD_DEFINE_GEMM(gemm_q8_0, DD_TILE_Q8_0)

#endif
