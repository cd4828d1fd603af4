/* e^x in double on vectors of 8 doubles, the same bits at every ISA level: only IEEE + - * on
 * doubles and integer bit operations, with contraction off (build.py), so the compiler's lowering
 * for SSE2, AVX2 or AVX-512 changes the instructions, never a result. Used by gdn_kernel.h (the
 * sigmoids of SiLU and the output gate). */
#ifndef DELTADESK_VEXP_H
#define DELTADESK_VEXP_H

#pragma GCC diagnostic ignored "-Wpsabi"   /* 64-byte vectors in inlined helpers only, no ABI crossing */

typedef double dd_vd __attribute__((vector_size(64)));
typedef long long dd_vl __attribute__((vector_size(64)));

/* e^x for -708 <= x <= 0 (2^n stays a normal double): x = n ln2 + r (|r| <= ln2/2, ln2 in two
 * parts, fdlibm's split), the Taylor series of e^r to degree 11 (truncation < 3e-13 relative), times
 * 2^n from the exponent bits; n = x log2e rounded by adding and subtracting 1.5 * 2^52 (exact in
 * round-to-nearest). */
static inline __attribute__((always_inline)) dd_vd dd_exp_d(dd_vd x)
{
    const dd_vd magic = (dd_vd){ 0 } + 6755399441055744.0;
    const dd_vd t = x * 1.44269504088896340736 + magic;
    const dd_vd n = t - magic;
    const dd_vd r = (x - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
    dd_vd y = (dd_vd){ 0 } + 1.0 / 39916800.0;
    static const double c[11] = { 1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0,
                                  1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0 };
    for (int i = 0; i < 11; i++)
        y = y * r + c[i];
    return y * (dd_vd)(((dd_vl)t - (dd_vl)magic + 1023) << 52);
}

/* The logistic function 1 / (1 + e^-x) of 8 doubles, the formula of mixers' scalar sigmoid:
 * e = e^-|x| (e^-708 below -708, where the result is below any float it is rounded to times any
 * float it multiplies), then 1 / (1 + e) for x >= 0 and e / (1 + e) otherwise (one division of the chosen numerator). */
static inline __attribute__((always_inline)) dd_vd dd_sigmoid_d(dd_vd x)
{
    const dd_vl sign = (dd_vl){ 0 } + (long long)0x8000000000000000ULL;
    dd_vd nabs = (dd_vd)((dd_vl)x | sign);
    const dd_vl low = nabs < -708.0;
    nabs = (dd_vd)(((dd_vl)nabs & ~low) | ((dd_vl)((dd_vd){ 0 } - 708.0) & low));
    const dd_vd e = dd_exp_d(nabs), one = (dd_vd){ 0 } + 1.0;
    const dd_vl pos = x >= 0.0;
    return (dd_vd)(((dd_vl)one & pos) | ((dd_vl)e & ~pos)) / (one + e);
}

#endif
