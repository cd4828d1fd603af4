/* The IQ super-blocks unpacked in AVX-512 registers (F, BW): the same bytes q[256], scales sc[16] and d as
 * iquants.h's dd_iq_unpack (which gives the layouts), so every level keeps the same bits.
 *
 * The block is loaded into two vectors (masked: no byte past it is read). Every bit field the layouts define
 * (grid index bits, sign index or sign bits, scale) is "the dword at byte A, shifted right by R, masked",
 * with A and R per slot of 8 values (or piece of 4 values, for the 4-wide IQ3 grids) given by the layout:
 * iq_field extracts 16 of them at once with two dword permutes and a funnel shift. The grid rows are then
 * fetched with gathers (8 qwords or 16 dwords a gather, 64 values), the signs applied with mask registers
 * (sign byte j of a slot is bit j of the mask), and the scales narrowed to int16. Costs and what was
 * measured against the scalar unpacker: docs/design/quant-formats.md, "IQ decode on AVX-512".
 */
#ifndef DELTADESK_IQUANTS_AVX512_H
#define DELTADESK_IQUANTS_AVX512_H

#include "iquants.h"

/* How a slot's sign byte comes from its field: as is (IQ2_S, IQ3_S), a ksigns_iq2xs pattern from a 7-bit
 * index (IQ2_XXS, IQ2_XS, IQ3_XXS), all ones where a 1-bit field is set (IQ1: the sign of delta). */
enum { IQV_SIGN_RAW, IQV_SIGN_KSIGN, IQV_SIGN_BIT };

/* A block's fields as vectors: idx[v] the grid entries of slots (pieces) 16v .. 16v + 15, sgn[v] the sign
 * bytes of slots 16v .. 16v + 15 (in dwords), scale the 4-bit (3-bit) ls of the 16 halves. */
typedef struct {
    __m512i idx[4], sgn[2], scale;
} iqv_fields;

DD_INLINE __m512i iqv_iota(int v)
{
    return _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(16 * v));
}

/* (the little-endian dword at byte at[i] of the block [lo | hi]) >> shift[i] & mask, per lane (at < 124). */
DD_INLINE __m512i iq_field(__m512i lo, __m512i hi, __m512i at, __m512i shift, int mask)
{
    const __m512i w = _mm512_srli_epi32(at, 2), sh = _mm512_slli_epi32(_mm512_and_si512(at, _mm512_set1_epi32(3)), 3);
    const __m512i d0 = _mm512_permutex2var_epi32(lo, w, hi);
    const __m512i d1 = _mm512_permutex2var_epi32(lo, _mm512_add_epi32(w, _mm512_set1_epi32(1)), hi);
    const __m512i v = _mm512_or_si512(_mm512_srlv_epi32(d0, sh), _mm512_sllv_epi32(d1, _mm512_sub_epi32(_mm512_set1_epi32(32), sh)));
    return _mm512_and_si512(_mm512_srlv_epi32(v, shift), _mm512_set1_epi32(mask));
}

/* lo | hi << 8: a grid index from its low byte and high bits. */
DD_INLINE __m512i iqv_join(__m512i lo, __m512i hi)
{
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 8));
}

#define IQV_C(x) _mm512_set1_epi32(x)
#define IQV_ADD(a, b) _mm512_add_epi32(a, b)
#define IQV_MUL(a, k) _mm512_mullo_epi32(a, IQV_C(k))
#define IQV_SHR(a, k) _mm512_srli_epi32(a, k)
#define IQV_AND(a, k) _mm512_and_si512(a, IQV_C(k))

/* Bytes base + 16 v .. base + 16 v + 15 of the block, one to a dword (a field of whole bytes, in order). */
DD_INLINE __m512i iqv_bytes(const uint8_t *blk, int base, int v)
{
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + base + 16 * v)));
}

/* The fields of one block of wtype (layouts: iquants.h; s the slot, p the piece, h the half). The sign bytes
 * of IQ2_S and IQ3_S are stored as they are used, and not extracted. */
