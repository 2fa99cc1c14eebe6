"""llama-imatrix's statistics, collected from llama.cpp itself: the reference for `--imatrix-out`.

llama-imatrix is a tool, not a library call, so this replays its collection rule through the graph's eval callback
(as tests/oracle.py records ffn_moe_topk): for every matrix product whose weight lives in a block, the sum over
input rows of x**2 per column and the number of rows; for an indirect product (MUL_MAT_ID, the experts) per expert,
a row counted for each expert the router sent it to. Dense products see whole batches (>= 16 rows), as there.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import llama_cpp
import numpy as np

from tests.oracle import GGML_TYPE_F32, GGMLTensor, _backend, _ggml_base

GGML_OP_SEARCH = 64  # enum ggml_op values tried by name (MUL_MAT sits near 30)


@lru_cache(maxsize=1)
def _mul_mat_ops() -> tuple[int, int]:
    """enum ggml_op values of MUL_MAT and MUL_MAT_ID, looked up by name in libggml (the enum moves between versions)."""
    lib = _ggml_base()
    lib.ggml_op_name.restype, lib.ggml_op_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
    names = {lib.ggml_op_name(op): op for op in range(GGML_OP_SEARCH)}
    return names[b"MUL_MAT"], names[b"MUL_MAT_ID"]


def _read(t_p: int, t: GGMLTensor, dtype: np.dtype) -> np.ndarray:
    """[ne3, ne2, ne1, ne0] values of a tensor that may be a view: one row (ne0 values) at a time."""
    out = np.empty((t.ne[3], t.ne[2], t.ne[1], t.ne[0]), dtype)
    row_bytes = t.ne[0] * out.itemsize
    for i3 in range(t.ne[3]):
        for i2 in range(t.ne[2]):
            for i1 in range(t.ne[1]):
                offset = i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3]
                _ggml_base().ggml_backend_tensor_get(t_p, out[i3, i2, i1].ctypes.data, offset, row_bytes)
    return out


def llama_imatrix(path: str | Path, chunks: np.ndarray, n_threads: int = 2) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """weight name -> (sum of x**2 [n_mat, P] float64, rows [n_mat]) over the chunks [C, T], each from position 0."""
    _backend()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    assert model, f"llama.cpp could not load {path}"
    stats: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    mul_mat, mul_mat_id = _mul_mat_ops()

    @llama_cpp.ggml_backend_sched_eval_callback
    def on_tensor(t_p, ask, user_data):  # noqa: ANN001 - ctypes callback
        t = GGMLTensor.from_address(t_p)
        if t.op not in (mul_mat, mul_mat_id):
            return not ask
        w = GGMLTensor.from_address(t.src[0])
        name = w.name.decode()
        src1 = GGMLTensor.from_address(t.src[1])
        if not name.startswith("blk.") or src1.type != GGML_TYPE_F32:
            return not ask
        if ask:
            return True
        x = _read(t.src[1], src1, np.float32).astype(np.float64)  # [ne3, ne2, ne1, P]
        if t.op == mul_mat_id:
            n_mat = w.ne[2]
            ids = _read(t.src[2], GGMLTensor.from_address(t.src[2]), np.int32)[0, 0]  # [tokens, K]
            sums, counts = stats.setdefault(name, (np.zeros((n_mat, x.shape[-1])), np.zeros(n_mat, np.int64)))
            for token, experts in enumerate(ids):
                for k, e in enumerate(experts):
                    sums[e] += x[0, token, k % x.shape[2]] ** 2
                    counts[e] += 1
        else:
            sums, counts = stats.setdefault(name, (np.zeros((1, x.shape[-1])), np.zeros(1, np.int64)))
            sums[0] += (x**2).reshape(-1, x.shape[-1]).sum(axis=0)
            counts[0] += x.size // x.shape[-1]
        return True

    n_ctx = chunks.shape[1]
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = n_ctx
    cparams.n_threads = cparams.n_threads_batch = n_threads
    cparams.type_k = cparams.type_v = GGML_TYPE_F32
    cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cparams.cb_eval = on_tensor
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)
    try:
        for chunk in chunks:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            for i, tok in enumerate(chunk.tolist()):
                # logits for every token, as llama-imatrix asks: with fewer, the last block computes fewer rows
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, True
                batch.seq_id[i][0] = 0
            batch.n_tokens = n_ctx
            assert llama_cpp.llama_decode(ctx, batch) == 0, "llama_decode failed"
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return stats
