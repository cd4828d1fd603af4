/* The IQ super-blocks unpacked in AVX-512 registers (F, BW, VL): the same bytes q[256], scales sc[16] and d
 * as iquants.h's dd_iq_unpack (which gives the layouts), so every level keeps the same bits.
 *
 * Each layout is read with a handful of whole-vector operations: index bytes and words by widening loads
 * (IQ2_XXS's are the low dwords of its 8 qwords: one vpmovqd), the extra index bits spread into bytes by
 * shifts of a dword (IQ2_S, IQ1_S, IQ1_M) or merged under a mask register (IQ3_S). The sign bytes of all 32
 * slots are one 256-bit vector: stored (IQ2_S, IQ3_S), the 7-bit ksigns_iq2xs indices moved into bytes with
 * their parity computed by three shift-xors (IQ2_XXS, IQ2_XS, IQ3_XXS), or a delta's sign widened (IQ1).
 * The grids of IQ2_XXS, IQ2_XS, IQ3_XXS and IQ3_S have 3 or 8 distinct values and 256 or 512 entries: their
 * entries are looked up as 16-bit codes (2 or 3 bits a value, iq_grids.c) by word permutes of the code table
 * held in 8 or 16 registers, then expanded to bytes by shifts and a vpshufb of the levels. IQ2_S (1024
 * entries) and the IQ1 grid (2048) keep 256-bit gathers of 8-byte rows. Signs are applied by vpsubb under a
 * mask register whose bit 8j + b is sign bit b of slot j. Costs: docs/design/quant-formats.md, "IQ decode on
 * AVX-512".
 */
#ifndef DELTADESK_IQUANTS_AVX512_H
#define DELTADESK_IQUANTS_AVX512_H

#include "iquants.h"

/* A super-block's values before the grid lookups: the grid indices as words (w16[0] the 32 slots; for the
 * 4-wide IQ3 grids w16[h] the pieces 32 h .. 32 h + 31), the 32 sign bytes, the scales as 16 int16. */
typedef struct {
    __m512i w16[2];
    __m256i sgn, sc;
} iqv_block;

/* Dwords of 4 7-bit fields (bits 0-27) -> the 4 fields in bytes, bit 7 clear. */
DD_INLINE __m256i iqv_spread7(__m256i a)
{
    const __m256i m = _mm256_set1_epi32(0x7f);
    const __m256i f0 = _mm256_and_si256(a, m), f1 = _mm256_and_si256(_mm256_slli_epi32(a, 1), _mm256_slli_epi32(m, 8));
    const __m256i f2 = _mm256_and_si256(_mm256_slli_epi32(a, 2), _mm256_slli_epi32(m, 16));
    const __m256i f3 = _mm256_and_si256(_mm256_slli_epi32(a, 3), _mm256_slli_epi32(m, 24));
    return _mm256_or_si256(_mm256_or_si256(f0, f1), _mm256_or_si256(f2, f3));
}

/* 7-bit bytes -> ksigns_iq2xs: the parity of each byte's bits in its bit 7 (bits shifted in from the next
 * byte reach only bits 4-7 and 2-3 of the partial sums, never the bit 0 that is kept). */
DD_INLINE __m256i iqv_ksign(__m256i g)
{
    __m256i p = _mm256_xor_si256(g, _mm256_srli_epi32(g, 4));
    p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 2));
    p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 1));
    return _mm256_or_si256(g, _mm256_slli_epi32(_mm256_and_si256(p, _mm256_set1_epi8(1)), 7));
}

/* Dword scales v (one per 32 values) -> 2v + 1 for both halves, as 16 int16. */
DD_INLINE __m256i iqv_scales32(__m256i v)
{
    const __m256i odd = _mm256_add_epi32(_mm256_slli_epi32(v, 1), _mm256_set1_epi32(1));
    return _mm256_or_si256(odd, _mm256_slli_epi32(odd, 16));
}

/* 8 bytes of nibble scales (low nibble first, one per 16 values) -> 2 ls + 1 as 16 int16. */
DD_INLINE __m256i iqv_scales_nib(const uint8_t *p)
{
    const __m128i b = _mm_loadl_epi64((const __m128i *)p), m = _mm_set1_epi8(15);
    const __m128i n = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
    const __m256i s = _mm256_cvtepu8_epi16(n);
    return _mm256_add_epi16(_mm256_slli_epi16(s, 1), _mm256_set1_epi16(1));
}

/* The little-endian u32 at p. */
DD_INLINE uint32_t iqv_u32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The little-endian u64 at p. */
DD_INLINE uint64_t iqv_u64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Word indices of 32 slots from low bytes lo[32] and high bits hb (a byte per slot, in order). */
DD_INLINE __m512i iqv_words(const uint8_t *lo, __m256i hb)
{
    return _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)lo)),
                           _mm512_slli_epi16(_mm512_cvtepu8_epi16(hb), 8));
}

