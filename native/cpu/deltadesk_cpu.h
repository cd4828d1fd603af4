/* DeltaDesk CPU kernels: the public C surface (what engine/backends/cpu.py calls through cffi).
 *
 * Weight and activation blocks use ggml's layouts (ggml-common.h):
 *   block_q4_0 (18 bytes, 32 values): f16 d, then 16 bytes qs; element j < 16 is the low nibble
 *              of qs[j], element j + 16 its high nibble; value = (nibble - 8) * d.
 *   block_q8_0 (34 bytes, 32 values): f16 d, then 32 int8 qs; value = qs[j] * d.
 * A weight matrix is `rows` rows of k/32 blocks each, rows contiguous (a GGUF tensor's raw data).
 * Matrix products quantize the f32 activations to Q8_0 first (ggml's reference rounding), then
 * take exact integer dot products per block and sum the scaled block results in f32.
 *
 * ISA levels: 0 scalar C, 1 SSSE3, 2 AVX2 (+FMA, F16C), 3 AVX-512 VNNI (F, BW, VL, VNNI).
 * Functions that take an `isa` argument return DD_ERR_ISA if this CPU lacks that level.
 */
#ifndef DELTADESK_CPU_H
#define DELTADESK_CPU_H

#include <stddef.h>
#include <stdint.h>

enum { DD_ISA_SCALAR = 0, DD_ISA_SSSE3 = 1, DD_ISA_AVX2 = 2, DD_ISA_AVX512VNNI = 3, DD_ISA_COUNT = 4 };
enum { DD_Q4_0 = 0, DD_Q8_0 = 1, DD_WTYPE_COUNT = 2 };
enum { DD_OK = 0, DD_ERR_ISA = -1, DD_ERR_NOMEM = -2, DD_ERR_ARG = -3 };

/* 1 if this CPU (and OS) supports the level, else 0. */
int dd_isa_supported(int isa);
/* The highest supported level. */
int dd_isa_best(void);
/* Threads used by the kernels (the caller's thread included), clamped to [1, DD_MAX_THREADS]. */
#define DD_MAX_THREADS 256
void dd_set_threads(int n);
int dd_get_threads(void);

/* Read n bytes (n % 8 == 0, 8-byte aligned p) with all threads, as a memory-bandwidth probe
 * (sequential, with software prefetch 4 KiB ahead, which a single core needs to reach its share
 * of DRAM bandwidth); returns the wrapping sum of the 64-bit words, so reads are not optimised away. */
uint64_t dd_stream_read(const uint8_t *p, size_t n);

/* x: m rows of k f32 (k % 32 == 0) -> out: m rows of k/32 block_q8_0. */
int dd_quantize_q8_0(int isa, const float *x, size_t m, size_t k, uint8_t *out);

/* y[c][r] = sum_i W[r][i] * x[c][i] with W given as `rows` rows of k/32 blocks of type wtype
 * (DD_Q4_0 or DD_Q8_0), x: m rows of k f32, y: m rows of `rows` f32. */
int dd_matmul(int isa, int wtype, const uint8_t *w, size_t rows, size_t k,
              const float *x, size_t m, float *y);

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

#endif
