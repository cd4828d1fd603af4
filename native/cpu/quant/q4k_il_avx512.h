/* The AVX-512 VNNI GEMV (m <= DD_IL_GEMV_COLS) of a Q4_K matrix in the 8-row interleaved layout (dd_q4_k_interleave in
 * deltadesk_cpu.h), included by kernels_avx512vnni.c after kq_tile_avx512.h (gemm_q4_K); it defines the
 * table's gemm_q4_k_il.
 *
 * Rows are the lanes. In super-block b of a stripe (1152 bytes) one 32-byte load holds the 8 rows' qs bytes
 * 32 j + 4 u .. + 3 (chunk j, run u); broadcast to both halves of a vector and masked to the low nibbles in the
 * low half, the high ones (in place, not shifted) in the high half, it meets two 4-value groups of a column's
 * activations (values 64 j + 4 u and 32 further, one dword permute) in one vpdpbusd: lane 8 h + r sums row r's
 * sub-block 2 j + h, the high half 16 times the true sums.
 * The bits are kquants.h's f32 contract: per row and sub-block i, in order of the super-blocks,
 * L_i = L_i + ((d sc_i) da_i) S_i, then L_i = L_i - (dmin m_i)(da_i bs_i), every multiply, add and subtract
 * rounded on its own (no fused operation), then ((L0 + L1) + (L2 + L3)) + ((L4 + L5) + (L6 + L7)). Here one f32
 * vector holds the lanes of chunk j's two sub-blocks for the 8 rows in the sums' order (lane 8 h + r), so a
 * column has 4 accumulators and its chunk one term vector. The rows' factors d sc_i and dmin m_i (an f16 value
 * times a 6-bit integer: 17 bits, exact; kil_factors) are formed once per super-block and stripe visit for all
 * its columns; a column's da_i and da_i bs_i (11 + 12 bits, exact) once per call (kil_col_terms). A high-nibble
 * sum is 16 S_i exactly (below 2^21, so its conversion too) and meets (d sc_i)(da_i / 16): an exact power-of-two
 * scaling of the same rounded product, the same bits. The final tree runs lane-wise: the two halves of a
 * chunk's vector, then the chunks' sums; no transpose.
 */
#ifndef DELTADESK_Q4K_IL_AVX512_H
#define DELTADESK_Q4K_IL_AVX512_H

#define Q4K_IL_BLOCK_BYTES (8 * DD_Q4_K_BYTES)
/* As Q4_IL_PREFETCH_BYTES: one stream, every line of it, twice DD_PREFETCH_BYTES ahead. */
#define Q4K_IL_PREFETCH_BYTES (2 * DD_PREFETCH_BYTES)

/* The 8 rows' 6-bit scales and mins of an interleaved super-block, byte 8 i + r row r's of sub-block i: the low
 * 4 bits from the nibble bytes at 32 (scales, i >= 4 the high nibbles) and 64 (mins), the top 2 from the byte at
 * 96 (deltadesk_cpu.h); each vector holds sub-blocks 0-3 in its low half, 4-7 in its high half. */
DD_INLINE void kil_scales(const uint8_t *blk, uint8_t sc[64], uint8_t mn[64])
{
    const __m512i lo4 = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    const __m512i by4 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i s = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 32)));
    const __m512i m = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 64)));
    const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 96)));
    const __m512i sc_top = _mm512_sllv_epi16(h, _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1));
    const __m512i mn_top = _mm512_srlv_epi16(h, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1));
    /* (x & lo4) | (t & top), bit by bit */
    _mm512_storeu_si512(sc, _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srlv_epi16(s, by4), lo4), sc_top, top,
                                                      0xf8));
    _mm512_storeu_si512(mn, _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srlv_epi16(m, by4), lo4), mn_top, top,
                                                      0xf8));
}

/* Column c's 8 outputs y[c * ldy + 0..7] from its accumulators acc[c][0..3] (chunk j: lane 8 h + r holds L_{2 j + h}
 * of row r): ((L0 + L1) + (L2 + L3)) + ((L4 + L5) + (L6 + L7)), each add in f32. */