DD_INLINE void iqv_fields_of(const uint8_t *blk, __m512i lo, __m512i hi, int wtype, iqv_fields *f)
{
    const __m512i zero = _mm512_setzero_si512(), h = iqv_iota(0);
    const int pieces = wtype == DD_IQ3_XXS || wtype == DD_IQ3_S ? 4 : 2;
    for (int v = 0; v < pieces; v++) {
        const __m512i s = iqv_iota(v), q = IQV_SHR(s, 2), l = IQV_AND(s, 3);
        switch (wtype) {
        case DD_IQ2_XXS:   /* slot s: byte 2 + 8 (s / 4) + s % 4 */
            f->idx[v] = iq_field(lo, hi, IQV_ADD(IQV_C(2), IQV_ADD(IQV_MUL(q, 8), l)), zero, 255);
            break;
        case DD_IQ2_XS:    /* slot s: the u16 at 2 + 2 s, bits 0-8 */
            f->idx[v] = iq_field(lo, hi, IQV_ADD(IQV_C(2), IQV_MUL(s, 2)), zero, 511);
            break;
        case DD_IQ2_S:     /* byte 2 + s, 2 bits of qh[s / 4] */
            f->idx[v] = iqv_join(iqv_bytes(blk, 2, v), iq_field(lo, hi, IQV_ADD(IQV_C(66), q), IQV_MUL(l, 2), 3));
            break;
        case DD_IQ3_XXS:   /* piece p: byte 2 + p */
            f->idx[v] = iqv_bytes(blk, 2, v);
            break;
        case DD_IQ3_S:     /* piece p: byte 2 + p, bit p % 8 of qh[p / 8] */
            f->idx[v] = iqv_join(iqv_bytes(blk, 2, v),
                                 iq_field(lo, hi, IQV_ADD(IQV_C(66), IQV_SHR(s, 3)), IQV_AND(s, 7), 1));
            break;
        case DD_IQ1_S:     /* byte 2 + s, 3 bits of the u16 qh[s / 4] */
            f->idx[v] = iqv_join(iqv_bytes(blk, 2, v), iq_field(lo, hi, IQV_ADD(IQV_C(34), IQV_MUL(q, 2)), IQV_MUL(l, 3), 7));
            break;
        default:           /* DD_IQ1_M: byte s, 3 bits of the nibble of qh[s / 2] */
            f->idx[v] = iqv_join(iqv_bytes(blk, 0, v),
                                 iq_field(lo, hi, IQV_ADD(IQV_C(32), IQV_SHR(s, 1)), IQV_MUL(IQV_AND(s, 1), 4), 7));
            break;
        }
    }
    for (int v = 0; v < 2; v++) {
        const __m512i s = iqv_iota(v), q = IQV_SHR(s, 2), l = IQV_AND(s, 3);
        switch (wtype) {
        case DD_IQ2_XXS:   /* 7 bits 7 (s % 4) of the u32 at 2 + 8 (s / 4) + 4 */
            f->sgn[v] = iq_field(lo, hi, IQV_ADD(IQV_C(6), IQV_MUL(q, 8)), IQV_MUL(l, 7), 127);
            break;
        case DD_IQ2_XS:
            f->sgn[v] = iq_field(lo, hi, IQV_ADD(IQV_C(2), IQV_MUL(s, 2)), IQV_C(9), 127);
            break;
        case DD_IQ3_XXS:   /* 7 bits 7 (s % 4) of the u32 at 66 + 4 (s / 4) */
            f->sgn[v] = iq_field(lo, hi, IQV_ADD(IQV_C(66), IQV_MUL(q, 4)), IQV_MUL(l, 7), 127);
            break;
        case DD_IQ2_S:
        case DD_IQ3_S:
            f->sgn[v] = zero;
            break;
        case DD_IQ1_S:     /* bit 15 of qh[s / 4] */
            f->sgn[v] = iq_field(lo, hi, IQV_ADD(IQV_C(34), IQV_MUL(q, 2)), IQV_C(15), 1);
            break;
        default:           /* DD_IQ1_M: bit 3 of the nibble */
            f->sgn[v] = iq_field(lo, hi, IQV_ADD(IQV_C(32), IQV_SHR(s, 1)), IQV_ADD(IQV_MUL(IQV_AND(s, 1), 4), IQV_C(3)), 1);
            break;
        }
    }
    const __m512i b = IQV_SHR(h, 1), odd = IQV_AND(h, 1);
    switch (wtype) {
    case DD_IQ2_XXS: f->scale = iq_field(lo, hi, IQV_ADD(IQV_C(6), IQV_MUL(b, 8)), IQV_C(28), 15); break;
    case DD_IQ2_XS: f->scale = iq_field(lo, hi, IQV_ADD(IQV_C(66), b), IQV_MUL(odd, 4), 15); break;
    case DD_IQ2_S: f->scale = iq_field(lo, hi, IQV_ADD(IQV_C(74), b), IQV_MUL(odd, 4), 15); break;
    case DD_IQ3_XXS: f->scale = iq_field(lo, hi, IQV_ADD(IQV_C(66), IQV_MUL(b, 4)), IQV_C(28), 15); break;
    case DD_IQ3_S:
        f->scale = iq_field(lo, hi, IQV_ADD(IQV_C(106), IQV_SHR(h, 2)), IQV_MUL(IQV_AND(b, 1), 4), 15);
        break;
    case DD_IQ1_S: f->scale = iq_field(lo, hi, IQV_ADD(IQV_C(34), IQV_MUL(b, 2)), IQV_C(12), 7); break;
    default: f->scale = iq_field(lo, hi, IQV_ADD(IQV_C(48), IQV_MUL(IQV_SHR(h, 2), 2)), IQV_MUL(IQV_AND(h, 3), 3), 7); break;
    }
}

