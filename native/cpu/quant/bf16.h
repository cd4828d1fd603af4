/* BF16 and F16 weights read as stored, times the f32 activations themselves (not their Q8_0 blocks).
 *
 * A BF16 value is the top half of an f32 and an IEEE half widens to f32 exactly (vcvtph2ps, subnormals
 * included), so widening is exact; an 8-bit (BF16) or 11-bit (F16) significand times an f32's 24 bits is
 * exact in f64. Each dot is 8 f64 lanes, lane l summing the products of values 8j + l for
 * j = 0, 1, ... in order, then the lanes added as ((l, l + 4), then (l, l + 2), then (0, 1)) and the
 * sum rounded to f32 once. Every level and tile shape runs that sequence per (row, column), so results
 * do not depend on the ISA level, the thread count or the other rows and columns of a call; the numpy
 * twin is engine.kernels.cpu_twins.bf16_product_np. The including file sets DD_BF16_ROWS and
 * DD_BF16_COLS (the register tile: 1 x 1 up to 4 x 4) and gets gemm_bf16 and gemm_f16 (dd_gemm_fns).
 */
#ifndef DD_BF16_ROWS
#error "define DD_BF16_ROWS and DD_BF16_COLS before including bf16.h"
#endif

typedef uint16_t dd_bf16_v8h __attribute__((vector_size(16)));
typedef uint32_t dd_bf16_v8u __attribute__((vector_size(32)));

/* acc + w x, x w exact: a fused multiply-add rounds the same sum once, so either gives the same bits. */
#ifdef __AVX512F__
#define BF16_MULADD(acc, w, x) ((dd_v8d)_mm512_fmadd_pd((__m512d)(w), (__m512d)(x), (__m512d)(acc)))
#else
#define BF16_MULADD(acc, w, x) ((acc) + (w) * (x))
#endif

static inline size_t bf16_min(size_t a, size_t b)
{
    return a < b ? a : b;
}

/* 8 BF16 values at p as f64. AVX-512 spells the widening out: GCC splits 512-bit vector-extension
 * conversions into 256-bit halves (its default preferred vector width), which halved the GEMV's rate. */
static inline __attribute__((always_inline)) dd_v8d bf16_load8(const uint8_t *p)
{
#ifdef __AVX512F__
    const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return (dd_v8d)_mm512_cvtps_pd(_mm256_castsi256_ps(bits));
#else
    dd_bf16_v8h h;
    memcpy(&h, p, sizeof h);
    const dd_bf16_v8u bits = __builtin_convertvector(h, dd_bf16_v8u) << 16;
    dd_v8f f;
    memcpy(&f, &bits, sizeof f);
    return __builtin_convertvector(f, dd_v8d);
#endif
}

/* 8 IEEE halves at p as f64 (F16C where the level has it, else dd_f16_to_f32: the same values). */
static inline __attribute__((always_inline)) dd_v8d f16_load8(const uint8_t *p)
{
#ifdef __AVX512F__
    const __m256i h = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return (dd_v8d)_mm512_cvtps_pd(_mm512_castps512_ps256(_mm512_cvtph_ps(h)));
#else
    dd_v8f f;
#ifdef __F16C__
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(&f, &v, sizeof f);
#else
    for (int l = 0; l < 8; l++)
        f[l] = dd_f16_to_f32(dd_load_u16(p + 2 * l));
#endif
    return __builtin_convertvector(f, dd_v8d);
#endif
}

/* 8 f32 values at p as f64. */
static inline __attribute__((always_inline)) dd_v8d bf16_acts8(const float *p)
{
#ifdef __AVX512F__
    return (dd_v8d)_mm512_cvtps_pd(_mm256_loadu_ps(p));
#else
    dd_v8f f;
    memcpy(&f, p, sizeof f);
    return __builtin_convertvector(f, dd_v8d);
#endif
}

/* The lanes of one dot added in the fixed tree, rounded to f32. */
static inline float bf16_lanes(dd_v8d s)
{
    const double a0 = s[0] + s[4], a1 = s[1] + s[5], a2 = s[2] + s[6], a3 = s[3] + s[7];
    return (float)((a0 + a2) + (a1 + a3));
}

/* An R x C tile: rows w + r * rb, columns x + c * k, into y[c * ldy + r]; half: F16 rows, else BF16. Rows
 * up to prefetch_rows further on exist and are prefetched a line at a time. */