/* Bytes l = 0..3 of each dword: (x >> (k l)) & m, for 8 dwords x (an index's high bits per slot). */
DD_INLINE __m256i iqv_spread_bits(__m256i x, int k, int m)
{
    const __m256i f = _mm256_set1_epi32(m);
    const __m256i f0 = _mm256_and_si256(x, f), f1 = _mm256_and_si256(_mm256_slli_epi32(x, 8 - k), _mm256_slli_epi32(f, 8));
    const __m256i f2 = _mm256_and_si256(_mm256_slli_epi32(x, 16 - 2 * k), _mm256_slli_epi32(f, 16));
    const __m256i f3 = _mm256_and_si256(_mm256_slli_epi32(x, 24 - 3 * k), _mm256_slli_epi32(f, 24));
    return _mm256_or_si256(_mm256_or_si256(f0, f1), _mm256_or_si256(f2, f3));
}

DD_INLINE void iqv_fields(const uint8_t *blk, int wtype, iqv_block *f)
{
    switch (wtype) {
    case DD_IQ2_XXS: {   /* qword ib at 2 + 8 ib: 4 index bytes, then the u32 of signs and ls */
        const __m512i x = _mm512_loadu_si512(blk + 2);
        const __m256i a = _mm512_cvtepi64_epi32(_mm512_srli_epi64(x, 32));
        f->w16[0] = _mm512_cvtepu8_epi16(_mm512_cvtepi64_epi32(x));
        f->sgn = iqv_ksign(iqv_spread7(a));
        f->sc = iqv_scales32(_mm256_srli_epi32(a, 28));
        break;
    }
    case DD_IQ2_XS: {    /* u16 qs[32]: 9 index bits, 7 sign-index bits */
        const __m512i w = _mm512_loadu_si512(blk + 2);
        f->w16[0] = _mm512_and_si512(w, _mm512_set1_epi16(511));
        f->sgn = iqv_ksign(_mm512_cvtepi16_epi8(_mm512_srli_epi16(w, 9)));
        f->sc = iqv_scales_nib(blk + 66);
        break;
    }
    case DD_IQ2_S: {     /* qs[32], then 2 bits per slot of qh[s / 4] */
        const __m256i qh = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 66)));
        f->w16[0] = iqv_words(blk + 2, iqv_spread_bits(qh, 2, 3));
        f->sgn = _mm256_loadu_si256((const __m256i *)(blk + 34));
        f->sc = iqv_scales_nib(blk + 74);
        break;
    }
    case DD_IQ3_XXS: {   /* qs[64] a byte per 4-value piece, then the u32s of signs and ls */
        const __m256i a = _mm256_loadu_si256((const __m256i *)(blk + 66));
        for (int h = 0; h < 2; h++)
            f->w16[h] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 2 + 32 * h)));
        f->sgn = iqv_ksign(iqv_spread7(a));
        f->sc = iqv_scales32(_mm256_srli_epi32(a, 28));
        break;
    }
    case DD_IQ3_S: {     /* qs[64], bit p % 8 of qh[p / 8], stored signs, nibble ls per 32 values */
        for (int h = 0; h < 2; h++) {
            const __m512i lo = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 2 + 32 * h)));
            f->w16[h] = _mm512_mask_add_epi16(lo, _cvtu32_mask32(iqv_u32(blk + 66 + 4 * h)), lo, _mm512_set1_epi16(256));
        }
        f->sgn = _mm256_loadu_si256((const __m256i *)(blk + 74));
        const __m256i ls = _mm256_srlv_epi32(_mm256_set1_epi32((int)iqv_u32(blk + 106)),
                                             _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        f->sc = iqv_scales32(_mm256_and_si256(ls, _mm256_set1_epi32(15)));
        break;
    }
    case DD_IQ1_S: {     /* qs[32], u16 qh[8]: 3 index bits per slot, ls in bits 12-14, delta's sign bit 15 */
        const __m128i qh = _mm_loadu_si128((const __m128i *)(blk + 34));
        const __m256i x = _mm256_cvtepu16_epi32(qh);
        f->w16[0] = iqv_words(blk + 2, iqv_spread_bits(x, 3, 7));
        f->sgn = _mm256_cvtepi16_epi32(_mm_srai_epi16(qh, 15));
        f->sc = iqv_scales32(_mm256_and_si256(_mm256_srli_epi32(x, 12), _mm256_set1_epi32(7)));
        break;
    }
    default: {           /* DD_IQ1_M: qs[32], a nibble per slot in qh[16], 3-bit ls in u16 scales[4] */
        const __m128i qh = _mm_loadu_si128((const __m128i *)(blk + 32)), m = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(qh, m), hi = _mm_and_si128(_mm_srli_epi16(qh, 4), m);
        const __m256i n = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(lo, hi)),
                                                  _mm_unpackhi_epi8(lo, hi), 1);
        f->w16[0] = iqv_words(blk, _mm256_and_si256(n, _mm256_set1_epi8(7)));
        f->sgn = _mm256_movm_epi8(_mm256_test_epi8_mask(n, _mm256_set1_epi8(8)));
        const __m256i s = _mm256_permutexvar_epi16(_mm256_setr_epi16(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                                   _mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(blk + 48))));
        const __m256i sh = _mm256_setr_epi16(0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9);
        const __m256i ls = _mm256_and_si256(_mm256_srlv_epi16(s, sh), _mm256_set1_epi16(7));
        f->sc = _mm256_add_epi16(_mm256_slli_epi16(ls, 1), _mm256_set1_epi16(1));
        break;
    }
    }
}

