/* Kernels for Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS and MXFP4 weights read as stored (no conversion at load),
 * against Q8_0 activations. One definition, included by every kernel file after it defines
 * DD_BQ_LEVEL (0 scalar, 1 SSSE3, 2 AVX2, 3 AVX-512 VNNI); the levels differ only in how the
 * integer dot product of a block is taken (dd_bq_dot8), never in the floating-point values (AVX-512's
 * prompt GEMM forms the same exact products as FMAs: DD_BQ_GEMM).
 *
 * Block layouts (ggml-common.h block_q4_1, block_q5_0, block_q5_1, block_iq4_nl, block_iq4_xs;
 * values as ggml-quants.c dequantize_row_*; checked against gguf-py's gguf/quants.py):
 *   block_q4_1   (20 bytes, 32 values): f16 d, f16 m, qs[16]; value j < 16 is the low nibble of
 *                qs[j], value j + 16 its high nibble; x = d * q + m.
 *   block_q5_0   (22 bytes): f16 d, qh[4] (a little-endian u32), qs[16]; q = nibble | (bit j of
 *                qh) << 4 for value j (j + 16: the high nibble and bit j + 16); x = d * (q - 16).
 *   block_q5_1   (24 bytes): f16 d, f16 m, qh[4], qs[16]; q as Q5_0; x = d * q + m.
 *   block_iq4_nl (18 bytes): f16 d, qs[16]; nibbles as Q4_1 index the non-linear int8 codebook
 *                kvalues_iq4nl; x = d * kvalues_iq4nl[nibble].
 *   block_iq4_xs (136 bytes, 256 values): f16 d, u16 scales_h, scales_l[4], qs[128]; sub-block
 *                i (32 values) has the 6-bit ls_i = (scales_l[i / 2] >> 4 (i % 2) & 15) |
 *                (scales_h >> 2i & 3) << 4 and its nibbles in qs[16i .. 16i + 15] as IQ4_NL;
 *                x = d * (ls_i - 32) * kvalues_iq4nl[nibble].
 *   block_mxfp4  (17 bytes, 32 values): e8m0 e, qs[16] as IQ4_NL indexing kvalues_mxfp4 (the e2m1 values
 *                doubled); d = ggml_e8m0_to_fp32_half(e) = 2^(e - 128) (e < 2: the f32 subnormals 2^-129,
 *                2^-128); x = d * kvalues_mxfp4[nibble].
 *
 * Exactness. Eight consecutive 32-value blocks form a group (for IQ4_XS
 * a super-block); block i meets activation block b (32 int8 a_j, f32 scale da, sum S). Its integer
 * part is exact in int32: I = sum q a (Q4_1, Q5_1), sum q a - 16 S (Q5_0), sum kv a (IQ4_NL),
 * (ls_i - 32) sum kv a (IQ4_XS). It is scaled by an exact f32 product of two f16 scales (d * da; MXFP4:
 * a power of two times da, exact unless it falls below 2^-126 or overflows, far from real weights' scales)
 * into an exact f64 product, which lane i of the (row, column) accumulator adds; Q4_1 / Q5_1 then
 * add the exact (m * da) * S. A row's last group may be short: its missing lanes add +0. The 8
 * lanes are added in a fixed tree and rounded to f32 once. Every level runs these f64 operations in
 * this order, so results are bit-identical across levels, thread counts and tiles, and equal the
 * numpy twin (engine.kernels.cpu_twins.bquant_product_np), which replays the same order.
 */
#ifndef DELTADESK_BQUANTS_H
#define DELTADESK_BQUANTS_H

#include "gemm_tiles.h"
#include "kernels.h"

#ifndef DD_BQ_LEVEL
#error "define DD_BQ_LEVEL before including bquants.h"
#endif

#if DD_BQ_LEVEL >= 1
#include <immintrin.h>
#endif

