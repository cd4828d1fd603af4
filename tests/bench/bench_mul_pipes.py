"""How fast one core issues the AVX-512 instructions of the Q4_0 products (a script, not a test).

    python tests/bench/bench_mul_pipes.py [--iters 200000000]

Compiles a small C loop with gcc (-mavx512f -mavx512bw -mavx512vnni) into a temporary folder and runs it on the
calling core. Each loop keeps 8 or 12 independent accumulator chains (inline assembly, so the compiler neither
fuses nor drops them) and prints billions of ``vpdpbusd`` (zmm) a second: alone; with 2 ``vcvtdq2ps``, 2
``vmulps``, 2 ``vaddps``, 2 ``vpaddd`` or 8 zmm loads beside every 8; and the mix one Q4_0 block group of one row
and one column costs in the prompt GEMM (q4_gemm_avx512.h: 8 ``vpdpbusd``, the int-to-float conversion, the scale
product and the term's product, the adds). An instruction that slows the ``vpdpbusd`` rate shares its pipes;
the mix's rate bounds that GEMM at 64 multiply-adds a ``vpdpbusd``. docs/perf/log/probe-2026-12-07.md used it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static long N;
#define DP(c) __asm__ volatile("vpdpbusd %1,%2,%0" : "+v"(c) : "v"(a), "v"(b));
#define OP(ins, d, s) __asm__ volatile(ins " %1,%0,%0" : "+v"(d) : "v"(s));
#define LD(d, off) __asm__ volatile("vmovdqu64 " #off "(%1),%0" : "=v"(d) : "r"(mem));
#define LOOP(NAME, CHAINS, BODY)                                                                          \
    static double NAME(__m512i a, __m512i b, __m512 f, const void *mem, __m512i *sink)                  \
    {                                                                                                   \
        __m512i c0 = a, c1 = b, c2 = a, c3 = b, c4 = a, c5 = b, c6 = a, c7 = b, c8 = a, c9 = b, c10 = a, c11 = b; \
        __m512 s0 = f, s1 = f, t0 = f, t1 = f;                                                          \
        __m512i i0 = a, i1 = b;                                                                         \
        const double t = now();                                                                         \
        for (long i = 0; i < N / CHAINS; i++) { BODY }                                                  \
        const double dt = now() - t;                                                                    \
        *sink = c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7 + c8 + c9 + c10 + c11 + i0 + i1 +                 \
                (__m512i)(s0 + s1 + t0 + t1);                                                           \
        return N / dt / 1e9;                                                                            \
    }
#define DP8 DP(c0) DP(c1) DP(c2) DP(c3) DP(c4) DP(c5) DP(c6) DP(c7)
LOOP(dp12, 12, DP8 DP(c8) DP(c9) DP(c10) DP(c11))
LOOP(dp8, 8, DP8)
#define CVT(d, s) __asm__ volatile("vcvtdq2ps %1,%0" : "=v"(d) : "v"(s));
LOOP(dp8_cvt2, 8, DP8 CVT(t0, a) CVT(t1, b))
LOOP(dp8_mul2, 8, DP8 OP("vmulps", s0, f) OP("vmulps", s1, f))
LOOP(dp8_add2, 8, DP8 OP("vaddps", s0, f) OP("vaddps", s1, f))
LOOP(dp8_paddd2, 8, DP8 OP("vpaddd", i0, a) OP("vpaddd", i1, b))
LOOP(dp8_load8, 8, DP8 LD(i0, 0) LD(i1, 64) LD(i0, 128) LD(i1, 192) LD(i0, 256) LD(i1, 320) LD(i0, 384) LD(i1, 448))
LOOP(q4_group, 8, DP8 CVT(t0, c0) OP("vmulps", s0, f)
     OP("vmulps", t0, s0) OP("vaddps", t1, t0) OP("vpaddd", c1, c2))
int main(int argc, char **argv)
{
    N = atol(argv[1]);
    static __m512i mem[8], sink;
    const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(2);
    const __m512 f = _mm512_set1_ps(1.0f);
    printf("vpdpbusd alone, 12 chains: %.2f G/s\n", dp12(a, b, f, mem, &sink));
    printf("vpdpbusd alone, 8 chains:  %.2f G/s\n", dp8(a, b, f, mem, &sink));
    printf("+ 2 vcvtdq2ps per 8:       %.2f G/s\n", dp8_cvt2(a, b, f, mem, &sink));
    printf("+ 2 vmulps per 8:          %.2f G/s\n", dp8_mul2(a, b, f, mem, &sink));
    printf("+ 2 vaddps per 8:          %.2f G/s\n", dp8_add2(a, b, f, mem, &sink));
    printf("+ 2 vpaddd per 8:          %.2f G/s\n", dp8_paddd2(a, b, f, mem, &sink));
    printf("+ 8 zmm loads per 8:       %.2f G/s\n", dp8_load8(a, b, f, mem, &sink));
    const double g = q4_group(a, b, f, mem, &sink);
    printf("Q4_0 block group (8 vpdpbusd, cvt, 2 mul, add, paddd): %.2f G vpdpbusd/s = %.0f G multiply-adds/s\n",
           g, 64 * g);
    return ((int *)&sink)[0] == 12345;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=200_000_000, help="vpdpbusd per loop")
    args = ap.parse_args()
    if args.iters < 24:
        raise SystemExit("--iters: at least 24")
    with tempfile.TemporaryDirectory() as folder:
        src, exe = os.path.join(folder, "pipes.c"), os.path.join(folder, "pipes")
        with open(src, "w") as fh:
            fh.write(SOURCE)
        subprocess.run(["gcc", "-O2", "-mavx512f", "-mavx512bw", "-mavx512vnni", src, "-o", exe], check=True)
        print(f"load {os.getloadavg()[0]:.2f}", flush=True)
        subprocess.run([exe, str(args.iters)], check=True)


if __name__ == "__main__":
    main()