/* Where a grid's codes and levels are (dd_iq_codes, dd_iq_levels), for the types looked up in registers. */
DD_INLINE int iqv_code_table(int wtype)
{
    switch (wtype) {
    case DD_IQ2_XXS: return 0;
    case DD_IQ2_XS: return 1;
    case DD_IQ3_XXS: return 2;
    case DD_IQ3_S: return 3;
    default: return -1;
    }
}

DD_INLINE __m512i iqv_iota16(void)
{
    return _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                            15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
}

/* The codes of 32 entries with word indices w (below 256 or 512 = 32 words times 2 n registers) by word
 * permutes of the table held in registers, each pair covering 64 entries, picked by index bits 6 .. 8. */
DD_INLINE __m512i iqv_codes(const uint16_t *codes, int n, __m512i w)
{
    const __m512i *tab = (const __m512i *)codes;
    __m512i r[8];
    for (int i = 0; i < n; i++)
        r[i] = _mm512_permutex2var_epi16(_mm512_loadu_si512(tab + 2 * i), w, _mm512_loadu_si512(tab + 2 * i + 1));
    for (int bit = 6, k = n; k > 1; bit++, k /= 2) {
        const __mmask32 b = _mm512_test_epi16_mask(w, _mm512_set1_epi16((short)(1 << bit)));
        for (int i = 0; i < k / 2; i++)
            r[i] = _mm512_mask_mov_epi16(r[2 * i], b, r[2 * i + 1]);
    }
    return r[0];
}

/* Group g's 64 bytes from the codes c of its entries (8-wide: 8 entries of 2-bit fields, words 8 g of c;
 * 4-wide: 16 entries of 3-bit fields, words 16 (g % 2)): each code in the words of its 8 (4) bytes, shifted
 * so that every byte's field is at its bits 0 .. 2, masked, then the levels by vpshufb. */
DD_INLINE __m512i iqv_expand(__m512i c, int g, int wide4, const uint8_t *levels)
{
    const __m512i i = iqv_iota16();
    const __m512i sel = wide4 ? _mm512_add_epi16(_mm512_srli_epi16(i, 1), _mm512_set1_epi16((short)(16 * (g % 2))))
                              : _mm512_add_epi16(_mm512_srli_epi16(i, 2), _mm512_set1_epi16((short)(8 * g)));
    const __m512i sh = wide4 ? _mm512_mullo_epi16(_mm512_and_si512(i, _mm512_set1_epi16(1)), _mm512_set1_epi16(6))
                             : _mm512_slli_epi16(_mm512_and_si512(i, _mm512_set1_epi16(3)), 2);
    const int bits = wide4 ? 3 : 2, m = (1 << bits) - 1;
    const __m512i y = _mm512_srlv_epi16(_mm512_permutexvar_epi16(sel, c), sh);
    const __m512i z = _mm512_or_si512(_mm512_and_si512(y, _mm512_set1_epi16((short)m)),
                                      _mm512_and_si512(_mm512_slli_epi16(y, 8 - bits), _mm512_set1_epi16((short)(m << 8))));
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)levels)), z);
}

/* A block's d (dd_iq_unpack's). */
DD_INLINE float iqv_d(const uint8_t *blk, int wtype)
{
    if (wtype == DD_IQ1_M) {
        uint16_t s[4];
        memcpy(s, blk + 48, 8);
        const uint16_t dbits = (uint16_t)((s[0] >> 12) | ((s[1] >> 8) & 0x00f0) | ((s[2] >> 4) & 0x0f00) | (s[3] & 0xf000));
        return dd_f16_to_f32(dbits) * 0.125f;
    }
    const float d16 = dd_f16_to_f32(dd_load_u16(blk));
    return wtype == DD_IQ3_S ? d16 : d16 * (wtype == DD_IQ3_XXS ? 0.25f : 0.125f);
}

