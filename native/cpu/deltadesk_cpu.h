/* DeltaDesk CPU kernels: the public C surface (what engine/kernels/cpu.py calls through cffi).
 *
 * Weight and activation blocks use ggml's layouts (ggml-common.h):
 *   block_q4_0 (18 bytes, 32 values): f16 d, then 16 bytes qs; element j < 16 is the low nibble
 *              of qs[j], element j + 16 its high nibble; value = (nibble - 8) * d.
 *   block_q8_0 (34 bytes, 32 values): f16 d, then 32 int8 qs; value = qs[j] * d.
 * A weight matrix is `rows` rows of k/32 blocks each, rows contiguous (a GGUF tensor's raw data).
 * Matrix products quantize the f32 activations to Q8_0 first (ggml's reference rounding), then
 * take exact integer dot products per block and scale them by d_w * d_a (exact in f32): Q4_0 and Q8_0
 * into f32 terms summed in 16 f32 lanes in a fixed order (quant/kernels.h), the other types into exact
 * f64 products summed in a fixed f64 order and rounded once to f32. Every ISA level gives the same bits.
 *
 * ISA levels: 0 scalar C, 1 SSSE3, 2 AVX2 (+FMA, F16C), 3 AVX-512 VNNI (F, BW, VL, VNNI).
 * Functions that take an `isa` argument return DD_ERR_ISA if this CPU lacks that level.
 */
#ifndef DELTADESK_CPU_H
#define DELTADESK_CPU_H

#include <stddef.h>
#include <stdint.h>

enum { DD_ISA_SCALAR = 0, DD_ISA_SSSE3 = 1, DD_ISA_AVX2 = 2, DD_ISA_AVX512VNNI = 3, DD_ISA_COUNT = 4 };
enum { DD_Q4_0 = 0, DD_Q8_0 = 1, DD_Q4_K = 2, DD_Q5_K = 3, DD_Q6_K = 4, DD_Q4_1 = 5, DD_Q5_0 = 6, DD_Q5_1 = 7,
       DD_IQ4_NL = 8, DD_IQ4_XS = 9, DD_Q2_K = 10, DD_Q3_K = 11, DD_IQ2_XXS = 12, DD_IQ2_XS = 13, DD_IQ2_S = 14,
       DD_IQ3_XXS = 15, DD_IQ3_S = 16, DD_IQ1_S = 17, DD_IQ1_M = 18, DD_MXFP4 = 19, DD_BF16 = 20,
       DD_F16 = 21, DD_Q4_0_IL = 22, DD_MXFP4_IL = 23, DD_Q4_K_IL = 24, DD_Q2_K_RL = 25,
       DD_Q3_K_RL = 26, DD_WTYPE_COUNT = 27 };
enum { DD_OK = 0, DD_ERR_ISA = -1, DD_ERR_NOMEM = -2, DD_ERR_ARG = -3 };

/* Register the codebook of an IQ type (ggml-common.h iq2xxs_grid for DD_IQ2_XXS, iq2xs_grid, iq2s_grid,
 * iq3xxs_grid, iq3s_grid, iq1s_grid for DD_IQ1_S, which IQ1_M shares): n int8 values, entry by entry (256 x 8,
 * 512 x 8, 1024 x 8, 256 x 4, 512 x 4, 2048 x 8). Until it is registered the kernels refuse the type
 * (DD_ERR_ARG); once, before any kernel call on it. DD_ERR_ARG for another type or count, or for a grid with more
 * distinct values than its codes hold (4 for the 8-wide grids, 8 for the 4-wide ones). */
int dd_set_iq_grid(int wtype, const int8_t *grid, size_t n);

/* The AVX-512 VNNI level's IQ GEMV (one activation column; every IQ type) on its AVX-512 VBMI +
 * BITALG path (on = 1, the default where the CPU has both) or the level's base code (0); the same bits either
 * way for finite results (the base code's NaN payloads may differ). DD_ERR_ISA (setting unchanged) for 1 on a CPU without them. For tests and timings. */
int dd_set_iq_vbmi(int on);

/* 1 if this CPU (and OS) supports the level, else 0. */
int dd_isa_supported(int isa);
/* The highest supported level. */
int dd_isa_best(void);
/* Threads used by the kernels (the caller's thread included), clamped to [1, DD_MAX_THREADS]. */
#define DD_MAX_THREADS 256
void dd_set_threads(int n);
int dd_get_threads(void);