DD_INLINE void kil_store(const __m512 acc[][4], float *y, size_t ldy, const int C)
{
    for (int c = 0; c < C; c++) {
        __m256 s[4];
        for (int j = 0; j < 4; j++)
            s[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[c][j]),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[c][j]), 1)));
        _mm256_storeu_ps(y + c * ldy, _mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3])));
    }
}

/* Run u of chunk j of an interleaved super-block (blk) against C columns: the 8 rows' 32 bytes, twice, masked to
 * their low nibbles in the low half and to their high ones (in place) in the high half, meet column c's 4
 * activations at q[c] + at + 4 u in the low half and those 32 further in the high half (one dword permute of the
 * column's 64 chunk bytes), summed into acc[c * stride]: lane 8 h + r, row r's sub-block 2 j + h (h = 1: 16 times
 * the true sum). */
DD_INLINE void kil_run(const uint8_t *blk, int j, int u, const int8_t *const *q, size_t at, __m512i *acc,
                       size_t stride, const int C)
{
    const __m512i nib = _mm512_inserti64x4(_mm512_set1_epi8(0x0f), _mm256_set1_epi8((char)0xf0), 1);
    const __m512i pick = _mm512_setr_epi32(u, u, u, u, u, u, u, u, u + 8, u + 8, u + 8, u + 8, u + 8, u + 8, u + 8,
                                           u + 8);
    const __m512i v = _mm512_and_si512(
        _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 256 * j + 32 * u))), nib);
    for (int c = 0; c < C; c++)
        acc[c * stride] = _mm512_dpbusd_epi32(acc[c * stride], v,
                                              _mm512_permutexvar_epi32(pick, _mm512_loadu_si512(q[c] + at)));
}

/* The 8 rows' factors of one interleaved super-block, chunk j: dsc[j] = d sc_i and dmm[j] = dmin m_i in lane
 * 8 h + r (row r, sub-block i = 2 j + h), each exact (an f16 value times a 6-bit integer: at most 17 bits). */
typedef struct {
    __m512 dsc[4], dmm[4];
} kil_factors;

DD_INLINE void kil_factors_of(const uint8_t *blk, kil_factors *f)
{
    uint8_t sc[64], mn[64];
    kil_scales(blk, sc, mn);
    const __m512 d = _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)blk)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 16))));
    for (int j = 0; j < 4; j++) {
        const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16 * j)));
        const __m512i m = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mn + 16 * j)));
        f->dsc[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(s));
        f->dmm[j] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m));
    }
}

/* acc += one column's terms of chunk j for the 8 rows (lane 8 h + r: sub-block 2 j + h of row r): its sums (int32,
 * the high half 16 times the true ones), the rows' factors f and the column's super-block terms t (kil_col_terms).
 * w = (d sc_i) da_i is rounded once, then w S_i; the add, then the min term's subtract, each rounded on its own. */
DD_INLINE __m512 kil_term(__m512i sums, const kil_factors *f, int j, const float *t, __m512 acc)
{
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i ida = _mm512_add_epi32(half, _mm512_set1_epi32(2 * j));
    const __m512 tv = _mm512_loadu_ps(t);
    const __m512 s = _mm512_cvtepi32_ps(sums);
    const __m512 w = _mm512_mul_ps(f->dsc[j], _mm512_permutexvar_ps(ida, tv));
    acc = _mm512_add_ps(acc, _mm512_mul_ps(w, s));
    const __m512 dab = _mm512_permutexvar_ps(_mm512_add_epi32(ida, _mm512_set1_epi32(8)), tv);
    return _mm512_sub_ps(acc, _mm512_mul_ps(f->dmm[j], dab));
}

/* One interleaved super-block (blk) of 8 rows against C (1 or 2) columns: column c's 256 activations at q[c] and
 * its super-block terms t[c] (kil_col_terms); acc[c][j] += chunk j's terms. The masked weight runs serve both
 * columns. */
