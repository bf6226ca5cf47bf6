"""Builds the optional C kernels (`k3stream.quant.kernels._ggml_cpu`); everything else is in pyproject.toml.

Without a C compiler the install still succeeds and the kernels fall back to the torch reference path
(k3stream warns at load). A compiler without OpenMP (Apple's clang) builds them for one thread.
"""

import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

OPENMP = "-fopenmp"


class BuildKernels(build_ext):
    """The extension with OpenMP where the compiler takes `-fopenmp`, else without it."""

    def build_extension(self, ext: Extension) -> None:
        if not self._compiles_with_openmp():
            self.warn(f"{self.compiler.compiler_so[0]} has no OpenMP: the C kernels run on one thread")
            ext.extra_compile_args = [arg for arg in ext.extra_compile_args if arg != OPENMP]
            ext.extra_link_args = [arg for arg in ext.extra_link_args if arg != OPENMP]
        super().build_extension(ext)

    def _compiles_with_openmp(self) -> bool:
        with tempfile.TemporaryDirectory() as scratch:
            source = Path(scratch) / "openmp.c"
            source.write_text("#include <omp.h>\nint main(void) { return omp_get_thread_num(); }\n")
            try:
                self.compiler.compile([str(source)], output_dir=scratch, extra_postargs=[OPENMP])
            except CompileError:
                return False
        return True


setup(
    cmdclass={"build_ext": BuildKernels},
    ext_modules=[
        Extension(
            "k3stream.quant.kernels._ggml_cpu",
            [
                "src/k3stream/quant/kernels/ggml_cpu.c",
                "src/k3stream/quant/kernels/steps_cpu.c",
                "src/k3stream/quant/kernels/iquants_cpu.c",
                "src/k3stream/quant/kernels/iquants_avx512.c",
                "src/k3stream/quant/kernels/tiles_cpu.c",
                "src/k3stream/quant/kernels/kquants_avx512.c",
                "src/k3stream/quant/kernels/f32_gemm.c",
            ],
            depends=["src/k3stream/quant/kernels/kernels.h"],
            # -fno-trapping-math: a loop computing both sides of a select (the activation's polynomials)
            # may vectorize; no result changes (nothing reassociates, no FP exception is ever read)
            extra_compile_args=["-O3", OPENMP, "-ffp-contract=off", "-fno-trapping-math", "-std=gnu11"],
            extra_link_args=[OPENMP],
            optional=True,
        )
    ],
)