/* Read n bytes (n % 8 == 0, 8-byte aligned p) with all threads, as a memory-bandwidth probe: each thread
 * reads 1 MiB chunks as `runs` interleaved runs (that many memory streams in flight, clamped to 1..8). The
 * best count differs by CPU (docs/perf/log/cpu-notes.md, "The stream read"), so callers try several. Returns the
 * wrapping sum of the 64-bit words, so reads are not optimised away. */
uint64_t dd_stream_read(const uint8_t *p, size_t n, int runs);

/* x: m rows of k f32 (k % 32 == 0) -> out: m rows of k/32 block_q8_0. */
int dd_quantize_q8_0(int isa, const float *x, size_t m, size_t k, uint8_t *out);

/* y[c][r] = sum_i W[r][i] * x[c][i] with W given as `rows` rows of k values in blocks of type wtype
 * (DD_Q4_0, DD_Q8_0, DD_Q4_1, DD_Q5_0, DD_Q5_1, DD_IQ4_NL, DD_MXFP4: 32 values a block; the K-quants DD_Q2_K ..
 * DD_Q6_K, DD_IQ4_XS and the IQ1/IQ2/IQ3 types: 256, block_q4_K etc. of ggml-common.h; k must be a multiple of the
 * block; DD_BF16: rows of k 2-byte values, the top halves of f32s, k a multiple of 32, multiplied by x itself
 * with exact f64 products, native/cpu/quant/bf16.h; DD_F16: the same with IEEE halves; DD_Q4_0_IL: Q4_0 rows in
 * dd_q4_0_interleave's layout, the bits of DD_Q4_0 on the row-major rows; DD_MXFP4_IL: MXFP4 rows in
 * dd_mxfp4_interleave's, the bits of DD_MXFP4; DD_Q4_K_IL: Q4_K rows in dd_q4_k_interleave's layout, the bits of
 * DD_Q4_K; DD_Q2_K_RL: Q2_K rows in dd_q2_k_rl_pack's layout, the bits of DD_Q2_K; DD_Q3_K_RL: Q3_K rows in
 * dd_q3_k_rl_pack's, the bits of DD_Q3_K), x: m rows of k f32, y: m rows
 * of `rows` f32. */
int dd_matmul(int isa, int wtype, const uint8_t *w, size_t rows, size_t k,
              const float *x, size_t m, float *y);

/* dd_matmul of n <= 8 matrices that read the same x (the projections of one input): x prepared once, the
 * products in one pool job; y[i] (m rows of rows[i] f32) gets the bits dd_matmul(isa, wtypes[i], w[i], rows[i],
 * k, x, m, y[i]) gives it. DD_ERR_ARG for n == 0 or > 8, m == 0, k == 0 or what dd_matmul refuses; DD_ERR_ISA,
 * DD_ERR_NOMEM. */
int dd_matmul_many(int isa, size_t n, const int *wtypes, const uint8_t *const *w, const size_t *rows, size_t k,
                   const float *x, size_t m, float *const *y);

/* The 8-row interleaved layout of a Q4_0 matrix (rows of k / 32 blocks, row_bytes = k / 32 * 18 apart),
 * the form the AVX-512 VNNI GEMV reads with rows as lanes: each stripe of 8 rows [8s, 8s + 8) keeps its
 * 8 * row_bytes bytes, block b of the 8 rows at bytes 144 b of the stripe: the 8 rows' f16 scales (row r at
 * 2 r), then at 16 + 32 q + 4 r row r's nibble bytes 4 q .. 4 q + 3 (q < 4). Rows past the last multiple of 8
 * stay row-major. dd_q4_0_interleave rewrites w in place into that layout, dd_q4_0_deinterleave back
 * (exactly); both DD_ERR_ARG if row_bytes is not a multiple of 18 or exceeds DD_Q4_0_IL_MAX_ROW_BYTES (k of
 * 29,120: a product de-interleaves whole stripes into a stack buffer of 8 such rows), DD_ERR_NOMEM without a
 * stripe's scratch.
 * dd_matmul and the MoE and decode-step calls read such a matrix as the weight type DD_Q4_0_IL (a stacked
 * expert tensor only when its experts' row counts are multiples of 8, so no stripe spans two experts). */