DD_INLINE void kil_superblock(const uint8_t *blk, const int8_t *const q[2], const float *const t[2],
                              __m512 acc[2][4], const int C)
{
    kil_factors f;
    kil_factors_of(blk, &f);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        __m512i sums[4];   /* chains 2 c, 2 c + 1 of column c: as the row-major tiles' independent sums */
        for (int k = 0; k < 2 * C; k++)
            sums[k] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++)
            kil_run(blk, j, u, q, 64 * j, sums + (u & 1), 2, C);
        for (int c = 0; c < C; c++)
            acc[c][j] = kil_term(_mm512_add_epi32(sums[2 * c], sums[2 * c + 1]), &f, j, t[c], acc[c][j]);
    }
}

/* One stripe (8 rows of nsb super-blocks at w) against C (1, 2) columns (their activations q and terms t as for
 * kil_superblock, from super-block 0) -> y[c * ldy + 0..7]; end: where the matrix's bytes end (prefetch bound). */
DD_INLINE void kil_stripe_pair(const uint8_t *w, const uint8_t *end, size_t nsb, const int8_t *const q[4],
                               const float *const t[4], float *y, size_t ldy, const int C)
{
    __m512 acc[2][4];
    for (int c = 0; c < C; c++)
        for (int j = 0; j < 4; j++)
            acc[c][j] = _mm512_setzero_ps();
    for (size_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = w + sb * Q4K_IL_BLOCK_BYTES, *pf = blk + Q4K_IL_PREFETCH_BYTES;
        if (pf + Q4K_IL_BLOCK_BYTES <= end)
            for (int l = 0; l < Q4K_IL_BLOCK_BYTES / 64; l++)
                dd_prefetch_weight(pf + 64 * l);
        const int8_t *qs[2] = { q[0] + sb * DD_QK_K, q[C - 1] + sb * DD_QK_K };
        const float *ts[2] = { t[0] + 16 * sb, t[C - 1] + 16 * sb };
        kil_superblock(blk, qs, ts, acc, C);
    }
    kil_store((const __m512 (*)[4])acc, y, ldy, C);
}

/* Super-blocks of a stripe whose factors one pass holds (4 KiB: a whole k = 2048 stripe). */
#define KIL_PASS_SB 8

/* One stripe (8 rows of nsb super-blocks at w) against C (3, 4) columns: column c's activations q[c] and
 * super-block terms t[c] (kil_col_terms), from super-block 0 -> y[c * ldy + 0..7]; end: where the matrix's
 * bytes end (prefetch bound). Accumulator (c, j) holds chunk j's two sub-blocks of the 8 rows, so the chunks
 * (4 of a super-block's 18 lines) run one after the other over a pass's super-blocks, each with its C
 * accumulators in registers and the pass's factors (f) in L1; every accumulator still takes its terms
 * super-block by super-block. */
DD_INLINE void kil_stripe_wide(const uint8_t *w, const uint8_t *end, size_t nsb, const int8_t *const q[4],
                               const float *const t[4], float *y, size_t ldy, const int C)
{
    __m512 acc[4][4];
    kil_factors f[KIL_PASS_SB];
    for (int c = 0; c < C; c++)
        for (int j = 0; j < 4; j++)
            acc[c][j] = _mm512_setzero_ps();
    for (size_t s0 = 0; s0 < nsb; s0 += KIL_PASS_SB) {
        const size_t n = nsb - s0 < KIL_PASS_SB ? nsb - s0 : KIL_PASS_SB;
        const uint8_t *base = w + s0 * Q4K_IL_BLOCK_BYTES;
        for (size_t s = 0; s < n; s++)
            kil_factors_of(base + s * Q4K_IL_BLOCK_BYTES, &f[s]);
        for (int j = 0; j < 4; j++) {
            __m512 a[4];
            for (int c = 0; c < C; c++)
                a[c] = acc[c][j];
            for (size_t s = 0; s < n; s++) {
                const uint8_t *blk = base + s * Q4K_IL_BLOCK_BYTES, *pf = blk + Q4K_IL_PREFETCH_BYTES;
                if (pf + Q4K_IL_BLOCK_BYTES <= end)   /* a quarter of the lines each pass */
                    for (int l = j; l < Q4K_IL_BLOCK_BYTES / 64; l += 4)
                        dd_prefetch_weight(pf + 64 * l);
                const size_t at = (s0 + s) * DD_QK_K + 64 * j;
                __m512i sums[4];
                for (int c = 0; c < C; c++)
                    sums[c] = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int u = 0; u < 8; u++)
                    kil_run(blk, j, u, q, at, sums, 1, C);
                for (int c = 0; c < C; c++)
                    a[c] = kil_term(sums[c], &f[s], j, t[c] + 16 * (s0 + s), a[c]);
            }
            for (int c = 0; c < C; c++)
                acc[c][j] = a[c];
        }
    }
    kil_store((const __m512 (*)[4])acc, y, ldy, C);
}

