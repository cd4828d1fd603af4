"""cffi (API mode) build of the CPU kernels as ``engine._native_cpu``.

``setup.py`` names ``ffibuilder`` in ``cffi_modules``; its ``build_ext`` also calls
:func:`compile_isa_objects`, which compiles each ISA variant from its own file with its own flags
(the flags must not leak into the dispatcher, which has to run on any x86-64 CPU), and links the
objects into the extension. Runtime dispatch by CPUID happens in ``runtime/dispatch.c``.

The sources sit in folders by kind (:data:`KINDS`): ``quant`` (weight formats and their products),
``attention``, ``gdn`` (the Gated DeltaNet step), ``moe``, ``vit`` (the vision towers' float32 GEMM,
attention and norms) and ``runtime`` (ISA dispatch, activations, the thread pool, the decode step); the
public header ``deltadesk_cpu.h`` stays here. Every folder is on the include path, so a file includes
another by its name alone.
"""

from __future__ import annotations

import os
import platform
import re

import cffi

MODULE_NAME = "engine._native_cpu"

HERE = os.path.relpath(os.path.dirname(os.path.abspath(__file__)))

COMMON_FLAGS = ["-O3", "-std=c11", "-D_GNU_SOURCE", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-g0"]
"""Contraction off: a fused multiply-add changes rounding, so fusing must be an explicit intrinsic. -g0 drops the
DWARF that Python's CFLAGS ask for (-g): ~33 of the extension's ~38 MB, shipped in the packaged app; the symbols
that `perf` needs stay."""

KINDS = ("quant", "attention", "gdn", "moe", "vit", "runtime")
"""The source folders, each on the include path."""

PORTABLE_SOURCES = ["runtime/dispatch.c", "quant/matvec.c", "runtime/pool.c", "moe/moe.c", "moe/moe_prefill.c",
                    "gdn/mixers.c", "attention/attention.c", "runtime/step.c", "quant/kernels_scalar.c", "vit/sgemm.c",
                    "quant/iq_grids.c", "quant/q4_interleave.c", "quant/q4k_interleave.c",
                    "quant/q2k_lanes.c", "quant/q3k_lanes.c"]

HEADERS = ["deltadesk_cpu.h", "quant/kernels.h", "quant/gemm_tiles.h", "quant/kquants.h", "quant/kq_tile_avx512.h",
           "quant/kq_gemm_avx512.h", "quant/kqh_few_avx512.h", "quant/q4_gemm_avx512.h", "quant/bquants.h",
           "quant/lowbit.h", "quant/lowbit_avx512.h", "quant/iquants.h", "quant/iquants_avx512.h", "quant/bf16.h",
           "runtime/runtime.h", "attention/attn_kernel.h", "attention/attn_prefill.h", "attention/attn_prefill_avx2.h",
           "attention/attn_avx2.h", "gdn/gdn_kernel.h", "gdn/vexp.h", "vit/sgemm_kernel.h",
           "quant/q4_il_avx512.h", "quant/q4k_il_avx512.h", "quant/q2k_rl_avx512.h", "quant/k_lanes.h",
           "quant/q4k_interleave.h", "quant/q4q8_tile.h", "quant/swiglu.h"]
"""Listed as the extension's dependencies, so that editing one (or an ISA file) rebuilds it."""

X86_ISA_SOURCES = {
    "quant/kernels_ssse3.c": ["-mssse3"],
    "quant/kernels_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "quant/kernels_avx512vnni.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
    "attention/attention_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "attention/attention_avx512.c": ["-mavx512f"],
    "gdn/mixers_avx2.c": ["-mavx2"],
    "gdn/mixers_avx512.c": ["-mavx512f"],
    "vit/sgemm_avx512.c": ["-mavx512f"],
    "vit/vit_attention_avx512.c": ["-mavx512f"],
    "vit/vit_norm_avx512.c": ["-mavx512f"],
}

INCLUDE_DIRS = [HERE] + [os.path.join(HERE, kind) for kind in KINDS]

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
        objects += compiler.compile([os.path.join(HERE, name)], output_dir=build_temp, include_dirs=INCLUDE_DIRS,
                                    extra_postargs=COMMON_FLAGS + flags, debug=debug)
    return objects


ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    MODULE_NAME,
    '#include "deltadesk_cpu.h"',
    sources=[os.path.join(HERE, name) for name in PORTABLE_SOURCES],
    depends=[os.path.join(HERE, name) for name in HEADERS + list(X86_ISA_SOURCES)],
    include_dirs=INCLUDE_DIRS,
    extra_compile_args=COMMON_FLAGS,
    extra_link_args=["-pthread"],
    libraries=["m"],
    define_macros=[("DD_X86_ISAS", "1")] if IS_X86 else [],
    optional=True,
)
