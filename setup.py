"""Build hook for the native CPU kernels; everything else about the package is in pyproject.toml.

The kernels are a cffi API-mode extension (``engine._native_cpu``, see native/cpu/build.py),
declared optional: a failed build (no C compiler, an old one) does not fail the install, setuptools
warns "building extension ... failed" and ``engine.kernels.cpu`` runs its numpy fallback.
The per-ISA kernel files are compiled here with their own flags and linked into the extension.
"""

from __future__ import annotations

import os
import runpy

from setuptools import setup
from setuptools.command.build_ext import build_ext

NATIVE = runpy.run_path(os.path.join("native", "cpu", "build.py"))


class BuildExtWithIsaObjects(build_ext):
    """build_ext that compiles each ISA kernel file with its own flags into the native extension.

    A compile error here is handled like any other in an optional extension: a warning, no module.
    """

    def build_extension(self, ext) -> None:
        """Build one extension; the native kernels get their per-ISA objects linked in."""
        if ext.name == NATIVE["MODULE_NAME"]:
            objects = NATIVE["compile_isa_objects"](self.compiler, self.build_temp, self.debug)
            ext.extra_objects = [*(ext.extra_objects or []), *objects]
        super().build_extension(ext)


setup(
    cffi_modules=["native/cpu/build.py:ffibuilder"],
    cmdclass={"build_ext": BuildExtWithIsaObjects},
)