/* Column c's terms of nsb super-blocks, exactly: t[16 sb + i] = block i's scale da_i (over 16 for odd i, the
 * high-nibble sub-blocks), t[16 sb + 8 + i] = da_i bs_i (the scale times the block's sum: 11 + 12 bits). */
DD_INLINE void kil_col_terms(const dd_acts *a, size_t c, size_t nsb, float *t)
{
    const __m256 sixteenth = _mm256_setr_ps(1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f);
    for (size_t sb = 0; sb < nsb; sb++) {
        const size_t b = c * a->nbp + 8 * sb;
        const __m256 da = _mm256_loadu_ps(a->bd + b);
        _mm256_storeu_ps(t + 16 * sb, _mm256_mul_ps(da, sixteenth));
        _mm256_storeu_ps(t + 16 * sb + 8,
                         _mm256_mul_ps(da, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(a->bs + b)))));
    }
}

/* Super-block columns whose terms a GEMV call holds (16 KiB of f32): all DD_IL_GEMV_COLS columns of rows up to 32
 * super-blocks (k = 8192), two of the longest (DD_Q4_K_IL_MAX_ROW_BYTES: 112). */
#define KIL_TERM_SB 256

/* The level's interleaved Q4_K GEMV (dd_gemm_q4_k_il's `il`): `stripes` 8-row stripes at w (8 * row_bytes
 * each), stripes_avail of them from w on (prefetch bound), a->m <= DD_IL_GEMV_COLS columns of activations ->
 * y[c * ldy + 0 .. 8 * stripes). The columns' terms are formed once per call, as many columns at a time as
 * KIL_TERM_SB holds; each stripe meets them four at a time and the 1-3 left over together, 3 or 4 by
 * kil_stripe_wide, 1 or 2 by kil_stripe_pair: each column's terms are the same f32 operations on the same values
 * whichever walk and partners it has, so it gets the one-column bits. */
static void gemv_q4_k_il(const uint8_t *w, size_t row_bytes, size_t stripes, size_t stripes_avail,
                         const dd_acts *a, float *y, size_t ldy)
{
    const size_t nsb = row_bytes / DD_Q4_K_BYTES, group = KIL_TERM_SB / nsb;
    const uint8_t *end = w + stripes_avail * 8 * row_bytes;
    float terms[16 * KIL_TERM_SB];
    for (size_t g0 = 0; g0 < a->m; g0 += group) {
        const size_t n = a->m - g0 < group ? a->m - g0 : group;
        for (size_t t = 0; t < n; t++)
            kil_col_terms(a, g0 + t, nsb, terms + 16 * nsb * t);
        for (size_t s = 0; s < stripes; s++)
            for (size_t t = 0, c; t < n; t += c) {
                c = n - t >= 4 ? 4 : n - t;
                const int8_t *q[4];
                const float *ts[4];
                for (size_t i = 0; i < 4; i++) {   /* past the last column: repeats of it, never read */
                    const size_t u = t + (i < c ? i : c - 1);
                    q[i] = a->q + (g0 + u) * a->nbp * DD_QK;
                    ts[i] = terms + 16 * nsb * u;
                }
                const uint8_t *st = w + s * 8 * row_bytes;
                float *out = y + (g0 + t) * ldy + 8 * s;
                switch (c) {
                case 1: kil_stripe_pair(st, end, nsb, q, ts, out, ldy, 1); break;
                case 2: kil_stripe_pair(st, end, nsb, q, ts, out, ldy, 2); break;
                case 3: kil_stripe_wide(st, end, nsb, q, ts, out, ldy, 3); break;
                default: kil_stripe_wide(st, end, nsb, q, ts, out, ldy, 4); break;
                }
            }
    }
}

