/* Shared by the portable C files (dispatch.c, matvec.c, pool.c, moe*.c, mixers.c, step.c, ...): the thread
 * pool, ISA tables, activation preparation, the decode path's scratch and products, the MoE routing. */
#ifndef DELTADESK_RUNTIME_H
#define DELTADESK_RUNTIME_H

#include "kernels.h"

/* Run fn(ctx, c) for every chunk c in [0, nchunks) on the pool's threads (the caller's included);
 * returns when all are done. A chunk's work must depend only on c. Callers from several threads
 * are served one at a time; nchunks <= 1 runs on the caller alone. */
typedef void (*dd_chunk_fn)(void *ctx, size_t chunk);
void dd_pool_for(dd_chunk_fn fn, void *ctx, size_t nchunks);
/* dd_pool_for with at most max_threads threads (the caller's included) claiming chunks. */
void dd_pool_for_limit(dd_chunk_fn fn, void *ctx, size_t nchunks, int max_threads);

/* The multiple of 8 nearest to `bytes` of rows of row_bytes (at least 8): whole GEMV tiles (4 rows) and whole
 * stripes of the interleaved layouts (8 rows), so a chunk of a DD_Q4_0_IL, DD_MXFP4_IL or DD_Q4_K_IL matrix starts
 * on a stripe. */
static inline size_t dd_rows_in(size_t bytes, size_t row_bytes)
{
    size_t r = (bytes / (row_bytes ? row_bytes : 1) + 4) / 8 * 8;
    return r < 8 ? 8 : r;
}

/* Rows per chunk: about 32 KiB of weights (dd_rows_in), so a decode-sized product splits into enough chunks
 * to balance and a tiny one stays on the caller. */
static inline size_t dd_chunk_rows(size_t row_bytes)
{
    return dd_rows_in(32768, row_bytes);
}

/* Rows per chunk of a product with m columns: dd_chunk_rows for m == 1; for m > 1 (prefill) about 64 KiB of
 * weights, which stay in L2 while the GEMM walks the column blocks (gemm_tiles.h), so a large m no longer
 * shrinks a chunk to a few rows that meet all m columns. */
static inline size_t dd_gemm_chunk_rows(size_t row_bytes, size_t m)
{
    return m <= 1 ? dd_chunk_rows(row_bytes) : dd_rows_in(65536, row_bytes);
}

static inline size_t dd_div_up(size_t a, size_t b)
{
    return (a + b - 1) / b;
}

static inline size_t dd_min_size(size_t a, size_t b)
{
    return a < b ? a : b;
}

/* The kernel table of an ISA level, or NULL if the level is unknown or unsupported here. */
const dd_kernels *dd_kernels_for(int isa);

/* Quantize m columns of k f32 (k % 32 == 0) into prepared activations; free with dd_acts_free. */
int dd_acts_new(const dd_kernels *kt, const float *x, size_t m, size_t k, dd_acts *a);
/* The same, its columns prepared on the pool (the same bytes); not from inside a pool job. */
int dd_acts_new_pooled(const dd_kernels *kt, const float *x, size_t m, size_t k, dd_acts *a);
/* The same in memory the caller owns (as dd_acts_prepare below). */
void dd_acts_prepare_pooled(const dd_kernels *kt, const float *x, size_t m, size_t k, void *mem, dd_acts *a);
/* Columns cols[0 .. m) of src as activations of their own: the bytes dd_acts_new gives those columns' values
 * (every layout holds a column's values on their own), without quantizing them again. x: their m x k f32
 * values, for the kernels that read them (dd_acts.x), or NULL where none will. Both src and the result need
 * m > 1 columns (one column has the GEMV's group layout): DD_ERR_ARG otherwise; DD_ERR_NOMEM. */
int dd_acts_gather(const dd_kernels *kt, const dd_acts *src, const size_t *cols, size_t m, const float *x, dd_acts *a);
void dd_acts_free(dd_acts *a);
/* The same activations in memory the caller owns: mem 64-byte aligned, dd_acts_bytes(kt, m, k) long,
 * valid while *a is used (no dd_acts_free). */
size_t dd_acts_bytes(const dd_kernels *kt, size_t m, size_t k);
void dd_acts_prepare(const dd_kernels *kt, const float *x, size_t m, size_t k, void *mem, dd_acts *a);

/* A buffer of at least `bytes` (64-byte aligned) that the calling thread reuses call after call: the
 * same slot returns the same memory, with what the thread left in it, until a larger size is asked for
 * (then a new, zeroed buffer), so per-call and per-task buffers cost no allocation and no page faults;
 * each slot serves one user at a time (one per caller that can be active in the same thread). Freed when
 * the thread exits. NULL if out of memory. (matvec.c) DD_SCRATCH_KQ_COL: the AVX-512 K-quant GEMV's
 * prepared column, kept between calls (kq_tile_avx512.h); DD_SCRATCH_KQH_COL: its few-column product's
 * arranged columns (kqh_few_avx512.h); DD_SCRATCH_Q2RL_COL: the rows-as-lanes Q2_K and Q3_K GEMVs' permuted column
 * (q2k_rl_avx512.h). */
enum { DD_SCRATCH_ACTS = 0, DD_SCRATCH_MOE = 1, DD_SCRATCH_SGEMM = 2, DD_SCRATCH_VIT = 3, DD_SCRATCH_KQ_COL = 4,
       DD_SCRATCH_KQH_COL = 5, DD_SCRATCH_Q2RL_COL = 6, DD_SCRATCH_COUNT = 7 };
