/* Causal gated GQA attention (deltadesk_cpu.h dd_attn_decode, dd_attn_prefill and their _kv forms): the
 * portable copy of the kernel (attn_kernel.h) and the entry points, which pick the copy of the requested
 * ISA level. Every copy gives the same bits (attn_kernel.h says why), so the level only changes the speed. */
#define ATTN_SUFFIX base
#include "attn_kernel.h"

typedef int (*attn_decode_fn)(size_t, size_t, size_t, const float *, const float *, int, const void *,
                              const void *, size_t, float *);
typedef int (*attn_prefill_fn)(size_t, size_t, size_t, size_t, const float *, const float *, int, const void *,
                               const void *, size_t, float *);

#ifdef DD_X86_ISAS
int attn_decode_kv_avx2(size_t, size_t, size_t, const float *, const float *, int, const void *, const void *,
                        size_t, float *);
int attn_decode_kv_avx512(size_t, size_t, size_t, const float *, const float *, int, const void *, const void *,
                          size_t, float *);
int attn_prefill_kv_avx2(size_t, size_t, size_t, size_t, const float *, const float *, int, const void *,
                         const void *, size_t, float *);
int attn_prefill_kv_avx512(size_t, size_t, size_t, size_t, const float *, const float *, int, const void *,
                           const void *, size_t, float *);
#endif

static int attn_shape_ok(size_t n_head, size_t n_kv, size_t hd, size_t m, int kv_type)
{
    return n_kv != 0 && n_head % n_kv == 0 && n_head / n_kv <= DD_ATTN_MAX_GROUP && hd != 0 &&
           hd % DD_ATTN_LANES == 0 && m != 0 &&
           (kv_type == DD_KV_F32 || kv_type == DD_KV_F16 || (kv_type == DD_KV_Q8_0 && hd % DD_Q8_BLOCK == 0));
}

int dd_attn_decode_kv(size_t n_head, size_t n_kv, size_t hd, const float *q, const float *gate, int kv_type,
                      const void *k, const void *v, size_t m, float *out)
{
    if (!attn_shape_ok(n_head, n_kv, hd, m, kv_type))
        return DD_ERR_ARG;
    attn_decode_fn fn = attn_decode_kv_base;
#ifdef DD_X86_ISAS
    const int best = dd_isa_best();
    fn = best >= DD_ISA_AVX512VNNI ? attn_decode_kv_avx512 : best >= DD_ISA_AVX2 ? attn_decode_kv_avx2 : fn;
#endif
    return fn(n_head, n_kv, hd, q, gate, kv_type, k, v, m, out);
}

int dd_attn_decode(size_t n_head, size_t n_kv, size_t hd, const float *q, const float *gate,
                   const float *k, const float *v, size_t m, float *out)
{
    return dd_attn_decode_kv(n_head, n_kv, hd, q, gate, DD_KV_F32, k, v, m, out);
}

int dd_attn_prefill_kv(int isa, size_t n_head, size_t n_kv, size_t hd, size_t n, const float *q,
                       const float *gate, int kv_type, const void *k, const void *v, size_t m, float *out)
{
    if (!attn_shape_ok(n_head, n_kv, hd, m, kv_type) || n == 0 || n > m)
        return DD_ERR_ARG;
    if (!dd_isa_supported(isa))
        return DD_ERR_ISA;
    attn_prefill_fn fn = attn_prefill_kv_base;
#ifdef DD_X86_ISAS
    fn = isa >= DD_ISA_AVX512VNNI ? attn_prefill_kv_avx512 : isa >= DD_ISA_AVX2 ? attn_prefill_kv_avx2 : fn;
#endif
    return fn(n_head, n_kv, hd, n, q, gate, kv_type, k, v, m, out);
}

int dd_attn_prefill(int isa, size_t n_head, size_t n_kv, size_t hd, size_t n, const float *q, const float *gate,
                    const float *k, const float *v, size_t m, float *out)
{
    return dd_attn_prefill_kv(isa, n_head, n_kv, hd, n, q, gate, DD_KV_F32, k, v, m, out);
}
