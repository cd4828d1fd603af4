"""cffi (API mode) build of the CPU kernels as ``engine._native_cpu``.

``setup.py`` names ``ffibuilder`` in ``cffi_modules``; its ``build_ext`` also calls
:func:`compile_isa_objects`, which compiles each ISA variant from its own file with its own flags
(the flags must not leak into the dispatcher, which has to run on any x86-64 CPU), and links the
objects into the extension. Runtime dispatch by CPUID happens in ``dispatch.c``.
"""

from __future__ import annotations

import os
import platform
import re

import cffi

MODULE_NAME = "engine._native_cpu"

HERE = os.path.relpath(os.path.dirname(os.path.abspath(__file__)))

COMMON_FLAGS = ["-O3", "-std=c11", "-D_GNU_SOURCE", "-ffp-contract=off", "-fno-math-errno", "-pthread"]
"""Contraction off: a fused multiply-add changes rounding, so fusing must be an explicit intrinsic."""

PORTABLE_SOURCES = ["dispatch.c", "matvec.c", "pool.c", "moe.c", "moe_prefill.c", "mixers.c", "attention.c", "step.c",
                    "kernels_scalar.c", "sgemm.c", "iq_grids.c"]

HEADERS = ["deltadesk_cpu.h", "kernels.h", "gemm_tiles.h", "kquants.h", "kq_tile_avx512.h", "kq_gemm_avx512.h", "q4_gemm_avx512.h", "bquants.h", "lowbit.h", "lowbit_avx512.h", "iquants.h", "bf16.h", "runtime.h",
           "attn_kernel.h", "attn_prefill.h", "attn_prefill_avx2.h", "attn_avx2.h", "gdn_kernel.h", "vexp.h", "sgemm_kernel.h"]
"""Listed as the extension's dependencies, so that editing one (or an ISA file) rebuilds it."""

X86_ISA_SOURCES = {
    "kernels_ssse3.c": ["-mssse3"],
    "kernels_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "kernels_avx512vnni.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
    "attention_avx2.c": ["-mavx2", "-mfma"],
    "attention_avx512.c": ["-mavx512f"],
    "mixers_avx2.c": ["-mavx2"],
    "mixers_avx512.c": ["-mavx512f"],
    "sgemm_avx512.c": ["-mavx512f"],
    "vit_attention_avx512.c": ["-mavx512f"],
    "vit_norm_avx512.c": ["-mavx512f"],
}

IS_X86 = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686", "x86"}

def cdef_from_header(path: str) -> str:
    """The C declarations cffi needs, taken from the public header itself (one source of truth):
    preprocessor lines are dropped except integer ``#define``s, which cffi's cdef understands."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    keep = [ln for ln in lines if not ln.startswith("#") or re.fullmatch(r"#define \w+ \d+", ln.strip())]
    return "\n".join(keep)


CDEF = cdef_from_header(os.path.join(HERE, "deltadesk_cpu.h"))


def compile_isa_objects(compiler, build_temp: str, debug: bool = False) -> list[str]:
    """Compile the per-ISA kernel files, each with its own -m flags; return the object paths.

    Args: compiler: a distutils/setuptools ``CCompiler`` (``build_ext.compiler``); build_temp:
    the folder for the objects. Returns [] off x86, where only the scalar kernels exist.
    Raises the compiler's ``CompileError`` if a file does not compile.
    """
    if not IS_X86:
        return []
    objects = []
    for name, flags in X86_ISA_SOURCES.items():
        objects += compiler.compile([os.path.join(HERE, name)], output_dir=build_temp, include_dirs=[HERE],
                                    extra_postargs=COMMON_FLAGS + flags, debug=debug)
    return objects


ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    MODULE_NAME,
    '#include "deltadesk_cpu.h"',
    sources=[os.path.join(HERE, name) for name in PORTABLE_SOURCES],
    depends=[os.path.join(HERE, name) for name in HEADERS + list(X86_ISA_SOURCES)],
    include_dirs=[HERE],
    extra_compile_args=COMMON_FLAGS,
    extra_link_args=["-pthread"],
    libraries=["m"],
    define_macros=[("DD_X86_ISAS", "1")] if IS_X86 else [],
    optional=True,
)
