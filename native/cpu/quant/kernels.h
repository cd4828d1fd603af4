/* Internal interface between the dispatcher and the per-ISA kernel files.
 *
 * Each kernels_<isa>.c is compiled with its own -m flags and defines one `dd_kernels` table.
 * Activations reach the kernels in a prepared form (`dd_acts`) built once per matrix product
 * from their Q8_0 blocks, so the inner loops only load what they need.
 */
#ifndef DELTADESK_KERNELS_H
#define DELTADESK_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "deltadesk_cpu.h"

#define DD_QK 32
#define DD_Q4_0_BYTES 18
#define DD_Q8_0_BYTES 34
#define DD_QK_K 256          /* values of a K-quant super-block */
#define DD_Q4_K_BYTES 144
#define DD_Q5_K_BYTES 176
#define DD_Q6_K_BYTES 210
#define DD_Q4_1_BYTES 20
#define DD_Q5_0_BYTES 22
#define DD_Q5_1_BYTES 24
#define DD_IQ4_NL_BYTES 18
#define DD_IQ4_XS_BYTES 136     /* a 256-value super-block */
#define DD_Q2_K_BYTES 84
#define DD_Q3_K_BYTES 110
#define DD_IQ2_XXS_BYTES 66
#define DD_IQ2_XS_BYTES 74
#define DD_IQ2_S_BYTES 82
#define DD_IQ3_XXS_BYTES 98
#define DD_IQ3_S_BYTES 110
#define DD_IQ1_S_BYTES 50
#define DD_IQ1_M_BYTES 56
#define DD_MXFP4_BYTES 17       /* e8m0 scale, 16 nibble bytes */
#define DD_BF16_BYTES 64        /* 32 values of 2 bytes: a "block" only for the k % 32 rule */
#define DD_F16_BYTES 64         /* the same for IEEE halves */

/* Q8_0 activations of m columns, each of nb blocks, 64-byte aligned, in two layouts.
 *
 * Pairs (every kernel but AVX-512's Q4_0 and Q8_0): blocks padded to nbp = nb rounded up to even (the
 * padding block is all zero):
 *   q[c*nbp*32 + b*32 + j]   int8 value j of block b (natural order);
 *   bias[t][c*nbp*8 + b*8 + l]  bias_mult[t] * (q[4l] + q[4l+1] + q[4l+2] + q[4l+3]) of block b:
 *                     the correction a kernel for weight type t adds when it multiplies unsigned
 *                     weight bytes (nibble, or int8 + 128) by the signed activations; NULL when
 *                     that kernel's bias_mult is 0.
 * Groups (when the table's q4_0_groups is set): ng = nb / 16 rounded up groups of 16 blocks, the
 * padding blocks zero. Block i = 4j + k of group g (quad j, 128-bit lane k) belongs to int32 lane
 * L(i) = 4k + j of the group's block vectors:
 *   m == 1 (the quad layout, the GEMV's):
 *   gq[((c*ng + g)*8 + 2j + h)*64 + 16k + t]  value 16h + t of block 16g + 4j + k (h = 0: the
 *                     values of the Q4_0 low nibbles, h = 1: of the high ones);
 *   m > 1 (the lane layout, the GEMM's):
 *   gq[((c*ng + g)*8 + 2t + h)*64 + 4L(i) + u]  value 16h + 4t + u of block 16g + i (t, u < 4);
 *   gbias[(c*ng + g)*16 + L(i)]  -8 * (sum of block 16g + i's 32 values) (Q8_0 weights: 16 times it);
 *   gd[(c*ng + g)*16 + L(i)]     its scale.
 * Compact (every level; the K-quant kernels and the pair layout's Q4_0 and Q8_0 read them), per block b of column c:
 *   bd[c*nbp + b]     the block's scale (f16 widened to f32);
 *   bs[c*nbp + b]     the sum of its 32 values;
 *   s16[(c*nbp + b)*2 + h]  the sum of values 16h .. 16h + 15.
 * Float (the BF16 and F16 kernels): x[c*k + i], the f32 activations themselves (the caller's, not copied;
 * valid while the product runs). */
