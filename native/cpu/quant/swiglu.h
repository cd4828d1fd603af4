/* The MoE experts' SwiGLU (dd_moe_swiglu in deltadesk_cpu.h) at a vector width of the including file's choice:
 * DD_SWIGLU_DEFINE(NAME, W) defines `static void NAME(const float *g, const float *u, size_t n, float *h)` on
 * GCC vectors of W floats. Every step is a lane-wise IEEE float or int32 operation (contraction off, build.py), so
 * each element's bits do not depend on W, n or its position: the scalar and SSSE3 levels take W = 4 (SSE2's width;
 * wider vectors lose their compares to scalar code there), AVX2 8, AVX-512 16. The tail is padded with zeros.
 */
#ifndef DELTADESK_SWIGLU_H
#define DELTADESK_SWIGLU_H

#include <stdint.h>
#include <string.h>

#define DD_SWIGLU_DEFINE(NAME, W)                                                                               \
    typedef float NAME##_vf __attribute__((vector_size(4 * (W))));                                            \
    typedef int32_t NAME##_vi __attribute__((vector_size(4 * (W))));                                          \
    typedef uint32_t NAME##_vu __attribute__((vector_size(4 * (W))));                                         \
    /* g sigmoid(g) u of W values: e = e^-|g| = 2^n p(r), g / (1 + e) for g >= 0, g e / (1 + e) below */        \
    static inline __attribute__((always_inline)) NAME##_vf NAME##_lanes(NAME##_vf g, NAME##_vf u)               \
    {                                                                                                          \
        const NAME##_vf magic = (NAME##_vf){ 0 } + 12582912.0f;   /* 1.5 * 2^23: adding it rounds */           \
        const NAME##_vf lo = (NAME##_vf){ 0 } - 104.0f;                                                        \
        const NAME##_vi neg = g < 0.0f;                                                                        \
        NAME##_vf x = (NAME##_vf)((NAME##_vi)g | ((NAME##_vi){ 0 } + INT32_MIN));   /* -|g| */                 \
        const NAME##_vi under = x < lo;                                             /* NaN: false */           \
        x = (NAME##_vf)(((NAME##_vi)x & ~under) | ((NAME##_vi)lo & under));                                    \
        const NAME##_vf t = x * 1.44269504f + magic, n = t - magic;                                            \
        const NAME##_vf r = (x - n * 0.693359375f) - n * -2.12194440e-4f;   /* ln2 in two parts */             \
        NAME##_vf p = (NAME##_vf){ 0 } + 1.0f / 5040.0f;                                                       \
        static const float c[7] = { 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f }; \
        for (int i = 0; i < 7; i++)                                                                            \
            p = p * r + c[i];                                                                                  \
        const NAME##_vi ni = (NAME##_vi)t - (NAME##_vi)magic, n1 = ni >> 1;   /* n in [-150, 0]: 2 halves */   \
        /* unsigned shifts: a NaN lane's n is garbage, and its result NaN whatever the scale */                \
        const NAME##_vf e = p * (NAME##_vf)((NAME##_vu)(n1 + 127) << 23) *                                     \
                            (NAME##_vf)((NAME##_vu)(ni - n1 + 127) << 23);                                     \
        const NAME##_vf num = (NAME##_vf)(((NAME##_vi)(g * e) & neg) | ((NAME##_vi)g & ~neg));                 \
        return num / (1.0f + e) * u;                                                                           \
    }                                                                                                          \
    static void NAME(const float *g, const float *u, size_t n, float *h)                                       \
    {                                                                                                          \
        size_t i = 0;                                                                                          \
        for (; i + (W) <= n; i += (W)) {                                                                       \
            NAME##_vf gv, uv;                                                                                  \
            memcpy(&gv, g + i, sizeof gv);                                                                     \
            memcpy(&uv, u + i, sizeof uv);                                                                     \
            const NAME##_vf hv = NAME##_lanes(gv, uv);                                                         \
            memcpy(h + i, &hv, sizeof hv);                                                                     \
        }                                                                                                      \
        if (i < n) {                                                                                           \
            NAME##_vf gv = { 0 }, uv = { 0 };                                                                  \
            memcpy(&gv, g + i, (n - i) * sizeof(float));                                                       \
            memcpy(&uv, u + i, (n - i) * sizeof(float));                                                       \
            const NAME##_vf hv = NAME##_lanes(gv, uv);                                                         \
            memcpy(h + i, &hv, (n - i) * sizeof(float));                                                       \
        }                                                                                                      \
    }

#endif
