/* The AVX-512 VNNI GEMV (m == 1) of a Q4_0 matrix in the 8-row interleaved layout (dd_q4_0_interleave in
 * deltadesk_cpu.h), included by kernels_avx512vnni.c after its row-major Q4_0 tile.
 *
 * Rows are the lanes: block b of an 8-row stripe is 144 bytes, its 8 f16 scales and then, for each 4-byte
 * run q of the 16 nibble bytes, the 8 rows' runs side by side, so one 32-byte load holds 8 rows' bytes
 * 4q .. 4q + 3 and meets a broadcast 4-value group of the activations in a vpdpbusd (no permutes). The bits
 * are the row-major tile's (tile_q4_0): that tile adds block b's exact int dot (bias included) times the
 * exact f32 d_w * d_a into f64 lane L(b % 16) = 4 (b % 4) + (b % 16) / 4, in order of b, then sums lanes l
 * and l + 8 and reduces the 8 by _mm512_reduce_add_pd. Here accumulator b % 16 holds that lane for the 8
 * rows, each block's product goes into it by the same fused add, and a stripe's end transposes the 16 x 8
 * sums into each row's two vectors in lane order and reduces them the same way (reduce_f64).
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

/* Block b = 16 g + i of a stripe (blk: its 144 bytes) into acc (f64, the 8 rows' lane L(i)). */
DD_INLINE void il_block(const uint8_t *blk, const dd_acts *a, size_t g, int i, __m512d *acc)
{
    const __m256i low = _mm256_set1_epi8(0x0f);
    const int j = i / 4, k = i % 4, lane = 4 * k + j;
    const int8_t *q = a->gq + ((g * 8 + 2 * (size_t)j) * 64 + 16 * (size_t)k);   /* values 0-15; 16-31 at +64 */
    __m256i s[2];
    for (int h = 0; h < 2; h++) {
        s[h] = h == 0 ? _mm256_set1_epi32(a->gbias[g * 16 + lane]) : _mm256_setzero_si256();
        for (int u = 2 * h; u < 2 * h + 2; u++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * u));
            s[h] = _mm256_dpbusd_epi32(s[h], _mm256_and_si256(v, low), il_bcast4(q + 4 * u));
            s[h] = _mm256_dpbusd_epi32(s[h], _mm256_and_si256(_mm256_srli_epi16(v, 4), low), il_bcast4(q + 64 + 4 * u));
        }
    }
    const __m256i dot = _mm256_add_epi32(s[0], s[1]);
    const __m256 dw = _mm512_castps512_ps256(
        _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)blk))));
    const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a->gd[g * 16 + lane]));
    *acc = _mm512_fmadd_pd(_mm512_cvtepi32_pd(dot), _mm512_cvtps_pd(scale), *acc);
}

/* Prefetch the lines DD_PREFETCH_BYTES past a block (every line of the stream, 144-byte steps), not past end. */
DD_INLINE void il_prefetch(const uint8_t *blk, const uint8_t *end)
{
    const uint8_t *p = blk + DD_PREFETCH_BYTES;
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
    double sums[16][8] __attribute__((aligned(64)));
    for (int i = 0; i < 16; i++)
        _mm512_store_pd(sums[i], acc[i]);
    for (int r = 0; r < 8; r++) {
        double lanes[16] __attribute__((aligned(64)));
        for (int i = 0; i < 16; i++)
            lanes[4 * (i % 4) + i / 4] = sums[i][r];
        const __m512d row[2] = { _mm512_load_pd(lanes), _mm512_load_pd(lanes + 8) };
        y[r] = reduce_f64(row);
    }
}

/* The dd_kernels gemv_q4_0_il entry: `stripes` 8-row stripes at w (8 * row_bytes each), stripes_avail of
 * them from w on (prefetch bound), activations a (m == 1) -> y[0 .. 8 * stripes). */
static void gemv_q4_0_il(const uint8_t *w, size_t row_bytes, size_t stripes, size_t stripes_avail,
                         const dd_acts *a, float *y)
{
    const uint8_t *end = w + stripes_avail * 8 * row_bytes;
    for (size_t s = 0; s < stripes; s++)
        il_stripe(w + s * 8 * row_bytes, end, a, y + 8 * s);
}

#endif