typedef struct {
    size_t nb, nbp, m;
    const int8_t *q;
    const int32_t *bias[DD_WTYPE_COUNT];
    size_t ng;
    const int8_t *gq;
    const int32_t *gbias;
    const float *gd;
    const float *bd;
    const int32_t *bs, *s16;
    const float *x;
    void *mem;              /* the allocation holding all of the above */
    uint64_t id;            /* unique to this preparation (a process-wide count from 1): a kernel may keep
                             * per-thread values derived from these activations under it */
} dd_acts;

/* The Q4_0 and Q8_0 products' sum, at every level and in the numpy twin (engine.kernels.cpu_twins.q4q8_product_np):
 * block b's exact int dot I_b (|I_b| < 2^24, so exact in f32) times s_b = d_w d_a (two f16 scales: exact in f32)
 * rounded to f32 once, added in f32 to lane b % 16 in order of b from +0 (no fused multiply-add, so every level
 * and numpy round alike); then the lanes by dd_tree16_f32. A missing block of a short last group is an added +0,
 * which leaves a lane unchanged (a lane is never -0). Error: within (nb / 16 + 6) 2^-24 sum |t_b| of the exact sum
 * (one rounding per product, nb / 16 adds a lane, 4 in the tree; docs/design/native-cpu.md). */
#define DD_Q4Q8_LANES 16

/* The 16 lanes s[i] of a Q4_0 / Q8_0 sum added as (i, i + 8), then (i, i + 4), (i, i + 2), (0, 1), in f32. */
static inline float dd_tree16_f32(const float s[DD_Q4Q8_LANES])
{
    float h[8];
    for (int i = 0; i < 8; i++)
        h[i] = s[i] + s[i + 8];
    for (int i = 0; i < 4; i++)
        h[i] = h[i] + h[i + 4];
    return (h[0] + h[2]) + (h[1] + h[3]);
}

/* y[c*ldy + r] = row r of w (nrows rows, row_bytes apart) . column c of a, for r < nrows, c < a->m.
 * Rows [nrows, rows_avail) follow in memory (the rest of the matrix): the kernel may prefetch them. */
typedef void (*dd_gemm_fn)(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail,
                           const dd_acts *a, float *y, size_t ldy);

/* The level's GEMV of interleaved stripes (Q4_0 and MXFP4: q4_il_avx512.h; Q4_K: q4k_il_avx512.h). */
typedef void (*dd_gemv_il_fn)(const uint8_t *w, size_t row_bytes, size_t stripes, size_t stripes_avail,
                              const dd_acts *a, float *y);

/* A level's de-interleave of `stripes` stripes at src (one of the interleaved layouts) into their row-major rows at
 * dst (8 * stripes rows of row_bytes; src and dst do not overlap); also the unpacking of `stripes` groups of
 * another row-grouped layout (dd_gemm_unpacked). */
typedef void (*dd_deil_fn)(uint8_t *dst, const uint8_t *src, size_t stripes, size_t row_bytes);

/* Bytes of row-major rows dd_gemm_unpacked unpacks at a time, on the stack: a group of every layout (8 rows of up to
 * DD_Q4_0_IL_MAX_ROW_BYTES, 4 of up to DD_Q2_K_RL_MAX_ROW_BYTES or DD_Q3_K_RL_MAX_ROW_BYTES) fits. */
#define DD_UNPACK_PIECE (8 * DD_Q4_0_IL_MAX_ROW_BYTES)

/* The product of a row-grouped layout read as its row-major type (q4_interleave.c): w starts on a group of g rows;
 * its nrows / g groups are unpacked by `unpack` a few at a time (whole groups up to DD_UNPACK_PIECE bytes) into a
 * stack buffer for `row_major` (the level's gemm of the row-major type); the last nrows % g rows (the matrix's
 * row-major tail: chunks are whole groups) go to row_major as they are. The bits of row_major on the row-major
 * matrix: a row's result depends only on its bytes and the activations, never on the piece it falls in. */
void dd_gemm_unpacked(dd_gemm_fn row_major, dd_deil_fn unpack, size_t g, const uint8_t *w, size_t row_bytes,
                      size_t nrows, size_t rows_avail, const dd_acts *a, float *y, size_t ldy);