/* q[256], sc[16], *d of one block: dd_iq_unpack's bytes. */
DD_INLINE void iq_unpack_avx512(const uint8_t *blk, int wtype, uint8_t *q, int16_t *sc, float *d)
{
    iqv_block f;
    iqv_fields(blk, wtype, &f);
    uint64_t masks[4];
    _mm256_storeu_si256((__m256i *)masks, f.sgn);
    _mm256_storeu_si256((__m256i *)sc, f.sc);
    const int wide4 = wtype == DD_IQ3_XXS || wtype == DD_IQ3_S, iq1 = wtype == DD_IQ1_S || wtype == DD_IQ1_M;
    const int two_off = iq1 ? 0 : 2 * (wtype == DD_IQ3_XXS ? DD_IQ3XXS_OFF : wtype == DD_IQ3_S ? DD_IQ3S_OFF : DD_IQ2_OFF);
    const int t = iqv_code_table(wtype), n = wtype == DD_IQ2_XS || wtype == DD_IQ3_S ? 8 : 4;
    __m512i c[2];
    if (t >= 0)
        for (int h = 0; h < 1 + wide4; h++)
            c[h] = iqv_codes(dd_iq_codes + dd_iq_code_at[t], n, f.w16[h]);
    const uint8_t *grid = (const uint8_t *)dd_iq_pos8 + (wtype == DD_IQ2_S ? DD_IQ2S_AT : DD_IQ1S_AT);
    __m512i ix[2];
    if (t < 0) {
        ix[0] = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(f.w16[0]));
        ix[1] = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(f.w16[0], 1));
    }
    for (int g = 0; g < 4; g++) {
        __m512i u;
        if (t >= 0) {
            u = iqv_expand(c[wide4 ? g / 2 : 0], g, wide4, dd_iq_levels[t]);
        } else {
            const __m256i x = g % 2 ? _mm512_extracti64x4_epi64(ix[g / 2], 1) : _mm512_castsi512_si256(ix[g / 2]);
            const __m256i lo = _mm256_i32gather_epi64((const long long *)grid, _mm256_castsi256_si128(x), 8);
            const __m256i hi = _mm256_i32gather_epi64((const long long *)grid, _mm256_extracti128_si256(x, 1), 8);
            u = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
        const __mmask64 m = _cvtu64_mask64(masks[g]);
        _mm512_storeu_si512(q + 64 * g, two_off ? _mm512_mask_sub_epi8(u, m, _mm512_set1_epi8((char)two_off), u)
                                                : _mm512_mask_sub_epi8(u, m, u, _mm512_set1_epi8(2)));
    }
    *d = iqv_d(blk, wtype);
}

/* acc += the f64 terms of unpacked values q, scales sc and d against a column's activation blocks b0 .. b0 + 7:
 * lowbit.h's dd_lb_terms for the IQ types in its operations and order (the integers I_b exact in int32, then
 * (d da_b) I_b in f64 added to lane b), spelled in 512-bit registers. I_b is summed per 16-value half h:
 * one vpdpbusd per 64 values, the transpose-add of kernels_avx512vnni.c puts half 4p + k in lane 4k + p,
 * then sc_h (sum(u a) - off s16_h) for all 16 halves at once (exact: |sum| < 2^19, |sc| < 32) and the halves
 * of each block added. */
DD_INLINE void iqv_terms(const uint8_t *q, const int16_t *sc, float d, const dd_acts *a, size_t b0, dd_v8f da, int wtype,
                         dd_v8d *acc)
{
    const int off = wtype == DD_IQ3_XXS ? DD_IQ3XXS_OFF : wtype == DD_IQ3_S ? DD_IQ3S_OFF
                  : wtype == DD_IQ1_S || wtype == DD_IQ1_M ? DD_IQ1_OFF : DD_IQ2_OFF;
    const int8_t *x = a->q + b0 * DD_QK;
    __m512i s[4];
    for (int p = 0; p < 4; p++)
        s[p] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(q + 64 * p), _mm512_loadu_si512(x + 64 * p));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i sc32 = _mm512_permutexvar_epi32(order, _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)sc)));
    const __m512i s16 = _mm512_permutexvar_epi32(order, _mm512_loadu_si512(a->s16 + 2 * b0));
    __m512i h = _mm512_sub_epi32(kq_transpose_add(s), _mm512_mullo_epi32(s16, _mm512_set1_epi32(off)));
    h = _mm512_mullo_epi32(h, sc32);
    h = _mm512_add_epi32(h, _mm512_alignr_epi32(h, h, 4));   /* lane p: block 2p, lane 8 + p: block 2p + 1 */
    const __m256i dot = _mm512_castsi512_si256(
        _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0), h));
    __m256 daf;
    memcpy(&daf, &da, sizeof daf);
    const __m512d prod = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_mul_ps(daf, _mm256_set1_ps(d))), _mm512_cvtepi32_pd(dot));
    __m512d acc8;
    memcpy(&acc8, acc, sizeof acc8);
    acc8 = _mm512_add_pd(acc8, prod);
    memcpy(acc, &acc8, sizeof acc8);
}