/* The sign byte of a slot from its field (iq_field's dwords), for the kinds that are not stored as is. */
DD_INLINE __m512i iqv_sign(__m512i x, int kind)
{
    if (kind == IQV_SIGN_BIT)
        return IQV_MUL(x, 255);
    __m512i p = _mm512_xor_si512(x, IQV_SHR(x, 4));   /* ksigns_iq2xs: the 7 bits and their parity as bit 7 */
    p = _mm512_xor_si512(p, IQV_SHR(p, 2));
    p = _mm512_xor_si512(p, IQV_SHR(p, 1));
    return _mm512_or_si512(x, _mm512_slli_epi32(IQV_AND(p, 1), 7));
}

/* q[256], sc[16], *d of one block: dd_iq_unpack's bytes. */
DD_INLINE void iq_unpack_avx512(const uint8_t *blk, int wtype, uint8_t *q, int16_t *sc, float *d)
{
    const size_t bytes = wtype == DD_IQ2_XXS ? DD_IQ2_XXS_BYTES : wtype == DD_IQ2_XS ? DD_IQ2_XS_BYTES
                       : wtype == DD_IQ2_S ? DD_IQ2_S_BYTES : wtype == DD_IQ3_XXS ? DD_IQ3_XXS_BYTES
                       : wtype == DD_IQ3_S ? DD_IQ3_S_BYTES : wtype == DD_IQ1_S ? DD_IQ1_S_BYTES : DD_IQ1_M_BYTES;
    const __m512i lo = _mm512_maskz_loadu_epi8(bytes >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << bytes) - 1, blk);
    const __m512i hi = bytes > 64 ? _mm512_maskz_loadu_epi8(((__mmask64)1 << (bytes - 64)) - 1, blk + 64)
                                  : _mm512_setzero_si512();
    iqv_fields f;
    iqv_fields_of(blk, lo, hi, wtype, &f);
    const int ksign = wtype == DD_IQ2_XXS || wtype == DD_IQ2_XS || wtype == DD_IQ3_XXS;
    const int kind = ksign ? IQV_SIGN_KSIGN : wtype == DD_IQ1_S || wtype == DD_IQ1_M ? IQV_SIGN_BIT : IQV_SIGN_RAW;
    uint64_t masks[4];
    if (kind == IQV_SIGN_RAW) {
        memcpy(masks, blk + (wtype == DD_IQ2_S ? 34 : 74), sizeof masks);
    } else {
        const __m128i s0 = _mm512_cvtepi32_epi8(iqv_sign(f.sgn[0], kind)), s1 = _mm512_cvtepi32_epi8(iqv_sign(f.sgn[1], kind));
        masks[0] = (uint64_t)_mm_cvtsi128_si64(s0);
        masks[1] = (uint64_t)_mm_extract_epi64(s0, 1);
        masks[2] = (uint64_t)_mm_cvtsi128_si64(s1);
        masks[3] = (uint64_t)_mm_extract_epi64(s1, 1);
    }
    const int iq1 = wtype == DD_IQ1_S || wtype == DD_IQ1_M;
    const int two_off = iq1 ? 0 : 2 * (wtype == DD_IQ3_XXS ? DD_IQ3XXS_OFF : wtype == DD_IQ3_S ? DD_IQ3S_OFF : DD_IQ2_OFF);
    const size_t at = wtype == DD_IQ2_XXS ? DD_IQ2XXS_AT : wtype == DD_IQ2_XS ? DD_IQ2XS_AT : wtype == DD_IQ2_S ? DD_IQ2S_AT
                    : wtype == DD_IQ3_XXS ? DD_IQ3XXS_AT : wtype == DD_IQ3_S ? DD_IQ3S_AT : DD_IQ1S_AT;
    const uint8_t *grid = (const uint8_t *)dd_iq_pos8 + at;
    for (int g = 0; g < 4; g++) {
        __m512i u;
        if (wtype == DD_IQ3_XXS || wtype == DD_IQ3_S)
            u = _mm512_i32gather_epi32(f.idx[g], (const void *)grid, 4);
        else
            u = _mm512_i32gather_epi64(g % 2 ? _mm512_extracti64x4_epi64(f.idx[g / 2], 1) : _mm512_castsi512_si256(f.idx[g / 2]),
                                       (const void *)grid, 8);
        const __mmask64 m = _cvtu64_mask64(masks[g]);
        u = two_off ? _mm512_mask_sub_epi8(u, m, _mm512_set1_epi8((char)two_off), u)
                    : _mm512_mask_sub_epi8(u, m, u, _mm512_set1_epi8(2));
        _mm512_storeu_si512(q + 64 * g, u);
    }
    const __m512i odd = _mm512_add_epi32(_mm512_slli_epi32(f.scale, 1), _mm512_set1_epi32(1));
    _mm256_storeu_si256((__m256i *)sc, _mm512_cvtepi32_epi16(odd));
    if (wtype == DD_IQ1_M) {
        uint16_t s[4];
        memcpy(s, blk + 48, 8);
        const uint16_t dbits = (uint16_t)((s[0] >> 12) | ((s[1] >> 8) & 0x00f0) | ((s[2] >> 4) & 0x0f00) | (s[3] & 0xf000));
        *d = dd_f16_to_f32(dbits) * 0.125f;
    } else {
        const float scale = wtype == DD_IQ3_XXS ? 0.25f : wtype == DD_IQ3_S ? 1.0f : 0.125f;
        *d = dd_f16_to_f32(dd_load_u16(blk)) * scale;
    }
}

