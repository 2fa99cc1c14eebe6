"""ggml's CPU dot products through libggml-cpu's public C API, for the CPU expert kernels (kernels/cpu/).

Where llama-cpp-python is installed (the `ggml` extra; the test extra has it too), its libggml-cpu is there, built
for the machine's CPU: `ggml_get_type_traits_cpu(type)` gives each GGUF type's row dot product (`vec_dot`: one
weight row of the type times one activation row in the type's `vec_dot_type`, Q8_K for the K-quants, Q8_0 for the
32-value types) and that type's quantizer (`from_float`). moerun calls both from its numba kernels through their
addresses (`vec_dot`, `from_float` below: one indirect call each, no Python), so a thread of moe_rows runs ggml's
SIMD dot (AVX2/AVX512-VNNI on x86, NEON on ARM) on each row of its work item. On a 2-core VM a Q4_K
row dot runs 19-21 GB/s per core there against 4-6 for moerun's own numba kernels (docs/BENCHMARKS.md), which stay
as the fallback and the reference. The activations are rounded as llama.cpp rounds them (by its own quantizer), so
the products are llama.cpp's.

`open_library(path)` loads it once per path and gives a `GgmlCPU`, the value the CPU kernels take (moe_rows'
`ggml`; None: moerun's numba kernels). The backend opens it from the runtime options: `MOERUN_GGML_CPU=0` turns it
off; `MOERUN_GGML_CPU_LIB=PATH` takes the libggml-cpu.so of a llama.cpp build instead (its build/bin, or an
install's lib: the same llama.cpp release line as the pinned llama-cpp-python, whose `ggml_type_traits_cpu` layout
this module reads), for machines where llama.cpp is built but llama-cpp-python is not installed.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from moeprep.errors import MoeprepError

# Activation formats whose rounding kernels/rounding.py reproduces bit for bit, so that a product through ggml is the one
# the numba kernels compute, up to the order of float32 sums. (Q8_1, Q4_1/Q5_1's, also carries each block's sum as an
# fp16, which moerun's rounding keeps exact: those types keep the numba kernels.)
ROUNDED_AS_MOERUN = {Q.Q8_K, Q.Q8_0, Q.F32, Q.F16, Q.BF16}


@dataclass(frozen=True)
class RowDot:
    """A GGUF type's row dot product in ggml: the function addresses, and the activation rows' block format."""

    dot: int  # vec_dot(n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by, int nrc)
    quantize: int  # from_float of the vec_dot_type: (const float *x, void *y, int64_t k)
    block_values: int  # of the vec_dot_type
    block_bytes: int

    def row_bytes(self, cols: int) -> int:
        """Bytes of one activation row of `cols` values in the vec_dot_type."""
        return cols // self.block_values * self.block_bytes


class _Traits(ctypes.Structure):  # struct ggml_type_traits_cpu (ggml-cpu.h)
    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


@dataclass(frozen=True, eq=False)
class GgmlCPU:
    """A loaded, initialised libggml-cpu: where it came from, and its row dots by GGUF type."""

    lib: ctypes.CDLL
    path: str
    named: bool  # named by the user (MOERUN_GGML_CPU_LIB), rather than llama-cpp-python's own

    def row_dot(self, qtype: Q) -> RowDot | None:
        """ggml's row dot for weights of `qtype`, or None (no single-row dot for the type, or one whose input
        rounding moerun does not reproduce)."""
        return _row_dot(self, qtype)


def open_library(named: str | None = None) -> GgmlCPU | None:
    """libggml-cpu at the path `named`, else the installed llama-cpp-python's, initialised, once per path; None where
    neither is there. A library named by the user that does not load is the user's error (named after its switch)."""
    return _open_library(named or None)


