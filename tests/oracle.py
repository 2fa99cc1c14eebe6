"""llama.cpp as the reference: tokenization, next-token logits and per-layer expert choices, via llama-cpp-python.

`llama_eval` runs tokens through llama.cpp's low-level API on the CPU and records, through the graph's eval
callback (llama_context_params.cb_eval), the int32 tensors `ffn_moe_topk-<layer>` that hold each token's chosen
experts. Their bytes are read with libggml's ggml_backend_tensor_get, row by row since the tensor is a view.
It also records each layer's output, the residual stream `l_out-<layer>` (`nemotron_h_block_out-<layer>` in
nemotron-h's graph, LAYER_OUT_PREFIXES; the next layer's input in step35's, NEXT_LAYER_IN), so a test can feed llama.cpp's own hidden states into our layers one at a
time. The KV cache is kept in F32 and flash attention is off, so the reference does
not round K/V to F16.

llama-cpp-python is a declared test dependency: importing this module without it fails, it does not skip.
"""

from __future__ import annotations

import ctypes
import pathlib
from dataclasses import dataclass
from functools import lru_cache

import llama_cpp
import numpy as np

from moeprep.gguf.reader import open_gguf

GGML_TYPE_F32 = 0
GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64
TOPK_PREFIX = b"ffn_moe_topk-"
LAYER_OUT_PREFIX = b"l_out-"
# Graphs whose residual stream after a layer has another name (nemotron-h's l_out is an FFN layer's output alone)
LAYER_OUT_PREFIXES = {"nemotron_h_moe": b"nemotron_h_block_out-"}
# Graphs that rename l_out when the next layer reads it: step35's layer i's output is attn_norm_in-(i + 1), the
# last layer's h_nextn (what its NextN blocks read); attn_norm_in-0 is the token embedding.
NEXT_LAYER_IN = {"step35": (b"attn_norm_in-", b"h_nextn")}


