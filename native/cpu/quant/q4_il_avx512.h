/* The AVX-512 VNNI GEMV (m == 1) of a Q4_0 matrix in the 8-row interleaved layout (dd_q4_0_interleave in
 * deltadesk_cpu.h), included by kernels_avx512vnni.c after its row-major Q4_0 tile.
 *
 * Rows are the lanes: block b of an 8-row stripe is 144 bytes, its 8 f16 scales and then, for each 4-byte
 * run q of the 16 nibble bytes, the 8 rows' runs side by side, so one 32-byte load holds 8 rows' bytes
 * 4q .. 4q + 3 and meets a broadcast 4-value group of the activations in a vpdpbusd (no permutes). The bits
 * are the row-major tile's (tile_q4_0): that tile adds block b's exact int dot (bias included) times the
 * exact f32 d_w * d_a into f64 lane L(b % 16) = 4 (b % 4) + (b % 16) / 4, in order of b, then sums lanes l
 * and l + 8 and reduces the 8 by _mm512_reduce_add_pd. Here accumulator b % 16 holds that lane for the 8
 * rows, each block's product goes into it by the same fused add, and a stripe's end adds the accumulators
 * in the pairs and the tree of that reduction, lane-wise for the 8 rows (no transpose), and rounds once.
 */
#ifndef DELTADESK_Q4_IL_AVX512_H
#define DELTADESK_Q4_IL_AVX512_H

#define Q4_IL_BLOCK_BYTES (8 * DD_Q4_0_BYTES)

/* The activation's 4 values at p (int8) in every int32 lane. */
DD_INLINE __m256i il_bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Block b = 16 g + i of a stripe (blk: its 144 bytes) into acc (f64, the 8 rows' lane L(i)). The high nibbles
 * enter vpdpbusd as 16 x nibble (the byte masked, not shifted), so their sum is 16 times theirs, exact, and one
 * arithmetic shift per block takes it back; the 8 products run as 4 independent chains of 2. */
DD_INLINE void il_block(const uint8_t *blk, const dd_acts *a, size_t g, int i, __m512d *acc)
{
    const __m256i low = _mm256_set1_epi8(0x0f), high = _mm256_set1_epi8((char)0xf0);
    const int j = i / 4, k = i % 4, lane = 4 * k + j;
    const int8_t *q = a->gq + ((g * 8 + 2 * (size_t)j) * 64 + 16 * (size_t)k);   /* values 0-15; 16-31 at +64 */
    __m256i lo[2], hi[2];
    for (int h = 0; h < 2; h++) {
        lo[h] = h == 0 ? _mm256_set1_epi32(a->gbias[g * 16 + lane]) : _mm256_setzero_si256();
        hi[h] = _mm256_setzero_si256();
        for (int u = 2 * h; u < 2 * h + 2; u++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * u));
            lo[h] = _mm256_dpbusd_epi32(lo[h], _mm256_and_si256(v, low), il_bcast4(q + 4 * u));
            hi[h] = _mm256_dpbusd_epi32(hi[h], _mm256_and_si256(v, high), il_bcast4(q + 64 + 4 * u));
        }
    }
    const __m256i dot = _mm256_add_epi32(_mm256_add_epi32(lo[0], lo[1]),
                                         _mm256_srai_epi32(_mm256_add_epi32(hi[0], hi[1]), 4));
    const __m256 dw = _mm256_maskz_cvtph_ps(0xff, _mm_loadu_si128((const __m128i *)blk));
    const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a->gd[g * 16 + lane]));
    *acc = _mm512_fmadd_pd(_mm512_cvtepi32_pd(dot), _mm512_cvtps_pd(scale), *acc);
}

/* How far ahead of the block it reads the GEMV prefetches: one stream, not the row-major tile's 4, asks for
 * every line (2 of 3 a block lost 60 % of the rate) and gained a few % at twice DD_PREFETCH_BYTES
 * (docs/perf/log/cpu-q4il-2026-12-05.md). */
#define Q4_IL_PREFETCH_BYTES (2 * DD_PREFETCH_BYTES)

/* Prefetch the lines Q4_IL_PREFETCH_BYTES past a block (every line of the stream, 144-byte steps), not past end. */
DD_INLINE void il_prefetch(const uint8_t *blk, const uint8_t *end)
{
    const uint8_t *p = blk + Q4_IL_PREFETCH_BYTES;
    if (p + 128 < end)
        for (int l = 0; l < 3; l++)
            dd_prefetch_weight(p + 64 * l);
}