/* A row-grouped layout's copy of `groups` groups of rows from src into dst (row-major to the layout when to_layout
 * is 1, else the reverse; a group is g rows of row_bytes); src and dst do not overlap. */
typedef void (*dd_group_copy_fn)(uint8_t *dst, const uint8_t *src, size_t groups, size_t row_bytes, int to_layout);

/* Rewrites every whole group of g rows of w (nrows rows of row_bytes) in place through a scratch of one group
 * by `copy` (q4_interleave.c); the last nrows % g rows are left as they are. The caller checks row_bytes.
 * DD_OK, or DD_ERR_NOMEM where the scratch cannot be allocated (w then unchanged). */
int dd_permute_groups(uint8_t *w, size_t nrows, size_t row_bytes, size_t g, dd_group_copy_fn copy, int to_layout);

/* gemm[DD_Q4_0_IL] and gemm[DD_MXFP4_IL] of the levels without their own (the AVX-512 VNNI ones are in
 * q4_gemm_avx512.h and q4_il_avx512.h; Q4_0's calls this one at m == 1), wtype the row-major type (DD_Q4_0,
 * DD_MXFP4): w starts on a stripe; its nrows / 8 stripes go to `il` when a->m == 1 and il is not NULL, else to
 * dd_gemm_unpacked (de-interleaved by `deil`, or the portable copy where it is NULL, for `row_major`, the level's
 * gemm[wtype]); the last nrows % 8 rows (the matrix's row-major tail: chunks are whole stripes) go to row_major as
 * they are. The bits of row_major on the row-major matrix. */
void dd_gemm_il(int wtype, dd_gemm_fn row_major, dd_gemv_il_fn il, dd_deil_fn deil, const uint8_t *w,
                size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a, float *y, size_t ldy);

/* Defines NAME, a dd_gemm_fn: dd_gemm_il of WTYPE with the level's ROW_MAJOR, IL and DEIL (NULL where it has none). */
#define DD_DEFINE_GEMM_IL(NAME, WTYPE, ROW_MAJOR, IL, DEIL)                                                \
    static void NAME(const uint8_t *w, size_t row_bytes, size_t nrows, size_t rows_avail, const dd_acts *a, \
                     float *y, size_t ldy)                                                                 \
    {                                                                                                      \
        dd_gemm_il(WTYPE, ROW_MAJOR, IL, DEIL, w, row_bytes, nrows, rows_avail, a, y, ldy);                \
    }

/* How far ahead the SIMD kernels prefetch weights, in rows. A single core keeps too few cache
 * misses in flight while it computes to stream from DRAM; asking for the row this many rows
 * ahead about doubles the single-thread GEMV rate (docs/design/native-cpu.md, "Weight prefetching"). */
#define DD_PREFETCH_ROWS 8

/* The least a GEMV keeps prefetched ahead, in bytes: 8 rows of a k = 2048 Q4_0 matrix. Short rows
 * (k = 512) at DD_PREFETCH_ROWS asked too late (docs/perf/log/cpu-q4dec-2026-12-05.md). */
#define DD_PREFETCH_BYTES 9216

typedef struct {
    /* nb blocks of 32 f32 -> nb block_q8_0, bit-identical to ggml's quantize_row_q8_0_ref. */
    void (*quantize_q8_0)(const float *x, size_t nb, uint8_t *out);
    dd_gemm_fn gemm[DD_WTYPE_COUNT];
    int bias_mult[DD_WTYPE_COUNT];   /* 0: the kernel does not read acts.bias */
    int q4_0_groups;                 /* 1: the Q4_0 and Q8_0 kernels read the group layout of dd_acts */
    /* out[t * ldo + e] = the f32 rounding of the f64 sum of w_e[i] x_t[i] (every product exact), w_e = w + e * n
     * for e < nw (the streamed f32 rows: the router), x_t = x + t * n for t < nx (the reused tokens); each
     * dot by the same instruction sequence wherever it falls, so a token's logits do not depend on nw, nx
     * or the other tokens: a prefill chunk gets the bits of the one-token call. */
    void (*dots_f32)(const float *w, size_t nw, const float *x, size_t nx, size_t n, float *out, size_t ldo);
    /* dd_moe_swiglu (deltadesk_cpu.h) at the level's vector width (swiglu.h): the same bits on every level. */
    void (*swiglu)(const float *g, const float *u, size_t n, float *h);
} dd_kernels;