#define DD_Q4_0_IL_MAX_ROW_BYTES 16380
int dd_q4_0_interleave(uint8_t *w, size_t nrows, size_t row_bytes);
int dd_q4_0_deinterleave(uint8_t *w, size_t nrows, size_t row_bytes);

/* The same layout of an MXFP4 matrix (row_bytes = k / 32 * 17): block b of a stripe at bytes 136 b, the 8 rows'
 * e8m0 bytes (row r at r), then at 8 + 32 q + 4 r row r's nibble bytes 4 q .. 4 q + 3. dd_mxfp4_interleave and
 * dd_mxfp4_deinterleave as the Q4_0 pair (DD_ERR_ARG for rows not whole 17-byte blocks or longer than
 * DD_MXFP4_IL_MAX_ROW_BYTES, the same k of 29,120); the products read it as the weight type DD_MXFP4_IL. */
#define DD_MXFP4_IL_MAX_ROW_BYTES 15470
int dd_mxfp4_interleave(uint8_t *w, size_t nrows, size_t row_bytes);
int dd_mxfp4_deinterleave(uint8_t *w, size_t nrows, size_t row_bytes);

/* The 8-row interleaved layout of a Q4_K matrix (rows of k / 256 super-blocks of 144 bytes), read by the AVX-512
 * VNNI GEMV with rows as lanes: each stripe of 8 rows [8s, 8s + 8) keeps its 8 * row_bytes bytes, super-block b of
 * the 8 rows at bytes 1152 b of the stripe:
 *   0 + 2 r: row r's f16 d;  16 + 2 r: its f16 dmin;
 *   32 + 8 i + r (i < 4): low nibble = the low 4 bits of row r's scale of sub-block i, high nibble = those of
 *     sub-block i + 4's scale;  64 + 8 i + r: the same for the mins;
 *   96 + 8 i + r: bits 0-1 = the top 2 bits of scale i, 2-3 of scale i + 4, 4-5 of min i, 6-7 of min i + 4
 *     (scales and mins are the 6-bit values of ggml's get_scale_min_k4);
 *   128 + 256 j + 32 u + 4 r + t (j < 4, u < 8, t < 4): row r's qs byte 32 j + 4 u + t.
 * Rows past the last multiple of 8 stay row-major. dd_q4_k_interleave rewrites w in place into that layout,
 * dd_q4_k_deinterleave back (exactly); both DD_ERR_ARG if row_bytes is not a multiple of 144 or exceeds
 * DD_Q4_K_IL_MAX_ROW_BYTES (k of 28,672: a product de-interleaves whole stripes into a stack buffer of 8 such
 * rows), DD_ERR_NOMEM without a stripe's scratch. Products read such a matrix as the weight type DD_Q4_K_IL
 * (stacked experts as for DD_Q4_0_IL). */
#define DD_Q4_K_IL_MAX_ROW_BYTES 16128
int dd_q4_k_interleave(uint8_t *w, size_t nrows, size_t row_bytes);
int dd_q4_k_deinterleave(uint8_t *w, size_t nrows, size_t row_bytes);

/* The 4-row "rows as lanes" layout of a Q2_K matrix (rows of k / 256 super-blocks, row_bytes = k / 256 * 84
 * apart), the form the AVX-512 VNNI GEMV reads with (row, 16-value half) pairs as lanes: each group of 4 rows
 * [4 s, 4 s + 4) keeps its 4 * row_bytes bytes, super-block j of the 4 rows at bytes 336 j of the group:
 *   at 64 c + 4 (4 g + r) + i (c, g, r, i < 4): row r's qs byte 16 g + 4 c + i;
 *   at 256 + 32 p + 2 (4 q + r) + t (p, t < 2, q < 4): row r's scale byte 2 (2 p + B[q]) + t, B = {0, 4, 1, 5};
 *   at 320 + 2 r: row r's f16 d; at 328 + 2 r: its f16 dmin.
 * Rows past the last multiple of 4 stay row-major. dd_q2_k_rl_pack rewrites w in place into that layout,
 * dd_q2_k_rl_unpack back (exactly); both DD_ERR_ARG if row_bytes is not a multiple of 84 or exceeds
 * DD_Q2_K_RL_MAX_ROW_BYTES (k of 49,920: a product unpacks whole groups into a stack buffer of 4 such rows),
 * DD_ERR_NOMEM without a group's scratch. dd_matmul and the MoE and decode-step calls read such a matrix as the
 * weight type DD_Q2_K_RL (a stacked expert tensor only when its experts' row counts are multiples of 4). */