/* ggml-common.h kvalues_iq4nl */
static const int8_t dd_kvalues_iq4nl[16] = { -127, -104, -83, -65, -49, -35, -22, -10,
                                             1, 13, 25, 38, 53, 69, 89, 113 };
/* ggml-common.h kvalues_mxfp4 */
static const int8_t dd_kvalues_mxfp4[16] = { 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12 };

/* Where a type's fields sit in its block. */
typedef struct {
    int bytes;   /* of a block (IQ4_XS: of the super-block) */
    int qs;      /* offset of the 16 nibble bytes of block 0 */
    int qh;      /* offset of the 4 fifth-bit bytes, or -1 */
    int min;     /* 1: an f16 m follows d (Q4_1, Q5_1) */
    int code;    /* 1: nibbles index kvalues_iq4nl, 2: kvalues_mxfp4 */
} dd_bq_layout;

DD_INLINE dd_bq_layout dd_bq_layout_of(int wtype)
{
    switch (wtype) {
    case DD_Q4_1: return (dd_bq_layout){ DD_Q4_1_BYTES, 4, -1, 1, 0 };
    case DD_Q5_0: return (dd_bq_layout){ DD_Q5_0_BYTES, 6, 2, 0, 0 };
    case DD_Q5_1: return (dd_bq_layout){ DD_Q5_1_BYTES, 8, 4, 1, 0 };
    case DD_IQ4_NL: return (dd_bq_layout){ DD_IQ4_NL_BYTES, 2, -1, 0, 1 };
    case DD_MXFP4: return (dd_bq_layout){ DD_MXFP4_BYTES, 1, -1, 0, 2 };
    default: return (dd_bq_layout){ DD_IQ4_XS_BYTES, 8, -1, 0, 1 };
    }
}

/* Block i of a group: its bytes (IQ4_XS: its nibbles sit 16i bytes into the super-block's qs). */
DD_INLINE const uint8_t *dd_bq_qs(const uint8_t *g, int wtype, dd_bq_layout L, int i)
{
    return wtype == DD_IQ4_XS ? g + L.qs + 16 * i : g + (size_t)i * L.bytes + L.qs;
}

DD_INLINE uint32_t dd_bq_qh(const uint8_t *g, dd_bq_layout L, int i)
{
    uint32_t h;
    memcpy(&h, g + (size_t)i * L.bytes + L.qh, 4);
    return h;
}

/* One column's activations of a group, arranged once for the R rows of a tile: the 8 blocks' values
 * (a) and sums (bs, zero past n); AVX-512 also the block pairs in its weight lane order (v). */
typedef struct {
    const int8_t *a;
    dd_v8i bs;
#if DD_BQ_LEVEL >= 3
    __m512i v[4];
#endif
} dd_bq_acts;

DD_INLINE void dd_bq_prep(const int8_t *a, dd_v8i bs, int n, dd_bq_acts *p)
{
    p->a = a;
    p->bs = bs;
#if DD_BQ_LEVEL >= 3
    /* pair q = blocks 2q, 2q + 1 (64 bytes; a lone last block meets the zero padding block): 128-bit
     * lanes [values 0-15 of 2q | 0-15 of 2q + 1 | 16-31 of 2q | 16-31 of 2q + 1] */
    const __m512i order = _mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7);
    for (int q = 0; q < 4; q++)
        if (2 * q < n)
            p->v[q] = _mm512_permutexvar_epi64(order, _mm512_loadu_si512(a + 64 * q));
#else
    (void)n;
#endif
}