/* A dots_f32 of one dot at a time: NAME runs DOT (float DOT(const float *w_row, const float *x_row, size_t n))
 * for each (token, row), the table entry of the levels without a tiled one. */
#define DD_DEFINE_DOTS_F32(NAME, DOT)                                                                    \
    static void NAME(const float *w, size_t nw, const float *x, size_t nx, size_t n, float *out, size_t ldo) \
    {                                                                                                    \
        for (size_t t = 0; t < nx; t++)                                                                  \
            for (size_t e = 0; e < nw; e++)                                                              \
                out[t * ldo + e] = DOT(w + e * n, x + t * n, n);                                         \
    }

/* 1 if the AVX-512 level's IQ GEMV takes its VBMI path (dd_set_iq_vbmi; by default where the CPU has AVX-512
 * VBMI and BITALG), else 0. */
int dd_iq_vbmi(void);

extern const dd_kernels dd_kernels_scalar;
#ifdef DD_X86_ISAS
extern const dd_kernels dd_kernels_ssse3;
extern const dd_kernels dd_kernels_avx2;
extern const dd_kernels dd_kernels_avx512vnni;
#endif

/* IEEE half <-> single, round to nearest even (portable; used where F16C is not assumed). */
static inline float dd_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    float f;
    if (exp == 0) {
        f = (float)mant * 0x1p-24f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t dd_f32_to_f16(float f)
{
    uint32_t x, sign;
    memcpy(&x, &f, 4);
    sign = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    if (x > 0x7f800000u)                 /* NaN: keep it quiet */
        return (uint16_t)(sign | 0x7e00u);
    if (x >= 0x477ff000u)                /* >= 65520 rounds to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (x < 0x38800000u) {               /* below 2^-14: a half subnormal (or zero) */
        /* Adding 0.5 makes the FPU round |f| to a multiple of 2^-24 (nearest even);
         * the low mantissa bits of the sum are then the half's 10-bit mantissa. */
        float t, a;
        uint32_t tb;
        memcpy(&a, &x, 4);
        t = a + 0.5f;
        memcpy(&tb, &t, 4);
        return (uint16_t)(sign | (tb - 0x3f000000u));
    }
    /* Normal: rebias the exponent and round the 13 dropped mantissa bits to nearest even. */
    x += 0xfffu + ((x >> 13) & 1u);
    return (uint16_t)(sign | ((x - 0x38000000u) >> 13));
}

static inline uint16_t dd_load_u16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* 8 lanes, one per block of a super-block (GCC/clang vector extensions: each level's compiler flags
 * pick the instructions; every operation stays lane-wise IEEE, so the results do not depend on it). */
typedef int32_t dd_v8i __attribute__((vector_size(32)));
typedef float dd_v8f __attribute__((vector_size(32)));
typedef double dd_v8d __attribute__((vector_size(64)));

/* The 6-bit scales and mins of a Q4_K/Q5_K super-block (its scales[12] at blk + 4), 4 to a word:
 * byte i of w[0..1] = scale of sub-block i, of w[2..3] = its min. As ggml-quants.c
 * get_scale_min_k4: sub-block j < 4 has scale s[j] & 63, min s[j + 4] & 63; j >= 4 has scale
 * (s[j + 4] & 15) | (s[j - 4] >> 6) << 4, min (s[j + 4] >> 4) | (s[j] >> 6) << 4. */
static inline void dd_kq_scale_words(const uint8_t *blk, uint32_t w[4])
{
    uint32_t s0, s1, s2;
    memcpy(&s0, blk + 4, 4);
    memcpy(&s1, blk + 8, 4);
    memcpy(&s2, blk + 12, 4);
    w[0] = s0 & 0x3f3f3f3fu;
    w[1] = (s2 & 0x0f0f0f0fu) | (((s0 >> 6) & 0x03030303u) << 4);
    w[2] = s1 & 0x3f3f3f3fu;
    w[3] = ((s2 >> 4) & 0x0f0f0f0fu) | (((s1 >> 6) & 0x03030303u) << 4);
}

#endif