#define DD_Q2_K_RL_MAX_ROW_BYTES 16380
int dd_q2_k_rl_pack(uint8_t *w, size_t nrows, size_t row_bytes);
int dd_q2_k_rl_unpack(uint8_t *w, size_t nrows, size_t row_bytes);

/* The same 4-row "rows as lanes" layout of a Q3_K matrix (row_bytes = k / 256 * 110): each group of 4 rows keeps its
 * 4 * row_bytes bytes, super-block j of the 4 rows at bytes 440 j of the group (B = {0, 4, 1, 5}, s_i the 6-bit
 * scale i < 16 of ggml's 12 scale bytes, lowbit.h):
 *   at 64 c + 4 (4 g + r) + i (c, g, r, i < 4): row r's qs byte 16 g + 4 c + i;
 *   at 256 + 32 c + 4 (4 t + r) + i (t < 2): row r's hmask byte 16 t + 4 c + i;
 *   at 384 + 8 q + 2 r + t (q < 4): the low 4 bits of row r's s_i, i = 2 B[q] + t, then (high nibble) of s_(i + 4);
 *   at 416 + 8 u + 2 r + t (u < 2), bits 2 f and 2 f + 1 (f < 4): the top 2 bits of row r's s_(8 u + 2 f + t);
 *   at 432 + 2 r: row r's f16 d.
 * Rows past the last multiple of 4 stay row-major. dd_q3_k_rl_pack rewrites w in place into that layout,
 * dd_q3_k_rl_unpack back (exactly); both DD_ERR_ARG if row_bytes is not a multiple of 110 or exceeds
 * DD_Q3_K_RL_MAX_ROW_BYTES (k of 37,888: a product of a level without the layout's kernel unpacks whole groups into
 * a stack buffer), DD_ERR_NOMEM without a group's scratch. Products read such a matrix as the weight type
 * DD_Q3_K_RL (a stacked expert tensor only when its experts' row counts are multiples of 4). */
#define DD_Q3_K_RL_MAX_ROW_BYTES 16280
int dd_q3_k_rl_pack(uint8_t *w, size_t nrows, size_t row_bytes);
int dd_q3_k_rl_unpack(uint8_t *w, size_t nrows, size_t row_bytes);


/* One token's MoE feed-forward (Qwen3.5/3.6 `qwen35moe`), everything in one call:
 *   p = softmax(router x); the n_used largest (ties: lower index first), weights renormalised;
 *   out = sum_e w_e * down_e(silu(gate_e x') * up_e x') + sigmoid(shgate . x) * down_sh(silu(gate_sh x') * up_sh x')
 * where x' is x quantized to Q8_0 and the hidden vectors are quantized to Q8_0 before `down`.
 * Expert e of a stacked tensor is rows [e*ff, (e+1)*ff) (gate/up) or [e*d, (e+1)*d) (down).
 * The shared expert is skipped when sh_gate is NULL. sel/weights (may be NULL) receive the choice. */
typedef struct {
    size_t d;            /* model width (k of gate/up, rows of down); multiple of 32 */
    size_t n_expert, n_used;
    size_t ff;           /* routed expert hidden width; multiple of 32 */
    size_t ff_sh;        /* shared expert hidden width; multiple of 32 */
    const float *router; /* n_expert x d f32 */
    const uint8_t *gate, *up, *down;           /* stacked routed experts */
    int gate_type, up_type, down_type;
    const uint8_t *sh_gate, *sh_up, *sh_down;  /* shared expert (NULL: none) */
    int sh_gate_type, sh_up_type, sh_down_type;
    const float *sh_gate_inp;                  /* d f32: the shared expert's sigmoid gate vector */
} dd_moe_weights;

int dd_moe_ffn(int isa, const dd_moe_weights *w, const float *x, float *out,
               int32_t *sel, float *weights);

/* The MoE feed-forward of n tokens (x, out: n x d, row t token t), each given exactly the bits
 * dd_moe_ffn gives it alone, with each routed expert's weights read once for all the tokens routed
 * to it (one GEMM per expert and matrix) and the shared expert's once for all n. sel/weights (may
 * be NULL): n x n_used, row t token t's choice. */