#if DD_BQ_LEVEL == 0
/* out[i] = sum_j v_j a_j over block i < n (v = q, or kvalues_iq4nl[nibble]); element by element. */
DD_INLINE void dd_bq_dot8(const uint8_t *g, int wtype, int n, const dd_bq_acts *p, int32_t out[8])
{
    const int8_t *a = p->a;
    const dd_bq_layout L = dd_bq_layout_of(wtype);
    for (int i = 0; i < n; i++) {
        const uint8_t *qs = dd_bq_qs(g, wtype, L, i);
        const uint32_t qh = L.qh >= 0 ? dd_bq_qh(g, L, i) : 0;
        int32_t s = 0;
        for (int j = 0; j < DD_QK; j++) {
            int v = j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
            v = L.code == 1 ? dd_kvalues_iq4nl[v] : L.code == 2 ? dd_kvalues_mxfp4[v] : v | (int)((qh >> j) & 1) << 4;
            s += v * a[DD_QK * i + j];
        }
        out[i] = s;
    }
    for (int i = n; i < 8; i++)
        out[i] = 0;
}
#elif DD_BQ_LEVEL == 1
/* One block as two xmm of values 0-15 and 16-31: nibbles, plus 16 where the block's qh bit is set
 * (a byte shuffle spreads qh byte j / 8 to byte j, the bit test picks bit j % 8), or the codebook
 * looked up by pshufb. pmaddubsw wants an unsigned side: the quants, or |kv| with kv's sign moved
 * onto the activations (no product pair exceeds 2 * 127 * 127). pmaddwd by ones, then a phaddd tree. */
DD_INLINE void dd_bq_dot8(const uint8_t *g, int wtype, int n, const dd_bq_acts *p, int32_t out[8])
{
    const int8_t *a = p->a;
    const dd_bq_layout L = dd_bq_layout_of(wtype);
    const __m128i low = _mm_set1_epi8(0x0f), ones = _mm_set1_epi16(1);
    const __m128i bits = _mm_set1_epi64x((long long)0x8040201008040201ull), sixteen = _mm_set1_epi8(0x10);
    const __m128i code = _mm_loadu_si128((const __m128i *)(L.code == 2 ? dd_kvalues_mxfp4 : dd_kvalues_iq4nl));
    __m128i v[8];
    for (int i = 0; i < 8; i++) {
        if (i >= n) {
            v[i] = _mm_setzero_si128();
            continue;
        }
        const __m128i qs = _mm_loadu_si128((const __m128i *)dd_bq_qs(g, wtype, L, i));
        __m128i w[2] = { _mm_and_si128(qs, low), _mm_and_si128(_mm_srli_epi16(qs, 4), low) };
        if (L.qh >= 0) {
            const __m128i h = _mm_cvtsi32_si128((int)dd_bq_qh(g, L, i));
            for (int t = 0; t < 2; t++) {
                const __m128i spread = _mm_shuffle_epi8(h, _mm_set_epi64x(0x0101010101010101ll * (2 * t + 1),
                                                                           0x0101010101010101ll * (2 * t)));
                const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(spread, bits), bits);
                w[t] = _mm_or_si128(w[t], _mm_and_si128(set, sixteen));
            }
        }
        __m128i s = _mm_setzero_si128();
        for (int t = 0; t < 2; t++) {
            const __m128i at = _mm_loadu_si128((const __m128i *)(a + DD_QK * i + 16 * t));
            __m128i p;
            if (L.code) {
                const __m128i kv = _mm_shuffle_epi8(code, w[t]);
                p = _mm_maddubs_epi16(_mm_sign_epi8(kv, kv), _mm_sign_epi8(at, kv));
            } else {
                p = _mm_maddubs_epi16(w[t], at);
            }
            s = _mm_add_epi32(s, _mm_madd_epi16(p, ones));
        }
        v[i] = s;
    }
    for (int q = 0; q < 2; q++) {
        const __m128i h01 = _mm_hadd_epi32(v[4 * q], v[4 * q + 1]), h23 = _mm_hadd_epi32(v[4 * q + 2], v[4 * q + 3]);
        _mm_storeu_si128((__m128i *)(out + 4 * q), _mm_hadd_epi32(h01, h23));
    }
}
#elif DD_BQ_LEVEL == 2
/* One ymm per block, values in order (low nibbles in the low 128 bits, high in the high); the qh
 * bits and the codebook as at SSSE3; vpmaddubsw + vpmaddwd by ones. The 8 int32 lanes of each
 * block are summed by a vphaddd tree. */
