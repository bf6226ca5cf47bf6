"""Builds the optional C kernels (`k3stream.quant.kernels._ggml_cpu`); everything else is in pyproject.toml.

Without a C compiler the install still succeeds and the kernels fall back to the torch reference path.
"""

from setuptools import Extension, setup

setup(
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
            extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-std=gnu11"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