static inline __attribute__((always_inline)) void bf16_tile(const uint8_t *w, size_t rb, int R, const float *x, size_t k,
                                                            int C, float *y, size_t ldy, size_t prefetch_rows, int half)
{
    dd_v8d acc[DD_BF16_ROWS][DD_BF16_COLS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = (dd_v8d){ 0 };
    for (size_t i = 0; i < k; i += 8) {
        if (prefetch_rows > 0 && i % 32 == 0)
            for (int r = 0; r < R; r++)
                __builtin_prefetch(w + (r + prefetch_rows) * rb + 2 * i);
        dd_v8d wv[DD_BF16_ROWS], xv[DD_BF16_COLS];
        for (int r = 0; r < R; r++)
            wv[r] = half ? f16_load8(w + r * rb + 2 * i) : bf16_load8(w + r * rb + 2 * i);
        for (int c = 0; c < C; c++)
            xv[c] = bf16_acts8(x + c * k + i);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                acc[r][c] = BF16_MULADD(acc[r][c], wv[r], xv[c]);
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            y[c * ldy + r] = bf16_lanes(acc[r][c]);
}

/* The tile with R and C known at compile time (each shape its own unrolled loop). */
#define DD_BF16_TILE_CASE(RR, CC)                                                                  \
    case (RR) * 8 + (CC):                                                                          \
        bf16_tile(w, rb, RR, x, k, CC, y, ldy, prefetch_rows, half);                               \
        break;

static inline __attribute__((always_inline)) void bf16_tile_any(const uint8_t *w, size_t rb, int R, const float *x,
                                                                size_t k, int C, float *y, size_t ldy,
                                                                size_t prefetch_rows, int half)
{
    switch (R * 8 + C) {
        DD_BF16_TILE_CASE(1, 1)
#if DD_BF16_COLS >= 2
        DD_BF16_TILE_CASE(1, 2)
#endif
#if DD_BF16_ROWS >= 2
        DD_BF16_TILE_CASE(2, 1)
#endif
#if DD_BF16_ROWS >= 2 && DD_BF16_COLS >= 2
        DD_BF16_TILE_CASE(2, 2)
#endif
#if DD_BF16_COLS >= 4
        DD_BF16_TILE_CASE(1, 3)
        DD_BF16_TILE_CASE(1, 4)
#endif
#if DD_BF16_ROWS >= 4
        DD_BF16_TILE_CASE(3, 1)
        DD_BF16_TILE_CASE(4, 1)
#endif
#if DD_BF16_ROWS >= 4 && DD_BF16_COLS >= 4
        DD_BF16_TILE_CASE(2, 3)
        DD_BF16_TILE_CASE(2, 4)
        DD_BF16_TILE_CASE(3, 2)
        DD_BF16_TILE_CASE(3, 3)
        DD_BF16_TILE_CASE(3, 4)
        DD_BF16_TILE_CASE(4, 2)
        DD_BF16_TILE_CASE(4, 3)
        DD_BF16_TILE_CASE(4, 4)
#endif
    default:
        break;
    }
}

/* y[c * ldy + r] = row r . column c (a->x), columns in blocks of DD_BF16_COLS against all the rows in tiles
 * of DD_BF16_ROWS (the rows of a chunk stay in L2, a column block in L1); half: F16 rows, else BF16. */
static inline __attribute__((always_inline)) void bf16_gemm(const uint8_t *w, size_t row_bytes, size_t nrows,
                                                            size_t rows_avail, const dd_acts *a, float *y, size_t ldy,
                                                            int half)
{
    const size_t k = row_bytes / 2;
    for (size_t c0 = 0; c0 < a->m; c0 += DD_BF16_COLS) {
        const int C = (int)bf16_min(a->m - c0, DD_BF16_COLS);
        for (size_t r0 = 0; r0 < nrows; r0 += DD_BF16_ROWS) {
            const int R = (int)bf16_min(nrows - r0, DD_BF16_ROWS);
            const size_t ahead = rows_avail - r0 > (size_t)R + DD_PREFETCH_ROWS && a->m == 1 ? DD_PREFETCH_ROWS : 0;
            bf16_tile_any(w + r0 * row_bytes, row_bytes, R, a->x + c0 * k, k, C, y + c0 * ldy + r0, ldy, ahead, half);
        }
    }
}

/* dd_gemm_fn of BF16 rows. */
static void gemm_bf16(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a, float *y,
                      size_t ldy)
{
    bf16_gemm(w, row_bytes, nrows, rows_avail, a, y, ldy, 0);
}

/* dd_gemm_fn of F16 rows. */
static void gemm_f16(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a, float *y,
                     size_t ldy)
{
    bf16_gemm(w, row_bytes, nrows, rows_avail, a, y, ldy, 1);
}