DD_INLINE __m256i dd_bq_madd(__m256i u, __m256i s)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

DD_INLINE void dd_bq_dot8(const uint8_t *g, int wtype, int n, const dd_bq_acts *p, int32_t out[8])
{
    const int8_t *a = p->a;
    const dd_bq_layout L = dd_bq_layout_of(wtype);
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ull), sixteen = _mm256_set1_epi8(0x10);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303ll, 0x0202020202020202ll, 0x0101010101010101ll, 0);
    const __m256i code = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)(L.code == 2 ? dd_kvalues_mxfp4 : dd_kvalues_iq4nl)));
    __m256i v[8];
    for (int i = 0; i < 8; i++) {
        if (i >= n) {
            v[i] = _mm256_setzero_si256();
            continue;
        }
        const __m128i qs = _mm_loadu_si128((const __m128i *)dd_bq_qs(g, wtype, L, i));
        __m256i w = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(qs), _mm_srli_epi16(qs, 4), 1), low);
        const __m256i at = _mm256_loadu_si256((const __m256i *)(a + DD_QK * i));
        if (L.qh >= 0) {
            const __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)dd_bq_qh(g, L, i)), spread);
            w = _mm256_or_si256(w, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bits), bits), sixteen));
        }
        if (L.code) {
            const __m256i kv = _mm256_shuffle_epi8(code, w);
            v[i] = dd_bq_madd(_mm256_sign_epi8(kv, kv), _mm256_sign_epi8(at, kv));
        } else {
            v[i] = dd_bq_madd(w, at);
        }
    }
    const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
    /* lo: blocks 0-3 from the low 128-bit lanes, then from the high ones; hi likewise for 4-7 */
    const __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
    _mm256_storeu_si256((__m256i *)out, sum);
}
#else
/* ggml-common.h kvalues_iq4nl + 128: unsigned bytes for vpdpbusd (the sum then loses 128 S) */
static const uint8_t dd_kvalues_iq4nl_u8[16] = { 1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241 };
/* kvalues_mxfp4 + 128 */
static const uint8_t dd_kvalues_mxfp4_u8[16] = { 128, 129, 130, 131, 132, 134, 136, 140,
                                                 128, 127, 126, 125, 124, 122, 120, 116 };

/* A block pair per zmm, in the lane order of dd_bq_prep: the two blocks' 16 nibble bytes side by
 * side, their high nibbles in the upper 256 bits; Q5 adds 16 where a byte's qh bit is set (the 4 x 16
 * bits make the byte mask directly), the IQ4 codebook (+ 128) is a vpshufb. vpdpbusd gives 4-value
 * sums; a transpose-add within 128-bit lanes (kq_transpose_add of kernels_avx512vnni.c) puts lane k
 * of pair j in lane 4k + j, so blocks 2j and 2j + 1 are lanes j + 8 and 4 + j + 12 added, then
 * gathered into block order. */
