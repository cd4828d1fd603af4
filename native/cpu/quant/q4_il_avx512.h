/* The AVX-512 VNNI GEMVs (m == 1) of Q4_0 and MXFP4 matrices in the 8-row interleaved layout
 * (dd_q4_0_interleave, dd_mxfp4_interleave in deltadesk_cpu.h), included by kernels_avx512vnni.c after its
 * row-major Q4_0 tile and bquants.h. The two types share the stripe loop and the prefetch; they differ in the
 * block step (il_block_q4_0, il_block_mxfp4) and the final reduction, each its row-major tile's
 * (docs/design/q4-0-row-interleave.md, docs/design/mxfp4-interleave.md). MXFP4's GEMV also serves m > 1, one
 * column at a time (gemm_mxfp4_il).
 *
 * Rows are the lanes: block b of an 8-row stripe is the 8 rows' scales (f16 d, or e8m0 e) and then, for each
 * 4-byte run q of the 16 nibble bytes, the 8 rows' runs side by side, so one 32-byte load holds 8 rows' bytes
 * 4q .. 4q + 3 and meets a broadcast 4-value group of the activations in a vpdpbusd (no permutes).
 * Q4_0: the bits are tile_q4_0's (kernels.h's order): block b's exact int dot (bias included) in f32 times the
 * exact f32 d_w * d_a, rounded once, is added in f32 to lane b % 16, in order of b; then dd_tree16_f32. Here
 * accumulator b % 16 holds that lane for the 8 rows, and a stripe's end runs the tree lane-wise for the 8 rows
 * (no transpose).
 * MXFP4: the bits are bquants.h's dd_bq_tile: block b's exact int dot times the f32 d_a * 2^(e - 128) is added
 * (dd_bq_term) into f64 lane b % 8, in order of b; then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)),
 * rounded once. Here accumulator b % 8 holds lane b % 8 of the 8 rows, and the tree runs lane-wise.
 */
#ifndef DELTADESK_Q4_IL_AVX512_H
#define DELTADESK_Q4_IL_AVX512_H

#define Q4_IL_BLOCK_BYTES (8 * DD_Q4_0_BYTES)
#define MX_IL_BLOCK_BYTES (8 * DD_MXFP4_BYTES)

/* The activation's 4 values at p (int8) in every int32 lane, a register operand of Q4_0's products: with
 * dd_dpbusd_bcast4's embedded broadcast they ran 6 % faster in L2, but no gain from DRAM showed on a loaded
 * machine (docs/perf/log/mx-2026-12-06.md), unlike MXFP4's. */
DD_INLINE __m256i il_bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Q4_0 block b = 16 g + i of a stripe (blk: its 144 bytes) into acc (f32, the 8 rows' lane i). The high
 * nibbles enter vpdpbusd as 16 x nibble (the byte masked, not shifted), so their sum is 16 times theirs, exact,
 * and one arithmetic shift per block takes it back; the 8 products run as 4 independent chains of 2. */
DD_INLINE void il_block_q4_0(const uint8_t *blk, const dd_acts *a, size_t g, int i, __m256 *acc)
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
    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(_mm256_cvtepi32_ps(dot), scale));
}

/* MXFP4 block b = 8 g + i of a stripe (blk: its 136 bytes) into acc (f64, the 8 rows' lane i). The nibbles
 * index kvalues_mxfp4 + 128 by vpshufb (unsigned for vpdpbusd), so the low nibbles' chain starts at -128 times
 * the block's activation sum, as dd_bq_dot8 subtracts it; two chains of four (low, high nibbles) need two adds
 * fewer than four chains of two and ran ~4 % faster. The products read the activations by dd_dpbusd_bcast4.
 * The term is dd_bq_group's in fewer operations, the same values
 * (docs/design/mxfp4-interleave.md): vscalefps gives d_a 2^(e - 128) rounded once, as d_a times the exact
 * dd_bq_e8m0 (2^-128 and 2^-127 are f32 subnormals) is; the fused add equals dd_bq_term's product and add,
 * as the f64 product of the f32 scale and the int dot (|dot| < 2^16) is exact. */