void *dd_scratch(int slot, size_t bytes);

/* y = W x for several weight matrices of k columns (wtype as dd_matmul) that read the same x (k f32,
 * k % 32 == 0): x prepared once, one pool job; every y gets the bits dd_matmul(isa, wtype, w, rows, k,
 * x, 1, y) gives it (matvec.c says why). n <= DD_MATVEC_SET_MAX. DD_ERR_ISA, DD_ERR_ARG (a type that
 * does not fit k, k == 0), DD_ERR_NOMEM. */
typedef struct {
    int wtype;
    const uint8_t *w;      /* rows x dd_row_bytes(wtype, k) */
    size_t rows;
    float *y;              /* rows f32 */
} dd_matvec_out;
#define DD_MATVEC_SET_MAX 8
int dd_matvec_set(int isa, const dd_matvec_out *p, size_t n, size_t k, const float *x);
/* The same for m columns (x: m x k f32; each y: m rows of `rows` f32), every y the bits of dd_matmul(isa,
 * wtype, w, rows, k, x, m, y); the columns prepared once, on the pool (a batched decode step's few columns
 * stay on the caller: one chunk), in the thread's scratch up to 8 columns, else in memory of their own. Not from
 * inside a pool job. DD_ERR_ARG also for m == 0. */
int dd_matmul_set(int isa, const dd_matvec_out *p, size_t n, size_t k, const float *x, size_t m);

/* dd_gdn_prefill of one token for each of n sequences (row i: mixed + i conv_dim, z + i nvd, b and a + i n_v,
 * y + i nvd; its own conv_state[i] and ssm[i]), each row with the bits of its one-token call, in one pair of
 * pool jobs for all rows (gdn_kernel.h). DD_ERR_ARG, DD_ERR_ISA, DD_ERR_NOMEM as dd_gdn_prefill. */
int dd_gdn_decode_rows(int isa, const dd_gdn_layer *L, size_t n, const float *mixed, const float *z, const float *b,
                       const float *a, float *const *conv_state, float *const *ssm, float *y);

/* Values and bytes of one block of each weight type (ggml-common.h), indexed by DD_Q4_0... */
static inline size_t dd_block_values(int wtype)
{
    return wtype == DD_Q4_0 || wtype == DD_Q8_0 || wtype == DD_Q4_1 || wtype == DD_Q5_0 || wtype == DD_Q5_1 ||
                   wtype == DD_IQ4_NL || wtype == DD_MXFP4 || wtype == DD_BF16 || wtype == DD_F16 ||
                   wtype == DD_Q4_0_IL || wtype == DD_MXFP4_IL
               ? DD_QK
               : DD_QK_K;
}

static inline size_t dd_block_bytes(int wtype)
{
    static const size_t bytes[DD_WTYPE_COUNT] = { DD_Q4_0_BYTES, DD_Q8_0_BYTES, DD_Q4_K_BYTES, DD_Q5_K_BYTES,
                                                  DD_Q6_K_BYTES, DD_Q4_1_BYTES, DD_Q5_0_BYTES, DD_Q5_1_BYTES,
                                                  DD_IQ4_NL_BYTES, DD_IQ4_XS_BYTES, DD_Q2_K_BYTES, DD_Q3_K_BYTES,
                                                  DD_IQ2_XXS_BYTES, DD_IQ2_XS_BYTES, DD_IQ2_S_BYTES, DD_IQ3_XXS_BYTES,
                                                  DD_IQ3_S_BYTES, DD_IQ1_S_BYTES, DD_IQ1_M_BYTES, DD_MXFP4_BYTES,
                                                  DD_BF16_BYTES, DD_F16_BYTES, DD_Q4_0_BYTES, DD_MXFP4_BYTES,
                                                  DD_Q4_K_BYTES, DD_Q2_K_BYTES, DD_Q3_K_BYTES };
    return bytes[wtype];
}

/* 1 if an IQ type's codebook is registered (dd_set_iq_grid; iq_grids.c); 1 for the other types. */
int dd_iq_ready(int wtype);

/* 1 if wtype is a known weight type (an IQ type: with its codebook registered) and k a whole number of its blocks. */
static inline int dd_wtype_fits(int wtype, size_t k)
{
    return wtype >= 0 && wtype < DD_WTYPE_COUNT && k % dd_block_values(wtype) == 0 && dd_iq_ready(wtype);
}

static inline size_t dd_row_bytes(int wtype, size_t k)
{
    return k / dd_block_values(wtype) * dd_block_bytes(wtype);
}

/* The MoE routing shared by the one-token and the prompt calls (moe.c): dd_moe_valid is 1 if the weights'
 * shapes and types fit (n_used <= DD_MOE_MAX_USED); dd_moe_route takes the softmax of n_expert logits
 * (p: n_expert floats of scratch), the n_used largest probabilities (ties: lower index first) into sel
 * and their weights renormalised to sum 1 (the sum clamped at >= 2^-14 as llama.cpp does). */
#define DD_MOE_MAX_USED 64
int dd_moe_valid(const dd_moe_weights *w);
void dd_moe_route(const float *logits, size_t n_expert, size_t n_used, int32_t *sel, float *weights, float *p);

#endif