int dd_moe_prefill(int isa, const dd_moe_weights *w, size_t n, const float *x, float *out,
                   int32_t *sel, float *weights);

/* The Gated DeltaNet recurrent step of one token (spec 3.2 steps 2-6), from the layer's raw
 * projections to the gated-normed output that `ssm_out` reads:
 *   conv over [conv_state; mixed] with conv_w, SiLU -> q (n_k x dk), k (n_k x dk), v (n_v x dv);
 *   q, k L2-normalised (eps), q scaled by 1/sqrt(dk); beta = sigmoid(b); g = ssm_a softplus(a + dt_bias);
 *   per v-head h (q/k head h % n_k): S <- exp(g) S; d = beta (v - S^T k); S <- S + k d^T; o = S^T q;
 *   y_h = rmsnorm(o_h, eps) * norm_w * silu(z_h).
 * conv_state ((conv_kernel - 1) x conv_dim, oldest row first) and ssm (n_v x dk x dv, S[i][j] at
 * i*dv + j) are updated in place. mixed: conv_dim = 2*n_k*dk + n_v*dv; z, y: n_v*dv; b, a: n_v. */
#define DD_GDN_MAX_DV 1024
#define DD_GDN_MAX_CONV 16
typedef struct {
    size_t n_k, n_v, dk, dv, conv_kernel;
    const float *conv_w;   /* conv_kernel x conv_dim (tap-major: a tap's weights contiguous), row 0 the oldest tap */
    const float *dt_bias;  /* n_v */
    const float *ssm_a;    /* n_v, stored -exp(A_log) */
    const float *norm_w;   /* dv */
    double eps;
} dd_gdn_layer;

int dd_gdn_decode(const dd_gdn_layer *L, const float *mixed, const float *z, const float *b, const float *a,
                  float *conv_state, float *ssm, float *y);

/* n tokens in order (mixed: n x conv_dim, z and y: n x n_v*dv, b and a: n x n_v, row t token t), each
 * by exactly the arithmetic of dd_gdn_decode (which is the n = 1 case, on the best level), on ISA
 * level isa (DD_ERR_ISA if unsupported; every level gives the same bits): the conv inputs per head of
 * channels, then every v-head through the n tokens on the pool, so splitting the tokens over calls
 * changes no bit. conv_kernel <= DD_GDN_MAX_CONV. */
int dd_gdn_prefill(int isa, const dd_gdn_layer *L, size_t n, const float *mixed, const float *z, const float *b,
                   const float *a, float *conv_state, float *ssm, float *y);

/* Causal gated GQA attention over the first m cache positions (spec 3.1 steps 5-6):
 *   out_n = softmax(q_n . k_t / sqrt(hd))_t . v_t  *  sigmoid(gate_n),  kv head n / (n_head / n_kv),
 * over the rows t <= the query's position. k, v: m positions of n_kv x hd (the KV cache rows);
 * hd % DD_ATTN_LANES == 0, n_head / n_kv <= DD_ATTN_MAX_GROUP. The arithmetic (attn_kernel.h): the
 * cache in blocks of DD_ATTN_BLOCK positions at absolute positions, per block float scores (dots as
 * DD_ATTN_LANES partial sums and a fixed float tree), max, probabilities and their double sum, a float
 * weighted sum of v; the blocks merged in order in double. Every ISA level and thread count gives
 * the same bits, and a query gets the same bits from dd_attn_decode and from any dd_attn_prefill
 * call it is part of (split invariance: its result depends only on its inputs and rows 0..pos).
 * dd_attn_decode: one query (q, gate, out: n_head x hd) at position m - 1, on the best ISA level,
 * the blocks on the pool. */
#define DD_ATTN_LANES 16
#define DD_ATTN_BLOCK 256
#define DD_ATTN_MAX_GROUP 64
int dd_attn_decode(size_t n_head, size_t n_kv, size_t hd, const float *q, const float *gate,
                   const float *k, const float *v, size_t m, float *out);

/* n queries at positions m - n .. m - 1 (q, gate, out: n x n_head x hd, row i at position m - n + i),
 * each by exactly the arithmetic of dd_attn_decode, on ISA level isa (DD_ERR_ISA if unsupported);
 * the pool runs (kv head, 16 to 64 queries) tiles, each through the blocks in order. */
int dd_attn_prefill(int isa, size_t n_head, size_t n_kv, size_t hd, size_t n, const float *q, const float *gate,
                    const float *k, const float *v, size_t m, float *out);