DD_INLINE void il_block_mxfp4(const uint8_t *blk, const dd_acts *a, size_t g, int i, __m512d *acc)
{
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i code = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)dd_kvalues_mxfp4_u8));
    const size_t b = 8 * g + (size_t)i;
    const int8_t *q = a->q + b * DD_QK;   /* values 0-15 meet the low nibbles, 16-31 the high ones */
    __m256i lo = _mm256_set1_epi32(-128 * a->bs[b]), hi = _mm256_setzero_si256();
    for (int u = 0; u < 4; u++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 8 + 32 * u));
        lo = dd_dpbusd_bcast4(lo, _mm256_shuffle_epi8(code, _mm256_and_si256(v, low)), q + 4 * u);
        hi = dd_dpbusd_bcast4(hi, _mm256_shuffle_epi8(code, _mm256_and_si256(_mm256_srli_epi16(v, 4), low)),
                              q + 16 + 4 * u);
    }
    const __m256i dot = _mm256_add_epi32(lo, hi);
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)blk));
    const __m256 pow2 = _mm256_cvtepi32_ps(_mm256_sub_epi32(e, _mm256_set1_epi32(128)));
    const __m256 scale = _mm256_scalef_ps(_mm256_set1_ps(a->bd[b]), pow2);
    *acc = _mm512_fmadd_pd(_mm512_cvtepi32_pd(dot), _mm512_cvtps_pd(scale), *acc);
}

/* How far ahead of the block it reads the GEMV prefetches: one stream, not the row-major tile's 4, asks for
 * every line (2 of 3 a block lost 60 % of the rate) and gained a few % at twice DD_PREFETCH_BYTES
 * (docs/perf/log/cpu-q4il-2026-12-05.md). */
#define Q4_IL_PREFETCH_BYTES (2 * DD_PREFETCH_BYTES)

/* Prefetch the lines Q4_IL_PREFETCH_BYTES past a block (every line of the stream: blocks of 144 or 136
 * bytes span at most 3), not past end. */
DD_INLINE void il_prefetch(const uint8_t *blk, const uint8_t *end)
{
    const uint8_t *p = blk + Q4_IL_PREFETCH_BYTES;
    if (p + 128 < end)
        for (int l = 0; l < 3; l++)
            dd_prefetch_weight(p + 64 * l);
}

/* NAME(w, end, a, acc): the blocks of one stripe at w into acc[0 .. GROUP) (ACC_T, zeroed by ZERO): groups of
 * GROUP blocks of BYTES, block i of each group by BLOCK into acc[i]; end: where the matrix's bytes end (prefetch
 * bound). The short last group's missing blocks are skipped: the row-major tiles add +0 there (zero codes,
 * scales or padding), which leaves a sum that started at +0 unchanged. */
#define IL_BLOCKS(NAME, ACC_T, ZERO, GROUP, BYTES, BLOCK)                                       \
    DD_INLINE void NAME(const uint8_t *w, const uint8_t *end, const dd_acts *a, ACC_T *acc)      \
    {                                                                                            \
        const size_t full = a->nb / (GROUP), rest = a->nb % (GROUP);                             \
        for (int i = 0; i < (GROUP); i++)                                                        \
            acc[i] = ZERO;                                                                       \
        for (size_t g = 0; g < full; g++) {                                                      \
            const uint8_t *grp = w + g * (GROUP) * (BYTES);                                      \
            _Pragma("GCC unroll 16") for (int i = 0; i < (GROUP); i++) {                         \
                il_prefetch(grp + i * (BYTES), end);                                             \
                BLOCK(grp + i * (BYTES), a, g, i, &acc[i]);                                      \
            }                                                                                    \
        }                                                                                        \
        const uint8_t *grp = w + full * (GROUP) * (BYTES);                                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < (GROUP); i++) if ((size_t)i < rest)        \
            BLOCK(grp + i * (BYTES), a, full, i, &acc[i]);                                       \
    }
IL_BLOCKS(il_blocks_q4_0, __m256, _mm256_setzero_ps(), 16, Q4_IL_BLOCK_BYTES, il_block_q4_0)
IL_BLOCKS(il_blocks_mxfp4, __m512d, _mm512_setzero_pd(), 8, MX_IL_BLOCK_BYTES, il_block_mxfp4)

