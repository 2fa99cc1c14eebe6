"""Every switch of the runtime, in one place: `RuntimeOptions`, read from the environment once per process
(`from_environment`) and passed down through the build (load_model -> BuildContext -> backend). Tests and benchmarks
make their own `RuntimeOptions(...)` instead of patching modules.

    MOERUN_FUSED=0          the layers run the torch reference ops instead of the fused kernels (Triton on a GPU,
                            numba on the CPU): to measure what the fusion buys
    MOERUN_GGML_CPU=0       the CPU experts and products run moerun's numba kernels, not ggml's row dots
    MOERUN_GGML_CPU_LIB=P   the libggml-cpu.so whose row dots the CPU kernels call (default: llama-cpp-python's)
    MOERUN_GEMV_INT8=0      the GPU matrix-vector kernel multiplies float32 activations, not int8-rounded ones
    MOERUN_GEMM_INT8=0      the GPU prompt GEMMs run in bfloat16, not on int8 tensor cores
    MOERUN_API_KEY=KEY      `moerun serve`'s --api-key default (read by the CLI, not here)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moerun.kernels.ggml_cpu import GgmlCPU
    from moerun.kernels.tuning import Int8Routes


@dataclass(frozen=True)
class RuntimeOptions:
    fused: bool = True  # MOERUN_FUSED
    ggml_cpu: bool = True  # MOERUN_GGML_CPU
    ggml_cpu_lib: str | None = None  # MOERUN_GGML_CPU_LIB
    gemv_int8: bool = True  # MOERUN_GEMV_INT8
    gemm_int8: bool = True  # MOERUN_GEMM_INT8
    # Devices on which the expert cache stages a prompt's repeated misses in VRAM and streams a decode step's misses
    # from page-locked RAM; a CPU standing in for a GPU gains nothing from either, and tests turn them on there.
    staging_devices: frozenset[str] = frozenset({"cuda"})
    stream_devices: frozenset[str] = frozenset({"cuda"})
    # The CPU runs the GPU's fused Triton kernels (in Triton's interpreter) instead of its numba ones: how the tests
    # check a whole model on the GPU's kernels without a GPU.
    triton_on_cpu: bool = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> RuntimeOptions:
        def on(name: str) -> bool:
            return environ.get(name, "1") != "0"

        return cls(
            fused=on("MOERUN_FUSED"),
            ggml_cpu=on("MOERUN_GGML_CPU"),
            ggml_cpu_lib=environ.get("MOERUN_GGML_CPU_LIB") or None,
            gemv_int8=on("MOERUN_GEMV_INT8"),
            gemm_int8=on("MOERUN_GEMM_INT8"),
        )

    def ggml_library(self) -> GgmlCPU | None:
        """The ggml library whose row dots the CPU kernels run: MOERUN_GGML_CPU_LIB's, else llama-cpp-python's;
        None where ggml_cpu is off or no library is there (moerun's numba kernels run)."""
        from moerun.kernels import ggml_cpu  # here, not at the top: `moerun --help` reads this module without numba

        return ggml_cpu.open_library(self.ggml_cpu_lib) if self.ggml_cpu else None

    def int8_routes(self) -> Int8Routes:
        """The 8-bit routes the GPU products take."""
        from moerun.kernels.tuning import Int8Routes

        return Int8Routes(gemv=self.gemv_int8, gemm=self.gemm_int8)


@functools.cache
def process_options() -> RuntimeOptions:
    """The options of this process's environment, read the first time they are asked for."""
    return RuntimeOptions.from_environment()