/* ---- The GEMV (one column) on AVX-512 VBMI + BITALG, the unpacked bytes kept in registers ----
 * Lane L of the dword accumulator sums half L (values 16 L .. 16 L + 15) whole: step g (0 .. 3) of the vpdpbusd
 * chain meets its values 16 L + 4 g + j (j < 4) in bytes 4 L + j of the unpacked vector and of the activation
 * vector xs[g], a dword transpose of the column's 256 values made once per super-block for all rows. So no
 * transpose-add: the half sums come out in order, then sc_h (sum - off s16_h) and the halves of a block added
 * give lowbit.h's integers I_b (exact in int32 whatever the order), and the f64 terms are iqv_terms's.
 * Unpacking in that order: vpmultishiftqb moves each value's field of its code to the low bits of its byte,
 * vpermb looks the level up by the byte's low 6 bits (a 64-byte table, levels[e & 3] or [e & 7]); an 8-wide
 * code table's qword Q (entries 4Q .. 4Q + 3) holds halves 2Q and 2Q + 1, the 4-wide grids' codes are looked
 * up in the order the steps use them (each qword: entries 4h + g of halves h = 2Q, 2Q + 1, steps g = 2k, 2k + 1).
 * The signs: bit 16 h + 4 g + j of the block's sign qword h / 4 picked for each byte by vpshufbitqmb; the
 * ksigns_iq2xs bytes by a 128-byte vpermt2b of their 7-bit indices. IQ2_S, IQ1_S and IQ1_M load their grid's rows
 * (1024 or 2048 entries) by scalar loads, each entry's two halves meeting two lanes (iqf_halves_lookup). */
#define IQF_TARGET __attribute__((target("avx512vbmi,avx512bitalg,bmi2,f16c")))

/* iqv_d by the F16C conversion (exact, as dd_f16_to_f32). */
IQF_TARGET DD_INLINE float iqf_d(const uint8_t *blk, int wtype)
{
    if (wtype == DD_IQ1_M) {
        const uint64_t s = iqv_u64(blk + 48);
        return _cvtsh_ss((unsigned short)(_pext_u64(s, 0xf000f000f000f000ULL))) * 0.125f;
    }
    const float d16 = _cvtsh_ss(dd_load_u16(blk));
    return wtype == DD_IQ3_S ? d16 : d16 * (wtype == DD_IQ3_XXS ? 0.25f : 0.125f);
}

/* The column's 256 activations at x as xs[g]: dword L = dword 4 L + g of x (two rounds of vpermt2d). */
IQF_TARGET DD_INLINE void iqf_acts(const int8_t *x, __m512i xs[4])
{
    __m512i v[4], u[4];
    for (int p = 0; p < 4; p++)
        v[p] = _mm512_loadu_si512(x + 64 * p);
    /* u[2 s + k] dword 8 t + 4 gg + i = v[2 s + t] dword 4 i + 2 k + gg */
    for (int s = 0; s < 2; s++)
        for (int k = 0; k < 2; k++)
            u[2 * s + k] = _mm512_permutex2var_epi32(
                v[2 * s], _mm512_setr_epi32(2 * k, 4 + 2 * k, 8 + 2 * k, 12 + 2 * k, 2 * k + 1, 5 + 2 * k, 9 + 2 * k,
                                            13 + 2 * k, 16 + 2 * k, 20 + 2 * k, 24 + 2 * k, 28 + 2 * k, 17 + 2 * k,
                                            21 + 2 * k, 25 + 2 * k, 29 + 2 * k),
                v[2 * s + 1]);
    for (int g = 0; g < 4; g++) {
        const int o = 4 * (g % 2);
        xs[g] = _mm512_permutex2var_epi32(u[g / 2], _mm512_setr_epi32(o, o + 1, o + 2, o + 3, 8 + o, 9 + o, 10 + o,
                                                                      11 + o, 16 + o, 17 + o, 18 + o, 19 + o, 24 + o,
                                                                      25 + o, 26 + o, 27 + o),
                                          u[2 + g / 2]);
    }
}

/* The gathering types' activation vectors: xg[q] dword L = dword 32 (q / 2) + 4 (L / 2) + 2 (q % 2) + L % 2 of x,
 * the values met by grid entry 16 (q / 2) + 2 (L / 2) + q % 2 in qword L / 2 of the q-th gathered vector. */
IQF_TARGET DD_INLINE void iqf_acts_gather(const int8_t *x, __m512i xg[4])
{
    for (int q = 0; q < 4; q++) {
        const int o = 2 * (q % 2);
        xg[q] = _mm512_permutex2var_epi32(
            _mm512_loadu_si512(x + 128 * (q / 2)),
            _mm512_setr_epi32(o, o + 1, o + 4, o + 5, o + 8, o + 9, o + 12, o + 13, o + 16, o + 17, o + 20, o + 21,
                              o + 24, o + 25, o + 28, o + 29),
            _mm512_loadu_si512(x + 128 * (q / 2) + 64));
    }
}

/* Sign qwords s (256 bits: bit v = sign of value v) -> the vpshufbitqmb source: qword Q = qword Q / 2 of s. */
IQF_TARGET DD_INLINE __m512i iqf_sign_src(__m256i s)
{
    return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 0, 1, 1, 2, 2, 3, 3), _mm512_castsi256_si512(s));
}

/* 8 dwords of 4 7-bit sign indices (bits 0, 7, 14, 21) -> iqf_sign_src of their ksigns_iq2xs bytes. */
IQF_TARGET DD_INLINE __m512i iqf_ksigns7(__m256i a)
{
    const __m512i idx = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352e2720150e0700LL), iqf_sign_src(a));
    return _mm512_permutex2var_epi8(_mm512_loadu_si512(dd_iq_ksigns), idx, _mm512_loadu_si512(dd_iq_ksigns + 64));
}