/* One stripe (8 rows, nb blocks, at w) -> y[0..7]; end: where the matrix's bytes end (prefetch bound). */
DD_INLINE void il_stripe(const uint8_t *w, const uint8_t *end, const dd_acts *a, float *y)
{
    __m512d acc[16];
    for (int i = 0; i < 16; i++)
        acc[i] = _mm512_setzero_pd();
    const size_t full = a->nb / 16, rest = a->nb % 16;
    for (size_t g = 0; g < full; g++) {
        const uint8_t *grp = w + g * 16 * Q4_IL_BLOCK_BYTES;
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            il_prefetch(grp + i * Q4_IL_BLOCK_BYTES, end);
            il_block(grp + i * Q4_IL_BLOCK_BYTES, a, g, i, &acc[i]);
        }
    }
    /* the short last group: the row-major tile adds zero there (zero nibbles and padding), which leaves a
     * sum that started at +0 unchanged, so those blocks are skipped */
    const uint8_t *grp = w + full * 16 * Q4_IL_BLOCK_BYTES;
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        if ((size_t)i < rest)
            il_block(grp + i * Q4_IL_BLOCK_BYTES, a, full, i, &acc[i]);
    /* reduce_f64 per row, on the 8 rows at once: lanes L and L + 8 (accumulators i = 4 (L % 4) + L / 4),
     * then _mm512_reduce_add_pd's tree (lanes l + 4 and l, then l + 2 and l, then 1 and 0), then to f32 */
    __m512d p[8];
    for (int l = 0; l < 8; l++)
        p[l] = _mm512_add_pd(acc[4 * (l % 4) + l / 4], acc[4 * ((l + 8) % 4) + (l + 8) / 4]);
    for (int l = 0; l < 4; l++)
        p[l] = _mm512_add_pd(p[l + 4], p[l]);
    for (int l = 0; l < 2; l++)
        p[l] = _mm512_add_pd(p[l + 2], p[l]);
    _mm256_storeu_ps(y, _mm512_cvtpd_ps(_mm512_add_pd(p[0], p[1])));
}

/* The level's interleaved GEMV (dd_gemm_q4_0_il's `il`): `stripes` 8-row stripes at w (8 * row_bytes each),
 * stripes_avail of them from w on (prefetch bound), activations a (m == 1) -> y[0 .. 8 * stripes). */
static void gemv_q4_0_il(const uint8_t *w, size_t row_bytes, size_t stripes, size_t stripes_avail,
                         const dd_acts *a, float *y)
{
    const uint8_t *end = w + stripes_avail * 8 * row_bytes;
    for (size_t s = 0; s < stripes; s++)
        il_stripe(w + s * 8 * row_bytes, end, a, y + 8 * s);
}

/* The level's de-interleave (dd_gemm_q4_0_il's `deil`): `stripes` stripes at src to their row-major rows at
 * dst. Per block, the 8 rows' 4-byte runs (run q of row r at dword 8 q + r of the block's 128 run bytes) are
 * regrouped by row with two 2-source dword permutes: row r's 16 bytes at dword 4 (r % 4) of the first
 * (rows 0-3) or second (rows 4-7) result. */
static void deil_q4_0(uint8_t *dst, const uint8_t *src, size_t stripes, size_t row_bytes)
{
    const size_t nb = row_bytes / DD_Q4_0_BYTES;
    const __m512i lo = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(4));
    uint8_t rows[128];
    for (size_t s = 0; s < stripes; s++)
        for (size_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + s * 8 * row_bytes + b * 8 * DD_Q4_0_BYTES;
            const __m512i z0 = _mm512_loadu_si512(blk + 16), z1 = _mm512_loadu_si512(blk + 80);
            _mm512_storeu_si512(rows, _mm512_permutex2var_epi32(z0, lo, z1));
            _mm512_storeu_si512(rows + 64, _mm512_permutex2var_epi32(z0, hi, z1));
            uint8_t *out = dst + s * 8 * row_bytes + b * DD_Q4_0_BYTES;
            for (size_t r = 0; r < 8; r++) {
                memcpy(out + r * row_bytes, blk + 2 * r, 2);
                memcpy(out + r * row_bytes + 2, rows + 16 * r, 16);
            }
        }
}

#endif