/* KV cache element types: float32 rows, IEEE half rows (each value rounded to nearest even when the
 * row is written), or Q8_0 rows (GGML's block_q8_0: per 32 values a little-endian half scale d and 32
 * int8 q, 34 bytes; value d * q; written by step.c's quantizer, engine/turn/kv_types.py's rule). A half
 * or a Q8_0 value is widened to float exactly before any arithmetic, so such a cache gives the bits an
 * F32 cache holding the same (rounded) values gives, at every ISA level and split. */
#define DD_KV_F32 0
#define DD_KV_F16 1
#define DD_KV_Q8_0 2
#define DD_Q8_BLOCK 32
#define DD_Q8_BYTES 34

/* dd_attn_decode and dd_attn_prefill over a cache of kv_type (DD_KV_F32, DD_KV_F16, or DD_KV_Q8_0 with hd
 * a multiple of DD_Q8_BLOCK; else DD_ERR_ARG): k and v point at m rows of n_kv x hd elements of that type. */
int dd_attn_decode_kv(size_t n_head, size_t n_kv, size_t hd, const float *q, const float *gate, int kv_type,
                      const void *k, const void *v, size_t m, float *out);
int dd_attn_prefill_kv(int isa, size_t n_head, size_t n_kv, size_t hd, size_t n, const float *q,
                       const float *gate, int kv_type, const void *k, const void *v, size_t m, float *out);

/* ---- The decode step (step.c): one token through the whole text model in one call ------------------
 * Qwen3.5/3.6 (`qwen35moe`, dense `qwen35`), engine/arch/qwen35/model.py's forward pass for one token:
 *   h = x; per layer: h += mixer(rmsnorm(h, attn_norm)); h += ffn(rmsnorm(h, post_norm));
 *   logits = lm_head(rmsnorm(h, output_norm)).
 * mixer: Gated DeltaNet (qkv, z, beta, alpha projections -> dd_gdn_decode -> ssm_out) or gated attention
 * (attn_q rows per head [q_h | gate_h], per-head RMSNorm of q and k, partial NEOX RoPE of the first
 * rope_dims values by the caller's cos/sin table, the K/V row written at cache row `pos`, dd_attn_decode
 * over rows 0..pos, attn_output); ffn: dd_moe_ffn, or the dense SwiGLU down(dd_silu_mul(gate x, up x)).
 * RMSNorms are float64 with numpy's pairwise sum (see step.c), residual adds float32. Every product gives
 * dd_matmul's bits for the layer's dd_mat, so all its weight types work. Returns DD_ERR_ARG if a shape, a
 * pointer or pos (< capacity) does not fit; the state rows of a step that fails are undefined. */
typedef struct {
    const uint8_t *w;    /* rows x (k / block values * block bytes), weight type wtype (dd_matmul) */
    int wtype;
    size_t rows, k;
} dd_mat;

enum { DD_LAYER_GDN = 0, DD_LAYER_ATTN = 1 };

typedef struct {
    int kind;                              /* DD_LAYER_GDN or DD_LAYER_ATTN */
    const float *attn_norm, *post_norm;    /* n_embd f32 each, as stored */
    dd_mat qkv, z, beta, alpha, ssm_out;   /* GDN: attn_qkv, attn_gate, ssm_beta, ssm_alpha, ssm_out */
    const dd_gdn_layer *gdn;
    dd_mat q, k, v, o;                     /* attention: attn_q (2 n_head hd rows), attn_k, attn_v, attn_output */
    const float *q_norm, *k_norm;          /* head_dim f32 each */
    const dd_moe_weights *moe;             /* MoE FFN, or NULL for the dense one below */
    dd_mat ffn_gate, ffn_up, ffn_down;
} dd_step_layer;

typedef struct {
    size_t n_layer, n_embd, n_head, n_head_kv, head_dim, rope_dims;
    double eps;                            /* attention.layer_norm_rms_epsilon */
    const dd_step_layer *layers;
    const float *output_norm;              /* n_embd f32 */
    dd_mat lm_head;                        /* n_vocab rows */
} dd_step_model;