@functools.cache
def _open_library(named: str | None) -> GgmlCPU | None:
    if named:
        path = Path(named)
        if not path.is_file():
            raise MoeprepError(f"MOERUN_GGML_CPU_LIB={named}: no such file (give the path of a libggml-cpu.so)")
    else:
        try:
            import llama_cpp  # noqa: PLC0415 (optional: only its shared libraries are used)
        except (ImportError, OSError, RuntimeError):  # not installed, or its libraries do not load
            return None
        path = Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"
    try:
        lib = ctypes.CDLL(str(path))
        lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)
        lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
        lib.ggml_cpu_init.restype = None  # resolved here: a library without it fails now, not at the call
    except (OSError, AttributeError) as e:
        if named:
            raise MoeprepError(f"MOERUN_GGML_CPU_LIB={named}: not a libggml-cpu that loads here ({e})") from e
        return None
    lib.ggml_cpu_init()  # its fp16 tables, which the dot products read
    return GgmlCPU(lib, str(path), bool(named))


@functools.cache
def _row_dot(ggml: GgmlCPU, qtype: Q) -> RowDot | None:
    if qtype not in GGML_QUANT_SIZES:
        return None
    traits = ggml.lib.ggml_get_type_traits_cpu(int(qtype)).contents
    if not traits.vec_dot or traits.nrows != 1:
        return None
    act = Q(traits.vec_dot_type)
    quantize = ggml.lib.ggml_get_type_traits_cpu(int(act)).contents.from_float
    if not quantize or act not in ROUNDED_AS_MOERUN:
        return None
    block_values, block_bytes = GGML_QUANT_SIZES[act]
    return RowDot(traits.vec_dot, quantize, block_values, block_bytes)


def describe(ggml: GgmlCPU | None, turned_off: bool = False) -> str:
    """What `moerun bench` prints where the CPU computed experts: whose dot products it ran (`turned_off`: the user
    turned ggml's off)."""
    if ggml is not None:
        return f"CPU kernels: ggml's row dots (libggml-cpu from {ggml.path if ggml.named else 'llama-cpp-python'})"
    if turned_off:
        return "CPU kernels: moerun's numba kernels (MOERUN_GGML_CPU=0)"
    return "CPU kernels: moerun's numba kernels (pip install 'moeprep[ggml]' for ggml's, ~2.7x on the experts)"


def _as_int(builder, value, bits: int):
    width = value.type.width
    if width > bits:
        return builder.trunc(value, ir.IntType(bits))
    return builder.sext(value, ir.IntType(bits)) if width < bits else value


@intrinsic
def vec_dot(typingctx, fn, n, s, x, y):
    """*s = row x (the weight's type) . row y (its vec_dot_type), n values: ggml's vec_dot at address fn, from numba.
    Every argument an integer (the addresses of s, x and y)."""
    if not all(isinstance(a, types.Integer) for a in (fn, n, s, x, y)):
        return None

    def codegen(context, builder, signature, args):
        i32, i64, ptr = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i32, ptr, i64, ptr, i64, ptr, i64, i32])
        f, n_, s_, x_, y_ = args
        call = builder.inttoptr(_as_int(builder, f, 64), fnty.as_pointer())
        builder.call(
            call,
            [
                _as_int(builder, n_, 32),
                builder.inttoptr(_as_int(builder, s_, 64), ptr),
                i64(0),
                builder.inttoptr(_as_int(builder, x_, 64), ptr),
                i64(0),
                builder.inttoptr(_as_int(builder, y_, 64), ptr),
                i64(0),
                i32(1),
            ],
        )
        return context.get_dummy_value()

    return types.none(fn, n, s, x, y), codegen


@intrinsic
def from_float(typingctx, fn, x, y, k):
    """Quantize k float32 values at address x into blocks at address y: ggml's from_float at address fn."""
    if not all(isinstance(a, types.Integer) for a in (fn, x, y, k)):
        return None

    def codegen(context, builder, signature, args):
        i64, ptr = ir.IntType(64), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [ptr, ptr, i64])
        f, x_, y_, k_ = args
        call = builder.inttoptr(_as_int(builder, f, 64), fnty.as_pointer())
        builder.call(
            call,
            [
                builder.inttoptr(_as_int(builder, x_, 64), ptr),
                builder.inttoptr(_as_int(builder, y_, 64), ptr),
                _as_int(builder, k_, 64),
            ],
        )
        return context.get_dummy_value()

    return types.none(fn, x, y, k), codegen