/* Row r's 12 scale bytes of an interleaved super-block (blk) to rows0 + r * row_bytes + 4, r < 8. The stored
 * bytes are, per sub-block pair i, i + 4 (i < 4) and row: S (scale low bits i | i + 4 << 4), M (the mins'), H (top
 * bits); ggml's bytes i, 4 + i and 8 + i are (S & 15) | (H & 15) << 4, (M & 15) | (H & 0xf0) and S >> 4 | (M & 0xf0)
 * (get_scale_min_k4 read backwards), each computed for the 8 rows at once (byte 8 i + r) and regrouped by row. */
DD_INLINE void deil_q4_k_scales(const uint8_t *blk, uint8_t *rows0, size_t row_bytes)
{
    const __m256i m0f = _mm256_set1_epi8(0x0f), mf0 = _mm256_set1_epi8((char)0xf0);
    const __m256i s = _mm256_loadu_si256((const __m256i *)(blk + 32)), m = _mm256_loadu_si256((const __m256i *)(blk + 64));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 96));
    const __m256i bytes[3] = {
        _mm256_or_si256(_mm256_and_si256(s, m0f), _mm256_and_si256(_mm256_slli_epi16(h, 4), mf0)),
        _mm256_or_si256(_mm256_and_si256(m, m0f), _mm256_and_si256(h, mf0)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(s, 4), m0f), _mm256_and_si256(m, mf0)),
    };
    /* in each 128-bit lane (i = 2 l, 2 l + 1): byte 8 (i % 2) + r -> 2 r + i % 2; then the lanes' pairs by row */
    const __m256i pairs = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15));
    uint32_t out[3][8];   /* out[t][r]: ggml's scale bytes 4 t .. 4 t + 3 of row r */
    for (int t = 0; t < 3; t++) {
        const __m256i v = _mm256_shuffle_epi8(bytes[t], pairs);
        const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
        _mm_storeu_si128((__m128i *)out[t], _mm_unpacklo_epi16(lo, hi));
        _mm_storeu_si128((__m128i *)(out[t] + 4), _mm_unpackhi_epi16(lo, hi));
    }
    for (size_t r = 0; r < 8; r++) {
        uint8_t *row = rows0 + r * row_bytes;
        memcpy(row, blk + 2 * r, 2);
        memcpy(row + 2, blk + 16 + 2 * r, 2);
        for (int t = 0; t < 3; t++)
            memcpy(row + 4 + 4 * t, &out[t][r], 4);
    }
}

/* The level's de-interleave (dd_gemm_q4_k_il's `deil`): `stripes` stripes at src to their row-major rows at dst.
 * Chunk j of a super-block is an 8 x 8 matrix of dwords (run u of row r at dword 8 u + r); two rounds of
 * 2-source dword permutes transpose it: runs 0-3 and 4-7 of rows 0-3 and 4-7 (as deil_q4_0), then each row's
 * 8 runs side by side, two rows to a vector. */
static void deil_q4_k(uint8_t *dst, const uint8_t *src, size_t stripes, size_t row_bytes)
{
    const size_t nsb = row_bytes / DD_Q4_K_BYTES;
    const __m512i lo = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(4));
    const __m512i r01 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i r23 = _mm512_add_epi32(r01, _mm512_set1_epi32(8));
    for (size_t s = 0; s < stripes; s++)
        for (size_t b = 0; b < nsb; b++) {
            const uint8_t *blk = src + s * 8 * row_bytes + b * Q4K_IL_BLOCK_BYTES;
            uint8_t *out = dst + s * 8 * row_bytes + b * DD_Q4_K_BYTES;
            deil_q4_k_scales(blk, out, row_bytes);
            for (size_t j = 0; j < 4; j++) {
                const uint8_t *c = blk + 128 + 256 * j;
                const __m512i z0 = _mm512_loadu_si512(c), z1 = _mm512_loadu_si512(c + 64);
                const __m512i z2 = _mm512_loadu_si512(c + 128), z3 = _mm512_loadu_si512(c + 192);
                const __m512i t[4] = { _mm512_permutex2var_epi32(z0, lo, z1), _mm512_permutex2var_epi32(z2, lo, z3),
                                       _mm512_permutex2var_epi32(z0, hi, z1), _mm512_permutex2var_epi32(z2, hi, z3) };
                for (size_t g = 0; g < 2; g++)   /* rows 4 g .. 4 g + 3 */
                    for (size_t p = 0; p < 2; p++) {   /* rows 4 g + 2 p, + 1 */
                        const __m512i two = _mm512_permutex2var_epi32(t[2 * g], p ? r23 : r01, t[2 * g + 1]);
                        uint8_t *row = out + (4 * g + 2 * p) * row_bytes + 16 + 32 * j;
                        _mm256_storeu_si256((__m256i *)row, _mm512_castsi512_si256(two));
                        _mm256_storeu_si256((__m256i *)(row + row_bytes), _mm512_extracti64x4_epi64(two, 1));
                    }
            }
        }
}