/* acc += (d da_b) I_b from the 16 half sums s (lane h: sum of u a over half h), I_b = sum over the block's halves of
 * sc_h (s_h - off s16_h). */
IQF_TARGET DD_INLINE void iqf_tail(__m512i s, __m512i offs, __m256i sc, __m256 da, float d, __m512d *acc)
{
    __m512i h = _mm512_mullo_epi32(_mm512_sub_epi32(s, offs), _mm512_cvtepi16_epi32(sc));
    h = _mm512_add_epi32(h, _mm512_srli_epi64(h, 32));
    const __m512d prod = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_mul_ps(da, _mm256_set1_ps(d))),
                                       _mm512_cvtepi32_pd(_mm512_cvtepi64_epi32(h)));
    *acc = _mm512_add_pd(*acc, prod);
}

/* The grid-row indices of slots 4 ib .. 4 ib + 3 of an IQ2_S, IQ1_S or IQ1_M block as the words of a u64, built in
 * general registers (BMI2 pdep; the rows are then scalar loads, design/quant-formats.md says why): the index bytes,
 * and above them the high bits: 2 a slot from IQ2_S's qh[ib], 3 from IQ1_S's u16 qh[ib], and for IQ1_M a whole
 * nibble of qh bytes 2 ib, 2 ib + 1 (3 index bits, then the delta's sign, which picks the rows at DD_IQ1S_NEG_AT). */
IQF_TARGET DD_INLINE uint64_t iqf_index4(const uint8_t *blk, int wtype, int ib)
{
    const uint64_t bytes = 0x00ff00ff00ff00ffULL;
    if (wtype == DD_IQ2_S)
        return _pdep_u64(iqv_u32(blk + 2 + 4 * ib), bytes) | _pdep_u64(blk[66 + ib], 0x0300030003000300ULL);
    if (wtype == DD_IQ1_S)
        return _pdep_u64(iqv_u32(blk + 2 + 4 * ib), bytes)
             | _pdep_u64(dd_load_u16(blk + 34 + 2 * ib), 0x0700070007000700ULL);
    return _pdep_u64(iqv_u32(blk + 4 * ib), bytes)
         | _pdep_u64(dd_load_u16(blk + 32 + 2 * ib), 0x0f000f000f000f00ULL);
}

/* The row of slot e, given the u64s x of iqf_index4. */
DD_INLINE long long iqf_row_of(const long long *grid, const uint64_t x[8], int e)
{
    return grid[(uint16_t)(x[e / 4] >> (16 * (e % 4)))];
}

/* The half sums of IQ2_S, IQ1_S and IQ1_M: the q-th vector of grid rows holds the rows of slots 16 (q / 2) + 2 i +
 * q % 2 (i < 8) in qword i, so lanes 2 i and 2 i + 1 of accumulator q / 2 sum half 8 (q / 2) + i in two parts, added
 * by one even and one odd dword pick. IQ2_S's signs: the slots' sign bytes picked by vpshufbitqmb as masks; the IQ1
 * deltas' signs are in the rows (IQ1_M) or in the offsets (IQ1_S, iqf_row). */
IQF_TARGET DD_INLINE __m512i iqf_halves_lookup(const uint8_t *blk, const iqv_block *f, const __m512i xg[4], int wtype)
{
    const long long *grid = (const long long *)dd_iq_pos8 + (wtype == DD_IQ2_S ? DD_IQ2S_AT : DD_IQ1S_AT) / 8;
    uint64_t x[8];
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ib++)
        x[ib] = iqf_index4(blk, wtype, ib);
    __m512i sg[2] = { _mm512_setzero_si512(), _mm512_setzero_si512() };
    if (wtype == DD_IQ2_S)   /* qword i of sg[h]: the sign bytes of slots 16 h + 2 i, 16 h + 2 i + 1 */
        for (int h = 0; h < 2; h++)
            sg[h] = _mm512_cvtepu16_epi64(h ? _mm256_extracti128_si256(f->sgn, 1) : _mm256_castsi256_si128(f->sgn));
    __m512i acc[2] = { _mm512_setzero_si512(), _mm512_setzero_si512() };
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        const int e = 16 * (q / 2) + q % 2;
        const __m512i u = _mm512_set_epi64(iqf_row_of(grid, x, e + 14), iqf_row_of(grid, x, e + 12),
                                           iqf_row_of(grid, x, e + 10), iqf_row_of(grid, x, e + 8),
                                           iqf_row_of(grid, x, e + 6), iqf_row_of(grid, x, e + 4),
                                           iqf_row_of(grid, x, e + 2), iqf_row_of(grid, x, e));
        __m512i v = u;
        if (wtype == DD_IQ2_S) {   /* byte j of qword i: bit 8 (q % 2) + j of qword i of sg[q / 2] */
            const __mmask64 neg = _mm512_bitshuffle_epi64_mask(sg[q / 2], _mm512_add_epi8(
                _mm512_set1_epi64(0x0706050403020100LL), _mm512_set1_epi8((char)(8 * (q % 2)))));
            v = _mm512_mask_sub_epi8(u, neg, _mm512_set1_epi8(2 * DD_IQ2_OFF), u);
        }
        acc[q / 2] = _mm512_dpbusd_epi32(acc[q / 2], v, xg[q]);
    }
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    return _mm512_add_epi32(_mm512_permutex2var_epi32(acc[0], even, acc[1]),
                            _mm512_permutex2var_epi32(acc[0], _mm512_add_epi32(even, _mm512_set1_epi32(1)), acc[1]));
}