/* acc += the f64 terms of unpacked values q, scales sc and d against a column's activation blocks b0 .. b0 + 7:
 * lowbit.h's dd_lb_terms for the IQ types in its operations and order (the integers I_b exact in int32, then
 * (d da_b) I_b in f64 added to lane b), spelled in 512-bit registers (the vector-extension form is split into
 * 256-bit halves with the accumulators in memory). */
DD_INLINE void iqv_terms(const uint8_t *q, const int16_t *sc, float d, const dd_acts *a, size_t b0, dd_v8f da, int wtype,
                         dd_v8d *acc)
{
    const int off = wtype == DD_IQ3_XXS ? DD_IQ3XXS_OFF : wtype == DD_IQ3_S ? DD_IQ3S_OFF
                  : wtype == DD_IQ1_S || wtype == DD_IQ1_M ? DD_IQ1_OFF : DD_IQ2_OFF;
    const __m256i sc16 = _mm256_loadu_si256((const __m256i *)sc);
    int32_t d8[8];
    lb_dot8(q, a->q + b0 * DD_QK, sc, d8);
    const __m256i s16 = _mm512_cvtepi32_epi16(_mm512_loadu_si512(a->s16 + 2 * b0));
    const __m256i dot = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)d8),
                                         _mm256_mullo_epi32(_mm256_madd_epi16(s16, sc16), _mm256_set1_epi32(off)));
    __m256 daf;
    memcpy(&daf, &da, sizeof daf);
    const __m512d prod = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_mul_ps(daf, _mm256_set1_ps(d))), _mm512_cvtepi32_pd(dot));
    __m512d s;
    memcpy(&s, acc, sizeof s);
    s = _mm512_add_pd(s, prod);
    memcpy(acc, &s, sizeof s);
}

#define DD_IQ_UNPACK iq_unpack_avx512
#define DD_LB_TERMS(u, r, a, b0, da, wtype, acc) iqv_terms((u)->q[r], (u)->sc[r], (u)->d[r], a, b0, da, wtype, acc)

#endif