class GGMLTensor(ctypes.Structure):
    """The leading fields of struct ggml_tensor (ggml/include/ggml.h), enough to reach its shape and name."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


@lru_cache(maxsize=1)
def _ggml_base() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(pathlib.Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    return lib


@lru_cache(maxsize=1)
def _backend() -> None:
    llama_cpp.llama_log_set(_silence, ctypes.c_void_p())
    llama_cpp.llama_backend_init()


@llama_cpp.llama_log_callback
def _silence(level, text, user_data):
    pass


@dataclass
class OracleRun:
    logits: np.ndarray  # (T, V) float32
    topk: dict[int, np.ndarray]  # layer -> (T, K) int32 chosen experts, in llama.cpp's order
    layer_out: dict[int, np.ndarray]  # layer -> (T, D) float32 residual stream after the layer

    def experts(self, n_layers: int) -> np.ndarray:
        """(L, T, K) expert ids for the MoE layers; dense layers (absent) are -1."""
        T, K = next(iter(self.topk.values())).shape
        out = np.full((n_layers, T, K), -1, dtype=np.int64)
        for layer, ids in self.topk.items():
            out[layer] = ids
        return out


def llama_tokenize(path: str | pathlib.Path, text: str, add_bos: bool = True) -> list[int]:
    """Tokens of `text` by llama.cpp (special tokens not parsed), through the high-level Llama object."""
    _backend()
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return list(llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False))


def llama_eval(path: str | pathlib.Path, tokens: list[int], n_threads: int = 2) -> OracleRun:
    """Evaluate `tokens` as one sequence from position 0 in one batch: logits for every position, top-k per layer."""
    _backend()
    T = len(tokens)
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    # No repacked (AMX / interleaved) weight buffers: their kernels can raise SIGILL where the CPU advertises AMX
    # but the OS has not enabled it, and the plain CPU path is the reference anyway.
    mparams.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    assert model, f"llama.cpp could not load {path}"
    topk: dict[int, list[np.ndarray]] = {}
    layer_out: dict[int, np.ndarray] = {}
    arch = open_gguf(path).arch
    out_prefix = LAYER_OUT_PREFIXES.get(arch, LAYER_OUT_PREFIX)
    next_in, last_out = NEXT_LAYER_IN.get(arch, (None, None))

    def layer_of(name: bytes) -> int | None:
        """The layer whose output (the residual stream after it) tensor `name` is, if it is one; -1: the last."""
        if next_in is None:
            # only the tensor itself: not its views ("l_out-3 (reshaped)", kimi-k3's residual bank)
            suffix = name[len(out_prefix) :]
            return int(suffix) if name.startswith(out_prefix) and suffix.isdigit() else None
        if name == last_out:
            return -1
        following = int(name[len(next_in) :]) if name.startswith(next_in) else 0
        return following - 1 if following > 0 else None

    @llama_cpp.ggml_backend_sched_eval_callback
    def on_tensor(tensor_p, ask, user_data):
        t = GGMLTensor.from_address(tensor_p)
        wanted = t.name.startswith(TOPK_PREFIX) or (layer_of(t.name) is not None and t.type == GGML_TYPE_F32)
        if ask:  # the scheduler asks whether to stop after this tensor: only for the ones we read
            return wanted
        if not wanted:
            return True  # keep computing
        if t.name.startswith(TOPK_PREFIX):
            K, n_rows = t.ne[0], t.ne[1]
            rows = np.empty((n_rows, K), dtype=np.int32)
            for r in range(n_rows):  # a view into argsort's output: rows are nb[1] bytes apart
                _ggml_base().ggml_backend_tensor_get(tensor_p, rows[r].ctypes.data, r * t.nb[1], K * 4)
            topk.setdefault(int(t.name[len(TOPK_PREFIX) :]), []).append(rows)
        else:
            D, n_rows = t.ne[0], t.ne[1]
            assert t.nb[1] == D * 4, "l_out is a contiguous (T, D) float32 tensor"
            out = np.empty((n_rows, D), dtype=np.float32)
            _ggml_base().ggml_backend_tensor_get(tensor_p, out.ctypes.data, 0, out.nbytes)
            layer_out[layer_of(t.name)] = out
        return True

    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = max(256, -(-T // 256) * 256)
    cparams.n_batch = cparams.n_ubatch = cparams.n_ctx
    cparams.n_threads = cparams.n_threads_batch = n_threads
    cparams.type_k = cparams.type_v = GGML_TYPE_F32
    cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cparams.cb_eval = on_tensor
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    assert ctx, "llama.cpp could not create a context"
    batch = llama_cpp.llama_batch_init(T, 0, 1)
    try:
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = True
        batch.n_tokens = T
        assert llama_cpp.llama_decode(ctx, batch) == 0, "llama_decode failed"
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(T * n_vocab,)).reshape(T, n_vocab).copy()
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    if -1 in layer_out:  # the last layer's, named for no layer
        last = max(layer_out) + 1
        layer_out[last] = layer_out.pop(-1)
    return OracleRun(logits, {layer: np.concatenate(parts) for layer, parts in topk.items()}, layer_out)


def llama_quantize(
    path: str | pathlib.Path, out: str | pathlib.Path, attn_type: str = "Q4_K", threads: int = 2
) -> None:
    """llama.cpp's whole-file quantizer (llama_model_quantize, what llama-quantize runs) set up to do what
    `moeprep quantize --attn TYPE` does on a model whose experts already have that type: `pure` gives every 2-D
    weight the one type (routers and 1-D tensors stay as they are), so attention is requantized and the experts,
    already in it, are copied; token_embd and output keep their own types."""
    _backend()
    ftypes = {
        "Q4_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_S,
        "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
        "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
        "Q5_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_S,
    }
    types = {t.name: int(t.ggml_type) for t in open_gguf(path).tensors}
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread, params.ftype = threads, ftypes[attn_type]
    params.pure = params.allow_requantize = True
    params.token_embedding_type = types["token_embd.weight"]
    params.output_tensor_type = types.get("output.weight", types["token_embd.weight"])
    status = llama_cpp.llama_model_quantize(str(path).encode(), str(out).encode(), ctypes.byref(params))
    assert status == 0, f"llama_model_quantize failed on {path}"