/* One sequence's state, n_layer entries each (NULL where the layer is of the other kind): conv
 * ((conv_kernel - 1) x conv_dim) and ssm (n_v x dk x dv) of GDN layers, the K and V caches (capacity
 * rows of n_head_kv x head_dim elements of kv_type, DD_KV_F32, DD_KV_F16 or DD_KV_Q8_0) of attention layers;
 * updated in place. */
typedef struct {
    float **conv, **ssm;
    void **k, **v;
    size_t capacity;
    int kv_type;
} dd_step_state;

/* x: n_embd f32 (the token's embedding row); rope_cos, rope_sin: rope_dims / 2 f64 each, the angles of the
 * token's M-RoPE position; logits: lm_head.rows f32. */
int dd_step(int isa, const dd_step_model *m, const dd_step_state *s, size_t pos, const float *x,
            const double *rope_cos, const double *rope_sin, float *logits);

/* Batched decode: one token of each of n sequences (n >= 1) in one call, row i the bits dd_step gives
 * that token with state s[i] at row pos[i] alone (the products over all rows, the rest per row; step.c).
 * x: n x n_embd f32; rope_cos, rope_sin: n x rope_dims / 2 f64, row i's angles; logits: n x lm_head.rows
 * f32. The states must be distinct (no two rows may share an array). DD_ERR_ARG as dd_step, for any row. */
int dd_step_batch(int isa, const dd_step_model *m, size_t n, const dd_step_state *const *s, const size_t *pos,
                  const float *x, const double *rope_cos, const double *rope_sin, float *logits);

/* y = engine.ops.reference.rmsnorm of each of n rows of d values at x (w: d weights, or NULL for none): float64
 * x / sqrt(mean(x^2) + eps) * w with numpy's pairwise sum of the squares, rounded to f32; rows on the pool,
 * each with the bits it has alone. y may be x. DD_ERR_ARG when d is 0 or x or y is NULL. */
int dd_rmsnorm_rows(const float *x, const float *w, size_t n, size_t d, double eps, float *y);

/* The MoE experts' SwiGLU (dd_moe_ffn and dd_moe_prefill), float32: h[i] = g sigmoid(g) u[i] with e = e^-|g|,
 * g / (1 + e) for g >= 0 and (g e) / (1 + e) below (no overflow); e^x = 2^n p(r) for x = n ln2 + r (n rounded to
 * nearest, ln2 in two parts, |r| <= ln2 / 2), p the Taylor polynomial of degree 7 (truncation < 2^-27
 * relative), 2^n from two exponent fields, x clamped at -104 (e^x below the smallest subnormal); silu(-inf) is
 * NaN (-inf times 0), NaN stays NaN. Every element by the same IEEE float operations, so the bits do not
 * depend on n, the position, the vector width or the ISA level (isa: DD_ISA_*; DD_ERR_ISA if it is not built or
 * this CPU lacks it). */
int dd_moe_swiglu(int isa, const float *g, const float *u, size_t n, float *h);

/* y[i] = f32(silu(g[i])) * u[i], silu(x) = x sigmoid(x) in f64 (engine.ops.reference.silu's arithmetic,
 * libm's exp): the dense FFN's gate of the decode step and of the per-hook path alike. */
void dd_silu_mul(const float *g, const float *u, size_t n, float *y);

/* ---- float32 GEMM with pre-packed weights (sgemm_avx512.c), the vision towers' projections ------------
 * out[i][j] = act(sum_k x[i][k] w[j][k] + bias[j]) + add[i][j] for i < m, j < n, where w is the (n, k)
 * row-major weight (GGUF math shape) that dd_sgemm_pack_rows laid out once as panels of DD_SGEMM_NR output
 * columns: packed[(j / NR) * k * NR + kk * NR + j % NR] = w[j][kk], columns past n zero; the buffer holds
 * dd_sgemm_packed_floats(n, k) floats. Each sum is one float32 fused-multiply-add chain over kk = 0, 1, ...,
 * k - 1 in order, started from 0 (whatever the blocking, the thread count or the row/column split), then
 * + bias[j] (bias may be NULL: 0), then act (DD_ACT_NONE; DD_ACT_GELU_TANH: x / (1 + exp(-2 u)),
 * u = sqrt(2/pi) (x + 0.044715 x^3), the tanh form of GELU; DD_ACT_GELU_ERF: 0.5 x erfc(-x / sqrt 2) with
 * Numerical Recipes' erfc, section 6.2.2), then + add[i][j] (add may be NULL, or equal to out with
 * ld_add == ldo: a residual update). x rows are ldx floats apart, out rows ldo, add rows ld_add.
 * threads: at most this many of the pool's threads (dd_set_threads) take part, the caller's included.
 * Needs AVX-512 F (dd_sgemm_supported): DD_ERR_ISA otherwise; DD_ERR_ARG for a bad shape or act;
 * DD_ERR_NOMEM if scratch cannot be allocated. */