/* dd_lb_terms of one row of the type's super-block blk against the column (xs, offs = off s16, offs_neg = (off + 2)
 * s16, da), added to acc. */
IQF_TARGET DD_INLINE void iqf_row(const uint8_t *blk, int wtype, const __m512i xs[4], __m512i offs, __m512i offs_neg,
                                  __m512i lev, __m256 da, __m512d *acc)
{
    if (iqv_code_table(wtype) < 0) {
        iqv_block f;
        iqv_fields(blk, wtype, &f);
        if (wtype == DD_IQ1_S) {   /* a negative delta: u - 2 for its 32 values, so off + 2 times their sums */
            const unsigned neg = _mm_movepi16_mask(_mm_loadu_si128((const __m128i *)(blk + 34)));
            offs = _mm512_mask_blend_epi32((__mmask16)(_pdep_u32(neg, 0x5555) * 3), offs, offs_neg);
        }
        iqf_tail(iqf_halves_lookup(blk, &f, xs, wtype), offs, f.sc, da, iqf_d(blk, wtype), acc);
        return;
    }
    const int wide4 = wtype == DD_IQ3_XXS || wtype == DD_IQ3_S;
    const int t = iqv_code_table(wtype), n = wtype == DD_IQ2_XS || wtype == DD_IQ3_S ? 8 : 4;
    const char two_off = (char)(2 * (wtype == DD_IQ3_XXS ? DD_IQ3XXS_OFF : wtype == DD_IQ3_S ? DD_IQ3S_OFF : DD_IQ2_OFF));
    iqv_block f;
    iqv_fields(blk, wtype, &f);
    __m512i sg;
    if (wtype == DD_IQ2_XXS)
        sg = iqf_ksigns7(_mm512_cvtepi64_epi32(_mm512_srli_epi64(_mm512_loadu_si512(blk + 2), 32)));
    else if (wtype == DD_IQ3_XXS)
        sg = iqf_ksigns7(_mm256_loadu_si256((const __m256i *)(blk + 66)));
    else if (wtype == DD_IQ2_XS)
        sg = _mm512_permutex2var_epi8(_mm512_loadu_si512(dd_iq_ksigns),
                                      iqf_sign_src(_mm512_cvtepi16_epi8(_mm512_srli_epi16(_mm512_loadu_si512(blk + 2), 9))),
                                      _mm512_loadu_si512(dd_iq_ksigns + 64));
    else
        sg = iqf_sign_src(f.sgn);
    const uint16_t *codes = dd_iq_codes + dd_iq_code_at[t];
    __m512i c[2];
    if (wide4)
        for (int k = 0; k < 2; k++) {   /* word 4 Q + m: entry 8 Q + 4 (m % 2) + 2 k + m / 2 */
            const __m512i i = iqv_iota16(), m = _mm512_and_si512(i, _mm512_set1_epi16(3));
            const __m512i e = _mm512_add_epi16(
                _mm512_add_epi16(_mm512_slli_epi16(_mm512_srli_epi16(i, 2), 3), _mm512_slli_epi16(_mm512_and_si512(m, _mm512_set1_epi16(1)), 2)),
                _mm512_add_epi16(_mm512_srli_epi16(m, 1), _mm512_set1_epi16((short)(2 * k))));
            c[k] = iqv_codes(codes, n, _mm512_permutex2var_epi16(f.w16[0], e, f.w16[1]));
        }
    else
        c[0] = iqv_codes(codes, n, f.w16[0]);
    __m512i s = _mm512_setzero_si512();
    for (int g = 0; g < 4; g++) {
        /* byte j' of qword Q: lane 2 Q + j' / 4, value j = j' % 4 */
        const __m512i sh = wide4 ? _mm512_set1_epi64((long long)(0x1916131009060300ULL + 0x2020202020202020ULL * (g % 2)))
                                 : _mm512_set1_epi64((long long)(0x2624222006040200ULL + 0x0808080808080808ULL * g));
        const __m512i u = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(sh, c[wide4 ? g / 2 : 0]), lev);
        /* bit 32 (Q % 2) + 16 (j' / 4) + 4 g + j' % 4 of sign qword Q / 2 */
        const __m512i sb = _mm512_add_epi8(_mm512_setr_epi64(0x1312111003020100LL, 0x3332313023222120LL,
                                                             0x1312111003020100LL, 0x3332313023222120LL,
                                                             0x1312111003020100LL, 0x3332313023222120LL,
                                                             0x1312111003020100LL, 0x3332313023222120LL),
                                           _mm512_set1_epi8((char)(4 * g)));
        const __mmask64 neg = _mm512_bitshuffle_epi64_mask(sg, sb);
        s = _mm512_dpbusd_epi32(s, _mm512_mask_sub_epi8(u, neg, _mm512_set1_epi8(two_off), u), xs[g]);
    }
    iqf_tail(s, offs, f.sc, da, iqf_d(blk, wtype), acc);
}

