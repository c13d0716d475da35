"""Builds the Cython extensions: the CPU oracle's loop modules (oracle/*.pyx), the GPU plan executor
(rwkvx/_core.pyx) and the tokenizer's trie (rwkvx/_trie.pyx). Building needs no GPU, no CUDA toolkit and
no CUDA header: _core calls the driver and cuBLAS through function pointers resolved at run time (see its
docstring for why not cydriver)."""
import glob
import os
import sysconfig

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

COMPILE_ARGS = ["-O3", "-ffp-contract=off"]
EXTENSION_FOLDERS = {"oracle": "rwkvx.oracle", "rwkvx": "rwkvx"}   # folder -> the package of its *.pyx


def extensions() -> list[Extension]:
    return [Extension(f"{package}.{os.path.basename(p)[:-4]}", [p], include_dirs=[np.get_include()],
                      extra_compile_args=COMPILE_ARGS)
            for folder, package in EXTENSION_FOLDERS.items() for p in sorted(glob.glob(f"{folder}/*.pyx"))]


class ParallelBuildExt(build_ext):
    """Compiles the extensions side by side, one per CPU, unless -j/--parallel says otherwise: the
    generated C files take about a minute one after another, which a fresh GPU machine pays per start."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def run(self):
        """Builds, then deletes the compiled modules an older in-place build left in the source folders
        whose .pyx is gone (a module now plain Python): Python would import them instead of its .py file."""
        super().run()
        for folder in EXTENSION_FOLDERS:
            for built in glob.glob(os.path.join(folder, "*" + sysconfig.get_config_var("EXT_SUFFIX"))):
                if not os.path.exists(os.path.join(folder, os.path.basename(built).split(".")[0] + ".pyx")):
                    os.remove(built)


setup(cmdclass={"build_ext": ParallelBuildExt},
      ext_modules=cythonize(extensions(), language_level=3,
                            compiler_directives={"boundscheck": False, "wraparound": False,
                                                 "cdivision": True, "initializedcheck": False}))