#define DD_SGEMM_NR 32
enum { DD_ACT_NONE = 0, DD_ACT_GELU_TANH = 1, DD_ACT_GELU_ERF = 2 };
size_t dd_sgemm_packed_floats(size_t n, size_t k);
/* 1 if this CPU runs dd_sgemm, dd_vit_attention and dd_vit_layer_norm (it has AVX-512 F), else 0. */
int dd_sgemm_supported(void);
/* Pack rows row0 .. row0 + rows - 1 of an (n, k) weight into the panels above: source row r is k values of
 * type dtype (DD_DTYPE_F32, DD_DTYPE_F16: IEEE half, DD_DTYPE_BF16: the top half of a float32) starting
 * ldw values after row r - 1's (a GGUF tensor as stored, converted to float32 exactly while packing). The
 * call that packs row n - 1 also zeroes the columns past n, so calls covering 0 .. n - 1 once each, in any
 * order, fill the whole buffer (e.g. q, k and v side by side). The panels are packed on the pool's threads
 * (dd_set_threads), each in address order; the buffer does not depend on their number. DD_ERR_ARG for
 * rows == 0, k == 0, ldw < k, row0 + rows > n or an unknown dtype. */
#define DD_DTYPE_F32 0
#define DD_DTYPE_F16 1
#define DD_DTYPE_BF16 2
int dd_sgemm_pack_rows(const void *w, int dtype, size_t ldw, size_t rows, size_t k, size_t row0, size_t n,
                       float *packed);
int dd_sgemm(const float *x, size_t ldx, size_t m, size_t k, const float *packed, size_t n, const float *bias,
             int act, const float *add, size_t ld_add, float *out, size_t ldo, int threads);
/* y[i] = act(x[i]) for i < n with the epilogue's vector arithmetic above (DD_ERR_ISA / DD_ERR_ARG as dd_sgemm). */
int dd_sgemm_act(int act, const float *x, size_t n, float *y);

/* Full (non-causal) attention of each piece of a stack, head by head (vit_attention_avx512.c): for row i of
 * piece p (rows starts[p] .. starts[p + 1] - 1) and head h,
 *   out[i][h*hd + c] = sum_j P_ij v_j[h*hd + c],  P_i = softmax_j((q_i / sqrt(hd)) . k_j) over the rows j of p,
 * where row i of qkv holds [q_i | k_i | v_i], each n_head * hd floats (a fused q|k|v projection), rows ldq
 * floats apart; out rows are ldo floats apart. The products use the GEMM's micro-kernel (one FMA chain over d
 * for a score, over j for an output), the softmax sg_exp and a float sum, so every thread count gives the
 * same bits and a piece the same bits alone or in a stack. threads as dd_sgemm. hd <= 256; starts holds
 * n_piece + 1 non-decreasing offsets from 0. DD_ERR_ISA without AVX-512 F, DD_ERR_ARG, DD_ERR_NOMEM. */
int dd_vit_attention(const float *qkv, size_t ldq, const size_t *starts, size_t n_piece, size_t n_head, size_t hd,
                     float *out, size_t ldo, int threads);

/* LayerNorm of m rows of d floats (vit_norm_avx512.c): out[i] = ((x[i] - mean_i) * rstd_i) * w + b, with
 * mean_i the row's mean, rstd_i = 1 / sqrt(var_i + eps), var_i the biased variance (two passes), each sum in
 * 16 float lanes added in a fixed order (a row gives the same bits whatever the thread count or the other
 * rows). x rows ldx floats apart, out rows ldo; out may be x itself (ldo == ldx), not overlap it otherwise.
 * threads as dd_sgemm. DD_ERR_ISA without AVX-512 F, DD_ERR_ARG for d == 0, ldx or ldo < d, eps < 0 or NaN. */
int dd_vit_layer_norm(const float *x, size_t ldx, size_t m, size_t d, const float *w, const float *b, float eps,
                      float *out, size_t ldo, int threads);

#endif
