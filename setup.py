"""Builds the Cython extensions: the CPU oracle (oracle/*.pyx), the GPU plan executor (rwkvx/_core.pyx)
and the tokenizer's trie (rwkvx/_trie.pyx). Building needs no GPU, no CUDA toolkit and no CUDA header:
_core calls the driver and cuBLAS through function pointers resolved at run time (see its docstring for
why not cydriver)."""
import glob
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

COMPILE_ARGS = ["-O3", "-ffp-contract=off"]


def extensions() -> list[Extension]:
    exts = [Extension(f"rwkvx.oracle.{os.path.basename(p)[:-4]}", [p],
                      include_dirs=[np.get_include()], extra_compile_args=COMPILE_ARGS)
            for p in sorted(glob.glob("oracle/*.pyx"))]
    exts += [Extension(f"rwkvx.{os.path.basename(p)[:-4]}", [p], include_dirs=[np.get_include()],
                       extra_compile_args=COMPILE_ARGS)
             for p in sorted(glob.glob("rwkvx/*.pyx"))]
    return exts


class ParallelBuildExt(build_ext):
    """Compiles the extensions side by side, one per CPU, unless -j/--parallel says otherwise: the
    generated C files take about a minute one after another, which a fresh GPU machine pays per start."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1


setup(cmdclass={"build_ext": ParallelBuildExt},
      ext_modules=cythonize(extensions(), language_level=3,
                            compiler_directives={"boundscheck": False, "wraparound": False,
                                                 "cdivision": True, "initializedcheck": False}))