/* One Q4_0 stripe (8 rows, nb blocks, at w) -> y[0..7]: dd_tree16_f32 lane-wise for the 8 rows. */
DD_INLINE void il_stripe_q4_0(const uint8_t *w, const uint8_t *end, const dd_acts *a, float *y)
{
    __m256 acc[16];
    il_blocks_q4_0(w, end, a, acc);
    for (int i = 0; i < 8; i++)
        acc[i] = _mm256_add_ps(acc[i], acc[i + 8]);
    for (int i = 0; i < 4; i++)
        acc[i] = _mm256_add_ps(acc[i], acc[i + 4]);
    _mm256_storeu_ps(y, _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3])));
}

/* One MXFP4 stripe -> y[0..7]: dd_bq_tile's ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)) per row, lane-wise. */
DD_INLINE void il_stripe_mxfp4(const uint8_t *w, const uint8_t *end, const dd_acts *a, float *y)
{
    __m512d s[8];
    il_blocks_mxfp4(w, end, a, s);
    const __m512d lo = _mm512_add_pd(_mm512_add_pd(s[0], s[1]), _mm512_add_pd(s[2], s[3]));
    const __m512d hi = _mm512_add_pd(_mm512_add_pd(s[4], s[5]), _mm512_add_pd(s[6], s[7]));
    _mm256_storeu_ps(y, _mm512_cvtpd_ps(_mm512_add_pd(lo, hi)));
}

/* The level's interleaved GEMVs (dd_gemm_il's `il`): `stripes` 8-row stripes at w (8 * row_bytes each),
 * stripes_avail of them from w on (prefetch bound), activations a (m == 1) -> y[0 .. 8 * stripes). */
static void gemv_q4_0_il(const uint8_t *w, size_t row_bytes, size_t stripes, size_t stripes_avail,
                         const dd_acts *a, float *y)
{
    const uint8_t *end = w + stripes_avail * 8 * row_bytes;
    for (size_t s = 0; s < stripes; s++)
        il_stripe_q4_0(w + s * 8 * row_bytes, end, a, y + 8 * s);
}

static void gemv_mxfp4_il(const uint8_t *w, size_t row_bytes, size_t stripes, size_t stripes_avail,
                          const dd_acts *a, float *y)
{
    const uint8_t *end = w + stripes_avail * 8 * row_bytes;
    for (size_t s = 0; s < stripes; s++)
        il_stripe_mxfp4(w + s * 8 * row_bytes, end, a, y + 8 * s);
}

/* The level's de-interleave (dd_gemm_il's `deil`) of Q4_0: `stripes` stripes at src to their row-major rows at
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
            const uint8_t *blk = src + s * 8 * row_bytes + b * Q4_IL_BLOCK_BYTES;
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

/* gemm[DD_MXFP4_IL] of this level: up to DD_IL_GEMV_COLS columns, the stripes by the GEMV above one column at a
 * time and the row-major tail by gemm_mxfp4. The GEMV reads only a column's pair-layout values and compact sums
 * and scales (dd_acts), the same in a one-column preparation, so column c's results are its one-column
 * product's bits, which are the row-major kernel's; a chunk's stripes stay in L2 from one column to the next.
 * More columns: the stripes de-interleaved a few at a time for gemm_mxfp4 (on rows of whole groups that fit,
 * its expanded-row GEMM, bquants.h), the same bits again. */
static void gemm_mxfp4_il(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a,
                          float *y, size_t ldy)
{
    if (a->m > DD_IL_GEMV_COLS) {
        dd_gemm_il(DD_MXFP4, gemm_mxfp4, NULL, NULL, w, row_bytes, nrows, rows_avail, a, y, ldy);
        return;
    }
    const size_t stripes = nrows / 8, r0 = 8 * stripes;
    for (size_t c = 0; c < a->m && stripes > 0; c++) {
        dd_acts col = *a;
        col.m = 1;
        col.q = a->q + c * a->nbp * DD_QK;
        col.bs = a->bs + c * a->nbp;
        col.bd = a->bd + c * a->nbp;
        gemv_mxfp4_il(w, row_bytes, stripes, rows_avail / 8, &col, y + c * ldy);
    }
    if (nrows > r0)
        gemm_mxfp4(w + r0 * row_bytes, row_bytes, nrows - r0, rows_avail - r0, a, y + r0, ldy);
}

#endif