DD_INLINE void dd_bq_dot8(const uint8_t *g, int wtype, int n, const dd_bq_acts *p, int32_t out[8])
{
    const dd_bq_layout L = dd_bq_layout_of(wtype);
    const __m512i low = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(0x10);
    const __m512i code = _mm512_broadcast_i32x4(
        _mm_loadu_si128((const __m128i *)(L.code == 2 ? dd_kvalues_mxfp4_u8 : dd_kvalues_iq4nl_u8)));
    __m512i d[4];
    for (int q = 0; q < 4; q++) {
        if (2 * q >= n) {
            d[q] = _mm512_setzero_si512();
            continue;
        }
        const int two = 2 * q + 1 < n;
        const __m128i q0 = _mm_loadu_si128((const __m128i *)dd_bq_qs(g, wtype, L, 2 * q));
        const __m128i q1 = two ? _mm_loadu_si128((const __m128i *)dd_bq_qs(g, wtype, L, 2 * q + 1)) : _mm_setzero_si128();
        const __m256i t = _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1);
        __m512i w = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1), low);
        if (L.qh >= 0) {
            const uint64_t h0 = dd_bq_qh(g, L, 2 * q), h1 = two ? dd_bq_qh(g, L, 2 * q + 1) : 0;
            const __mmask64 k = (h0 & 0xffff) | (h1 & 0xffff) << 16 | (h0 >> 16) << 32 | (h1 >> 16) << 48;
            w = _mm512_mask_add_epi8(w, k, w, sixteen);
        }
        if (L.code)
            w = _mm512_shuffle_epi8(code, w);
        d[q] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, p->v[q]);
    }
    __m512i t = kq_transpose_add(d);
    t = _mm512_add_epi32(t, _mm512_alignr_epi32(t, t, 8));   /* lanes 0-3: blocks 0, 2, 4, 6; 4-7: 1, 3, 5, 7 */
    t = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 0, 0, 0, 0, 0, 0, 0, 0), t);
    __m256i r = _mm512_castsi512_si256(t);
    if (L.code) {
        __m256i bs;
        memcpy(&bs, &p->bs, sizeof bs);
        r = _mm256_sub_epi32(r, _mm256_slli_epi32(bs, 7));
    }
    _mm256_storeu_si256((__m256i *)out, r);
}
#endif

#if DD_BQ_LEVEL >= 3
#define DD_BQ_F16(p) _mm512_cvtss_f32(_mm512_cvtph_ps(_mm256_set1_epi16((short)dd_load_u16(p))))
#elif DD_BQ_LEVEL == 2
#define DD_BQ_F16(p) _cvtsh_ss(dd_load_u16(p))
#else
#define DD_BQ_F16(p) dd_f16_to_f32(dd_load_u16(p))
#endif

#if DD_BQ_LEVEL >= 2
/* 8 f16 bit patterns (in the low halves of int32 lanes) -> 8 f32 */
DD_INLINE dd_v8f dd_bq_halves(__m256i x)
{
    const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(x, x), 0x08));
#if DD_BQ_LEVEL >= 3
    return (dd_v8f)_mm512_castps512_ps256(_mm512_cvtph_ps(_mm256_castsi128_si256(h)));
#else
    return (dd_v8f)_mm256_cvtph_ps(h);
#endif
}
#endif

/* ggml_e8m0_to_fp32_half: 2^(e - 128) as f32 bits (e < 2: the subnormals 2^-129, 2^-128). */
DD_INLINE float dd_bq_e8m0(uint8_t e)
{
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if DD_BQ_LEVEL >= 3
/* dd_bq_e8m0 of the 8 blocks of a full MXFP4 group at g (their e bytes DD_MXFP4_BYTES apart), as vector code. */
DD_INLINE dd_v8f dd_bq_e8m0x8(const uint8_t *g)
{
    const __m256i e = _mm256_cvtepu8_epi32(_mm_setr_epi8((char)g[0], (char)g[17], (char)g[34], (char)g[51], (char)g[68],
                                                         (char)g[85], (char)g[102], (char)g[119], 0, 0, 0, 0, 0, 0, 0, 0));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return (dd_v8f)_mm256_castsi256_ps(_mm256_mask_blend_epi32(_mm256_cmplt_epu32_mask(e, _mm256_set1_epi32(2)), normal, sub));
}

/* acc + (f64) s * (f64) i, the operations of the other levels in 512-bit registers (GCC splits the
 * vector-extension form into 128- and 256-bit pieces). */
DD_INLINE dd_v8d dd_bq_term(dd_v8d acc, dd_v8f s, dd_v8i i)
{
    return (dd_v8d)_mm512_add_pd((__m512d)acc, _mm512_mul_pd(_mm512_cvtps_pd((__m256)s), _mm512_cvtepi32_pd((__m256i)i)));
}
#else
DD_INLINE dd_v8d dd_bq_term(dd_v8d acc, dd_v8f s, dd_v8i i)
{
    return acc + __builtin_convertvector(s, dd_v8d) * __builtin_convertvector(i, dd_v8d);
}
#endif

/* A group's f32 scales d_i and mins m_i (zero past n or without mins) and, for IQ4_XS, the
 * integer multipliers ls_i - 32 (else 1). */
DD_INLINE void dd_bq_scales(const uint8_t *g, int wtype, int n, dd_v8f *dw, dd_v8f *mw, dd_v8i *mult)
{
    const dd_bq_layout L = dd_bq_layout_of(wtype);
    dd_v8f d = { 0 }, m = { 0 };
    dd_v8i k = { 1, 1, 1, 1, 1, 1, 1, 1 };
    if (wtype == DD_IQ4_XS) {
        const float d0 = DD_BQ_F16(g);
        const uint32_t sh = dd_load_u16(g + 2);
        uint32_t sl;
        memcpy(&sl, g + 4, 4);
        d += d0;
#if DD_BQ_LEVEL >= 2
        /* nibble i of scales_l (byte i / 2, shifted by 4 (i % 2)) and bits 2i, 2i + 1 of scales_h */
        const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)sl), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                            _mm256_set1_epi32(15));
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)sh), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                            _mm256_set1_epi32(3));
        k = (dd_v8i)_mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