/* Interleaved Q4_K stripes (DD_Q4_K_IL) expanded straight into the kqx_rows of their row pairs for kqx_range
 * (kq_gemm_avx512.h): vector t of pair p, lane 8 rr + 2 j + h, holds row 2 p + rr's qs bytes 32 j + 4 t .. + 3
 * (run (j, t)) masked to nibble h, one 2-source dword permute of runs (0, t) .. (3, t) and a mask; the scales
 * come from kil_scales' bytes (8 i + r) regrouped by row (8 r + i) with a byte shuffle and a word permute. The
 * rows kqx_expand_row gives, but for the high nibbles' factor 16 (kqx_expand_il): the same bits. */
static const int32_t kqx_il_idx[16] = { 0, 0, 8, 8, 16, 16, 24, 24, 1, 1, 9, 9, 17, 17, 25, 25 };
static const int16_t kqx_il_words[32] = { 0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27,
                                          4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31 };

/* Bytes 8 i + r of v (64) to 8 r + i in out: in each 128-bit lane byte 8 h + r to word r's byte h, then the
 * words (lane L, word r) to word 4 r + L. */
DD_INLINE void kqx_il_by_row(const uint8_t v[64], uint8_t out[64])
{
    const __m512i pairs = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15));
    const __m512i x = _mm512_shuffle_epi8(_mm512_loadu_si512(v), pairs);
    _mm512_storeu_si512(out, _mm512_permutexvar_epi16(_mm512_loadu_si512(kqx_il_words), x));
}

/* One interleaved super-block (blk) of a stripe into its 4 pairs' super-block at e[0], e[nsb], e[2 nsb], e[3 nsb].
 * A high-nibble lane (odd: sub-blocks 2 j + 1) is masked, not shifted, so it holds 16 times the quant and its
 * d sc_i is stored over 16 (exact): the tile's ((d sc_i / 16) da_i)(16 S_i) is then ((d sc_i) da_i) S_i scaled
 * by powers of two, 16 S_i < 2^21: the same f32 roundings, the same bits. */
DD_INLINE void kqx_expand_il(const uint8_t *blk, kqx_rows *e, size_t nsb)
{
    const __m512i nib = _mm512_set1_epi64((long long)0xf0f0f0f00f0f0f0fULL), base = _mm512_loadu_si512(kqx_il_idx);
    const __m256 sixteenth = _mm256_setr_ps(1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f);
    for (int t = 0; t < 8; t++) {
        const uint8_t *run = blk + 128 + 32 * t;
        const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)run)),
                                             _mm256_loadu_si256((const __m256i *)(run + 256)), 1);
        const __m512i y = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(run + 512))),
                                             _mm256_loadu_si256((const __m256i *)(run + 768)), 1);
        for (int p = 0; p < 4; p++) {
            const __m512i v = _mm512_permutex2var_epi32(x, _mm512_add_epi32(base, _mm512_set1_epi32(2 * p)), y);
            _mm512_store_si512(&e[p * nsb].q[t], _mm512_and_si512(v, nib));
        }
    }
    uint8_t sc[64], mn[64], scr[64], mnr[64];
    kil_scales(blk, sc, mn);
    kqx_il_by_row(sc, scr);
    kqx_il_by_row(mn, mnr);
    float d[8], dmin[8];
    _mm256_storeu_ps(d, _mm256_maskz_cvtph_ps(0xff, _mm_loadu_si128((const __m128i *)blk)));
    _mm256_storeu_ps(dmin, _mm256_maskz_cvtph_ps(0xff, _mm_loadu_si128((const __m128i *)(blk + 16))));
    for (int r = 0; r < 8; r++) {
        const __m256 sc8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(scr + 8 * r))));
        const __m256 mn8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mnr + 8 * r))));
        float *f = (float *)e[r / 2 * nsb].f;
        _mm256_storeu_ps(f + 8 * (r % 2), _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d[r]), sixteenth), sc8));
        _mm256_storeu_ps(f + 16 + 8 * (r % 2), _mm256_mul_ps(_mm256_set1_ps(dmin[r]), mn8));
    }
}

