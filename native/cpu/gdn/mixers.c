/* The Gated DeltaNet entry points (deltadesk_cpu.h dd_gdn_decode, dd_gdn_prefill): the portable copy
 * of the kernel (gdn_kernel.h) and the checks, which then pick the copy of the requested ISA level.
 * Every copy gives the same bits (gdn_kernel.h says why), so the level only changes the speed.
 * (Attention over the KV cache is attention.c.) */
#define GDN_SUFFIX base
#include "gdn_kernel.h"

typedef int (*gdn_prefill_fn)(const dd_gdn_layer *, size_t, const float *, const float *, const float *,
                              const float *, float *, float *, float *);
typedef int (*gdn_rows_fn)(const dd_gdn_layer *, size_t, const float *, const float *, const float *,
                           const float *, float *const *, float *const *, float *);

#ifdef DD_X86_ISAS
int gdn_prefill_avx2(const dd_gdn_layer *, size_t, const float *, const float *, const float *, const float *,
                     float *, float *, float *);
int gdn_prefill_avx512(const dd_gdn_layer *, size_t, const float *, const float *, const float *, const float *,
                       float *, float *, float *);
int gdn_decode_rows_avx2(const dd_gdn_layer *, size_t, const float *, const float *, const float *, const float *,
                         float *const *, float *const *, float *);
int gdn_decode_rows_avx512(const dd_gdn_layer *, size_t, const float *, const float *, const float *,
                           const float *, float *const *, float *const *, float *);
#endif

static int gdn_layer_ok(const dd_gdn_layer *L)
{
    return !(L->dv == 0 || L->dv > DD_GDN_MAX_DV || L->dk == 0 || L->n_k == 0 || L->n_v % L->n_k != 0 ||
             L->conv_kernel < 1 || L->conv_kernel > DD_GDN_MAX_CONV);
}

int dd_gdn_decode(const dd_gdn_layer *L, const float *mixed, const float *z, const float *b, const float *a,
                  float *conv_state, float *ssm, float *y)
{
    return dd_gdn_prefill(dd_isa_best(), L, 1, mixed, z, b, a, conv_state, ssm, y);
}

int dd_gdn_prefill(int isa, const dd_gdn_layer *L, size_t n, const float *mixed, const float *z, const float *b,
                   const float *a, float *conv_state, float *ssm, float *y)
{
    if (!gdn_layer_ok(L) || n == 0)
        return DD_ERR_ARG;
    if (!dd_isa_supported(isa))
        return DD_ERR_ISA;
    gdn_prefill_fn fn = gdn_prefill_base;
#ifdef DD_X86_ISAS
    fn = isa >= DD_ISA_AVX512VNNI ? gdn_prefill_avx512 : isa >= DD_ISA_AVX2 ? gdn_prefill_avx2 : fn;
#endif
    return fn(L, n, mixed, z, b, a, conv_state, ssm, y);
}

int dd_gdn_decode_rows(int isa, const dd_gdn_layer *L, size_t n, const float *mixed, const float *z, const float *b,
                       const float *a, float *const *conv_state, float *const *ssm, float *y)
{
    if (!gdn_layer_ok(L) || n == 0)
        return DD_ERR_ARG;
    if (!dd_isa_supported(isa))
        return DD_ERR_ISA;
    gdn_rows_fn fn = gdn_decode_rows_base;
#ifdef DD_X86_ISAS
    fn = isa >= DD_ISA_AVX512VNNI ? gdn_decode_rows_avx512 : isa >= DD_ISA_AVX2 ? gdn_decode_rows_avx2 : fn;
#endif
    return fn(L, n, mixed, z, b, a, conv_state, ssm, y);
}