#else
        for (int i = 0; i < 8; i++)
            k[i] = (int32_t)(((sl >> (4 * i)) & 15) | (((sh >> (2 * i)) & 3) << 4)) - 32;
#endif
    } else if (wtype == DD_MXFP4) {
#if DD_BQ_LEVEL >= 3
        if (n == 8) {
            d = dd_bq_e8m0x8(g);
        } else
#endif
        for (int i = 0; i < n; i++)
            d[i] = dd_bq_e8m0(g[(size_t)i * L.bytes]);
    } else {
#if DD_BQ_LEVEL >= 2
        /* the 4 bytes at each block's start (d, then m or qh) in one masked gather; halves to f32 */
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i dm = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)g,
                                                       _mm256_mullo_epi32(lane, _mm256_set1_epi32(L.bytes)),
                                                       _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane), 1);
        d = dd_bq_halves(_mm256_and_si256(dm, _mm256_set1_epi32(0xffff)));
        if (L.min)
            m = dd_bq_halves(_mm256_srli_epi32(dm, 16));
#else
        for (int i = 0; i < n; i++) {
            d[i] = DD_BQ_F16(g + (size_t)i * L.bytes);
            if (L.min)
                m[i] = DD_BQ_F16(g + (size_t)i * L.bytes + 2);
        }
#endif
    }
    *dw = d;
    *mw = m;
    *mult = k;
}

DD_INLINE size_t dd_bq_group_bytes(int wtype)
{
    return wtype == DD_IQ4_XS ? DD_IQ4_XS_BYTES : 8 * (size_t)dd_bq_layout_of(wtype).bytes;
}

