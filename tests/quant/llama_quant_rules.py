"""llama.cpp's quantizer rules asked directly, for any architecture, without writing a model file.

libllama exports (src/llama-ext.h) a mock model built from an architecture name and a few sizes
(llama_quant_model_from_metadata), the quantizer's own "may this tensor be requantized" check
(llama_quant_tensor_allows_quantization) and its type choice for a list of tensors (llama_quant_compute_types).
They are C++ symbols, so they are looked up by their mangled names. Tensors are ggml headers in a no-alloc context:
the rules read only names and shapes.
"""

from __future__ import annotations

import ctypes
import pathlib
from functools import lru_cache

import llama_cpp

from tests.oracle import _backend

GGML_TYPE_Q4_0, GGML_TYPE_Q8_0 = 2, 8
ALLOWS = "_Z38llama_quant_tensor_allows_quantizationPK19quantize_state_implPK11ggml_tensor"
COMPUTE_TYPES = "_Z25llama_quant_compute_typesP19quantize_state_impl11llama_ftypePP11ggml_tensorP9ggml_typem"
MODEL_FROM_METADATA = "_Z31llama_quant_model_from_metadataPK22llama_quant_model_desc"
INIT = "_Z16llama_quant_initPK11llama_modelPK27llama_model_quantize_params"
FREE = "_Z16llama_quant_freeP19quantize_state_impl"


class GGMLInitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class QuantModelDesc(ctypes.Structure):
    """struct llama_quant_model_desc (src/llama-ext.h)."""

    _fields_ = [("architecture", ctypes.c_char_p)] + [
        (f, ctypes.c_uint32)
        for f in ("n_embd", "n_ff", "n_layer", "n_head", "n_head_kv", "n_expert", "n_embd_head_k", "n_embd_head_v")
    ]


@lru_cache(maxsize=1)
def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    _backend()
    lib_dir = pathlib.Path(llama_cpp.__file__).parent / "lib"
    ggml, llama = ctypes.CDLL(str(lib_dir / "libggml-base.so")), ctypes.CDLL(str(lib_dir / "libllama.so"))
    ggml.ggml_init.argtypes, ggml.ggml_init.restype = [GGMLInitParams], ctypes.c_void_p
    ggml.ggml_free.argtypes, ggml.ggml_free.restype = [ctypes.c_void_p], None
    ggml.ggml_new_tensor.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    ggml.ggml_new_tensor.restype = ctypes.c_void_p
    ggml.ggml_set_name.argtypes, ggml.ggml_set_name.restype = [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p
    for name, args, res in (
        (MODEL_FROM_METADATA, [ctypes.POINTER(QuantModelDesc)], ctypes.c_void_p),
        (INIT, [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_void_p),
        (FREE, [ctypes.c_void_p], None),
        (ALLOWS, [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_bool),
        (
            COMPUTE_TYPES,
            [
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.POINTER(ctypes.c_int),
                ctypes.c_size_t,
            ],
            None,
        ),
    ):
        fn = getattr(llama, name)
        fn.argtypes, fn.restype = args, res
    return ggml, llama


def llama_quant_rules(arch: str, tensors: dict[str, tuple[int, ...]]) -> dict[str, int | None]:
    """For each tensor (name -> ggml shape, ne0 first): None where llama.cpp's quantizer would not requantize it,
    else the ggml type it picks when asked for Q4_0 (LLAMA_FTYPE_MOSTLY_Q4_0, not `pure`, no imatrix): Q4_0 for a
    tensor no rule singles out, since Q4_0's type mix changes only token_embd, output and, with exactly 8 experts
    (avoided here), attn_k/attn_v."""
    ggml, llama = _libs()
    desc = QuantModelDesc(arch.encode(), 256, 256, 4, 4, 4, 16, 64, 64)
    model = getattr(llama, MODEL_FROM_METADATA)(ctypes.byref(desc))
    assert model, f"llama.cpp has no model class for {arch!r}"
    params = llama_cpp.llama_model_quantize_default_params()
    qs = getattr(llama, INIT)(model, ctypes.byref(params))
    ctx = ggml.ggml_init(GGMLInitParams(1 << 24, None, True))
    try:
        handles = {}
        for name, shape in tensors.items():
            ne = (ctypes.c_int64 * len(shape))(*shape)
            t = ggml.ggml_new_tensor(ctx, 1, len(shape), ne)  # F16: a source type every rule accepts
            ggml.ggml_set_name(t, name.encode())
            handles[name] = t
        allowed = [name for name, t in handles.items() if getattr(llama, ALLOWS)(qs, t)]
        ptrs = (ctypes.c_void_p * max(1, len(allowed)))(*[handles[n] for n in allowed])
        types = (ctypes.c_int * max(1, len(allowed)))()
        if allowed:
            getattr(llama, COMPUTE_TYPES)(qs, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, ptrs, types, len(allowed))
        chosen = dict(zip(allowed, types))
        return {name: chosen.get(name) for name in tensors}
    finally:
        ggml.ggml_free(ctx)
        getattr(llama, FREE)(qs)
        llama_cpp.llama_model_free(model)