/* dd_lb_tile's rows [0, R) x the one column. */
IQF_TARGET DD_INLINE void iqf_tile(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, int wtype,
                                   float *y, const int R)
{
    const size_t nsb = a->nb / 8;
    const size_t bytes = wtype == DD_IQ2_XXS ? DD_IQ2_XXS_BYTES : wtype == DD_IQ2_XS ? DD_IQ2_XS_BYTES
                       : wtype == DD_IQ3_XXS ? DD_IQ3_XXS_BYTES
                       : wtype == DD_IQ3_S ? DD_IQ3_S_BYTES : wtype == DD_IQ2_S ? DD_IQ2_S_BYTES
                       : wtype == DD_IQ1_S ? DD_IQ1_S_BYTES : DD_IQ1_M_BYTES;
    const int t = iqv_code_table(wtype);
    const int off = wtype == DD_IQ3_XXS ? DD_IQ3XXS_OFF : wtype == DD_IQ3_S ? DD_IQ3S_OFF
                  : wtype == DD_IQ1_S || wtype == DD_IQ1_M ? DD_IQ1_OFF : DD_IQ2_OFF;
    const __m512i lev = t < 0 ? _mm512_setzero_si512() : _mm512_permutexvar_epi8(
        _mm512_and_si512(_mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44,
                                         43, 42, 41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24,
                                         23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                         1, 0),
                         _mm512_set1_epi8(t == 2 || t == 3 ? 7 : 3)),
        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)dd_iq_levels[t])));
    __m512d acc[4];
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_setzero_pd();
    for (size_t sb = 0; sb < nsb; sb++) {
        const size_t b0 = 8 * sb;
        __m512i xs[4];
        if (t < 0)
            iqf_acts_gather(a->q + b0 * DD_QK, xs);
        else
            iqf_acts(a->q + b0 * DD_QK, xs);
        const __m512i s16 = _mm512_loadu_si512(a->s16 + 2 * b0);
        const __m512i offs = _mm512_mullo_epi32(s16, _mm512_set1_epi32(off));
        const __m512i offs_neg = _mm512_mullo_epi32(s16, _mm512_set1_epi32(off + 2));
        const __m256 da = _mm256_loadu_ps(a->bd + b0);
        for (int r = 0; r < R; r++) {
            const uint8_t *p = pf + r * rb + sb * bytes;
            for (size_t at = 0; at < bytes; at += 64)
                dd_prefetch_weight(p + at);
            dd_prefetch_weight(p + bytes - 1);
            iqf_row(w + r * rb + sb * bytes, wtype, xs, offs, offs_neg, lev, da, &acc[r]);
        }
    }
    dd_v8d lanes[4][4];
    for (int r = 0; r < R; r++)
        memcpy(&lanes[r][0], &acc[r], sizeof acc[r]);
    dd_store_lanes(lanes, 0, y, 1, R, 1);
}

IQF_TARGET __attribute__((noinline)) static void iqf_gemv_tile(const uint8_t *w, const uint8_t *pf, size_t rb,
                                                               const dd_acts *a, int wtype, float *y, int R)
{
#define IQF_TYPE(T)                                   \
    case T:                                           \
        if (R == 4)                                   \
            iqf_tile(w, pf, rb, a, T, y, 4);          \
        else                                          \
            iqf_tile(w, pf, rb, a, T, y, 1);          \
        break;
    switch (wtype) {
        IQF_TYPE(DD_IQ2_XXS)
        IQF_TYPE(DD_IQ2_XS)
        IQF_TYPE(DD_IQ3_XXS)
        IQF_TYPE(DD_IQ3_S)
        IQF_TYPE(DD_IQ2_S)
        IQF_TYPE(DD_IQ1_S)
        IQF_TYPE(DD_IQ1_M)
    default: break;
    }
#undef IQF_TYPE
}

/* lowbit.h's GEMV tile hook: 1 where the VBMI path took the tile (R = 4 or 1 rows, one column, ldy unused; every
 * IQ type). */
DD_INLINE int iqf_gemv(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, int wtype, float *y, int R)
{
    if (wtype < DD_IQ2_XXS || wtype > DD_IQ1_M || (R != 4 && R != 1) || !dd_iq_vbmi())
        return 0;
    iqf_gemv_tile(w, pf, rb, a, wtype, y, R);
    return 1;
}

#define DD_LB_GEMV iqf_gemv
#define DD_IQ_UNPACK iq_unpack_avx512
#define DD_LB_TERMS(u, r, a, b0, da, wtype, acc) iqv_terms((u)->q[r], (u)->sc[r], (u)->d[r], a, b0, da, wtype, acc)

#endif