/* Group gi (n blocks: 8, or fewer in a row's last) of R rows x C columns into acc. */
DD_INLINE void dd_bq_group(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, int wtype, size_t c0,
                           size_t gi, const int n, dd_v8d acc[4][4], const int R, const int C)
{
    const dd_bq_layout L = dd_bq_layout_of(wtype);
    const size_t gbytes = dd_bq_group_bytes(wtype);
    const size_t gsize = wtype == DD_IQ4_XS ? gbytes : (size_t)n * L.bytes;
    dd_v8f dw[4], mw[4];
    dd_v8i mult[4];
    for (int r = 0; r < R; r++) {
        const uint8_t *p = pf + r * rb + gi * gbytes;
        for (size_t at = 0; at < gsize; at += 64)
            dd_prefetch_weight(p + at);
        dd_prefetch_weight(p + gsize - 1);
        dd_bq_scales(w + r * rb + gi * gbytes, wtype, n, &dw[r], &mw[r], &mult[r]);
    }
    for (int c = 0; c < C; c++) {
        const size_t b0 = (c0 + c) * a->nbp + 8 * gi;
        dd_v8f da = { 0 };
        dd_v8i bs = { 0 };
        if (n == 8) {
            memcpy(&da, a->bd + b0, sizeof da);
            memcpy(&bs, a->bs + b0, sizeof bs);
        } else {
            for (int i = 0; i < n; i++) {
                da[i] = a->bd[b0 + i];
                bs[i] = a->bs[b0 + i];
            }
        }
        dd_bq_acts prep;
        dd_bq_prep(a->q + b0 * DD_QK, bs, n, &prep);
        for (int r = 0; r < R; r++) {
            int32_t d8[8];
            dd_bq_dot8(w + r * rb + gi * gbytes, wtype, n, &prep, d8);
            dd_v8i dot;
            memcpy(&dot, d8, sizeof dot);
            if (wtype == DD_Q5_0)
                dot -= 16 * bs;
            if (wtype == DD_IQ4_XS)
                dot *= mult[r];
            /* lane i: (d_i da_i) I_i, exact in f64; then (Q4_1, Q5_1) plus (m_i da_i) S_i */
            acc[r][c] = dd_bq_term(acc[r][c], da * dw[r], dot);
            if (L.min)
                acc[r][c] = dd_bq_term(acc[r][c], da * mw[r], bs);
        }
    }
}

DD_INLINE void dd_bq_tile(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, int wtype, size_t c0,
                          float *y, size_t ldy, const int R, const int C)
{
    const size_t full = a->nb / 8;
    dd_v8d acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = (dd_v8d){ 0 };
    for (size_t gi = 0; gi < full; gi++)
        dd_bq_group(w, pf, rb, a, wtype, c0, gi, 8, acc, R, C);
    if (a->nb % 8)
        dd_bq_group(w, pf, rb, a, wtype, c0, full, (int)(a->nb % 8), acc, R, C);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const dd_v8d s = acc[r][c];
            y[(c0 + c) * ldy + r] = (float)(((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));
        }
}

#define DD_BQ_TILE_Q4_1(w, pf, rb, a, c0, y, ldy, R, C) dd_bq_tile(w, pf, rb, a, DD_Q4_1, c0, y, ldy, R, C)
#define DD_BQ_TILE_Q5_0(w, pf, rb, a, c0, y, ldy, R, C) dd_bq_tile(w, pf, rb, a, DD_Q5_0, c0, y, ldy, R, C)
#define DD_BQ_TILE_Q5_1(w, pf, rb, a, c0, y, ldy, R, C) dd_bq_tile(w, pf, rb, a, DD_Q5_1, c0, y, ldy, R, C)
#define DD_BQ_TILE_IQ4_NL(w, pf, rb, a, c0, y, ldy, R, C) dd_bq_tile(w, pf, rb, a, DD_IQ4_NL, c0, y, ldy, R, C)
#define DD_BQ_TILE_IQ4_XS(w, pf, rb, a, c0, y, ldy, R, C) dd_bq_tile(w, pf, rb, a, DD_IQ4_XS, c0, y, ldy, R, C)
#define DD_BQ_TILE_MXFP4(w, pf, rb, a, c0, y, ldy, R, C) dd_bq_tile(w, pf, rb, a, DD_MXFP4, c0, y, ldy, R, C)

#if DD_BQ_LEVEL >= 3
/* The 8 blocks of a group as four vectors in value order for kqx_transpose (x[v]: blocks 2v | 2v + 1, each
 * block's 32 values in order as unsigned bytes: q (Q4_1), q + 16 qh bit (Q5_0, Q5_1), kv + 128 (IQ4_NL,
 * IQ4_XS, MXFP4)); the values dd_bq_dot8 meets the activations with. */