/* The stripes of an interleaved Q4_K matrix (`stripes` at w, stripes_avail from w on: the prefetch bound) x all
 * columns, as kqx_gemm on their row-major rows (ranges of whole stripes). The expansion reads the stripes as one
 * stream and prefetches it Q4K_IL_PREFETCH_BYTES ahead, as the GEMV does (one stripe ahead was too late for
 * short rows). Not inlined: its stack buffers stay apart from the row-major tail's. */
__attribute__((noinline)) static void kqx_gemm_il(const uint8_t *w, size_t rb, size_t stripes, size_t stripes_avail,
                                                   const dd_acts *a, float *y, size_t ldy)
{
    kqx_rows e[KQX_W_SB];
    kqx_col cols[KQX_A_SB];
    const size_t nsb = a->nb / 8, per = KQX_W_SB / nsb / 4;
    const uint8_t *end = w + stripes_avail * 8 * rb;
    dd_prefetch_rows(w, 1, stripes * 8 * rb < Q4K_IL_PREFETCH_BYTES ? stripes * 8 * rb : Q4K_IL_PREFETCH_BYTES);
    for (size_t s0 = 0; s0 < stripes; s0 += per) {
        const size_t n = stripes - s0 < per ? stripes - s0 : per;
        for (size_t s = 0; s < n; s++)
            for (size_t sb = 0; sb < nsb; sb++) {
                const uint8_t *blk = w + (s0 + s) * 8 * rb + sb * Q4K_IL_BLOCK_BYTES, *pf = blk + Q4K_IL_PREFETCH_BYTES;
                if (pf + Q4K_IL_BLOCK_BYTES <= end)
                    for (int l = 0; l < Q4K_IL_BLOCK_BYTES / 64; l++)
                        dd_prefetch_weight(pf + 64 * l);
                kqx_expand_il(blk, e + 4 * s * nsb + sb, nsb);
            }
        kqx_range(e, 4 * n, 8 * n, a, cols, y + 8 * s0, ldy, DD_Q4_K, 2);
    }
}

/* gemm[DD_Q4_K_IL] of this level: more than DD_IL_GEMV_COLS columns, with rows kqx_gemm takes (KQX_FITS), read
 * the stripes directly (kqx_gemm_il) and the rows % 8 tail by gemm_q4_K; everything else goes to dd_gemm_q4_k_il
 * (the GEMV, or the stripes de-interleaved for gemm_q4_K). */
static void gemm_q4_k_il(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a,
                         float *y, size_t ldy)
{
    const size_t stripes = nrows / 8;
    if (a->m <= DD_IL_GEMV_COLS || stripes == 0 || !KQX_FITS(a)) {
        dd_gemm_q4_k_il(gemm_q4_K, gemv_q4_k_il, deil_q4_k, w, row_bytes, nrows, rows_avail, a, y, ldy);
        return;
    }
    kqx_gemm_il(w, row_bytes, stripes, rows_avail / 8, a, y, ldy);
    if (nrows > 8 * stripes)
        gemm_q4_K(w + 8 * stripes * row_bytes, row_bytes, nrows - 8 * stripes, rows_avail - 8 * stripes, a,
                  y + 8 * stripes, ldy);
}

#endif