DD_INLINE void dd_bq_values(const uint8_t *g, int wtype, __m512i x[4])
{
    const dd_bq_layout L = dd_bq_layout_of(wtype);
    const __m512i low = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(0x10);
    const __m512i code = _mm512_broadcast_i32x4(
        _mm_loadu_si128((const __m128i *)(L.code == 2 ? dd_kvalues_mxfp4_u8 : dd_kvalues_iq4nl_u8)));
    const __m512i order = _mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7);   /* [lo 2v | lo 2v+1 | hi 2v | hi 2v+1] */
    for (int v = 0; v < 4; v++) {
        const __m256i t = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)dd_bq_qs(g, wtype, L, 2 * v))),
            _mm_loadu_si128((const __m128i *)dd_bq_qs(g, wtype, L, 2 * v + 1)), 1);
        __m512i w = _mm512_permutexvar_epi64(
            order, _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1), low));
        if (L.qh >= 0)   /* byte j of block b's 32: bit j of its qh */
            w = _mm512_mask_add_epi8(w, (__mmask64)dd_bq_qh(g, L, 2 * v) | (__mmask64)dd_bq_qh(g, L, 2 * v + 1) << 32,
                                     w, sixteen);
        x[v] = L.code ? _mm512_shuffle_epi8(code, w) : w;
    }
}

/* Row r (0, 1) of a kqx_rows (kq_gemm_avx512.h) from a full group g: the values, d_i and m_i (f64; zero
 * without mins), and for IQ4_XS ls_i - 32 in lanes 8r + i of sc[0]. kqx_tile then seeds the dots with the
 * column's -16 S_i (Q5_0) or -128 S_i (the codebooks' + 128), multiplies IQ4_XS's by ls_i - 32, and takes the
 * f64 terms of dd_bq_group, (d_i da_i) I_i and (Q4_1, Q5_1) (da_i S_i) m_i: each the same product (MXFP4's
 * scale the same f32 product), in the same order, so the bits of the tiles above. */
DD_INLINE void dd_bq_expand_row(const uint8_t *g, int wtype, int r, kqx_rows *e)
{
    __m512i x[4];
    dd_bq_values(g, wtype, x);
    kqx_transpose(x, 0, (uint8_t *)e->q + 32 * r, sizeof(__m512i));
    dd_v8f dw, mw;
    dd_v8i mult;
    dd_bq_scales(g, wtype, 8, &dw, &mw, &mult);
    e->s[r][0] = _mm512_cvtps_pd((__m256)dw);
    e->s[r][1] = _mm512_cvtps_pd((__m256)mw);
    if (wtype == DD_IQ4_XS)
        _mm256_storeu_si256((__m256i *)((int32_t *)e->sc + 8 * r), (__m256i)mult);
}

/* At this level a type's product takes kqx_gemm from 3 columns (at two the tiles were 8-18 % faster). */
#define DD_BQ_GEMM(NAME, TYPE)                            \
    DD_DEFINE_GEMM(NAME##_tiles, DD_BQ_TILE_##TYPE)       \
    KQX_GEMM_FROM(NAME, DD_##TYPE, 3, NAME##_tiles)
#else
#define DD_BQ_GEMM(NAME, TYPE) DD_DEFINE_GEMM(NAME, DD_BQ_TILE_##TYPE)
#endif
DD_BQ_GEMM(gemm_q4_1, Q4_1)
DD_BQ_GEMM(gemm_q5_0, Q5_0)
DD_BQ_GEMM(gemm_q5_1, Q5_1)
DD_BQ_GEMM(gemm_iq4_nl, IQ4_NL)
DD_BQ_GEMM(gemm_iq4_xs, IQ4_XS)
DD_BQ_GEMM(gemm_mxfp4, MXFP4)

/* The kernel table's entries for these types, in enum order (DD_Q4_1 .. DD_IQ4_XS). */
#define DD_BQ_GEMMS gemm_q4_1, gemm_q5_0, gemm_q5_1, gemm_iq4_nl, gemm_iq4_xs

#endif
