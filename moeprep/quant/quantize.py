"""Carry out a QuantPlan: stream the model into a new GGUF, requantizing the planned tensors through float32.

Memory stays at about one requantized tensor (as float32) plus the copy chunk, whatever the model size: copied
tensors stream from the memory map, requantized ones are produced one expert slice or row group at a time.
On `device="cuda"` a type the GPU quantizes (registry.quantizers_on) goes to it one whole 2-D slice at a time;
every other type is spread over the thread pool as on the CPU.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, LlamaFileType
from tqdm import tqdm

from moeprep import __version__
from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moeprep.gguf.writer import KVValue, OutputTensor, copied_tensor, shard_path, write_gguf
from moeprep.quant.imatrix import ImportanceMatrix
from moeprep.quant.plan import QuantPlan, TensorPlan
from moeprep.quant.registry import quantize_rows, quantizers_on
from moeprep.quant.verify import VerifyReport

QUANTIZATION_VERSION = 2  # ggml's current block layouts
# general.file_type when every quantized tensor ends up in one type (the "pure" file types of llama-quantize).
FILE_TYPES = {
    "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1, "Q5_0": LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": LlamaFileType.MOSTLY_Q5_1, "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_K": LlamaFileType.MOSTLY_Q4_K_S,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_S, "Q6_K": LlamaFileType.MOSTLY_Q6_K,
}
UNQUANTIZED = {"F32", "F16", "BF16"}
ROWS_PER_TASK = 256  # rows per thread task: big enough to vectorize, small enough to spread over threads
DISK_MARGIN = 64 << 20


@dataclass
class QuantizeResult:
    paths: list[Path]
    plan: QuantPlan
    seconds: float

    @property
    def throughput(self) -> float:
        """MB of float32 requantized per second."""
        f32_bytes = sum(p.tensor.n_elements * 4 for p in self.plan.changed)
        return f32_bytes / 1e6 / self.seconds if self.seconds else 0.0


# (2-D float32 rows, the tensor's plan, imatrix row or None) -> the rows' bytes, in one or more pieces
SliceQuantizer = Callable[[np.ndarray, TensorPlan, np.ndarray | None], list[np.ndarray]]


def slice_quantizer(device: str, pool: ThreadPoolExecutor) -> SliceQuantizer:
    """How quantize_model quantizes a 2-D block of rows: a type `device` runs itself (other than "cpu") in one call,
    which chunks it to the device; any other type in thread tasks of ROWS_PER_TASK rows."""
    on_device = set() if device == "cpu" else set(quantizers_on(device))

    def quantize(source: np.ndarray, plan: TensorPlan, weights: np.ndarray | None) -> list[np.ndarray]:
        if plan.new_type in on_device:
            return [quantize_rows(source, plan.new_type, weights, device)]
        tasks = [pool.submit(quantize_rows, source[i : i + ROWS_PER_TASK], plan.new_type, weights)
                 for i in range(0, source.shape[0], ROWS_PER_TASK)]
        return [t.result() for t in tasks]

    return quantize


def requantized_tensor(model: GGUFModel, plan: TensorPlan, imatrix: ImportanceMatrix | None,
                       quantize_slice: SliceQuantizer) -> OutputTensor:
    """An output tensor whose bytes are `plan.tensor` dequantized to float32 and quantized to `plan.new_type`."""
    t = plan.tensor

    def chunks():
        data = model.dequantize(t)
        if not np.isfinite(data).all():
            raise MoeprepError(f"{model.path}: tensor {t.name} contains NaN or Inf; the source model is damaged")
        weights = imatrix.for_tensor(t.name, t.row_length) if imatrix is not None else None
        # 3-D tensors (stacked over an expert axis) use one imatrix row per slice, as llama.cpp does.
        slices = data.reshape(-1, *data.shape[-2:]) if data.ndim > 2 else data[None]
        for i, rows in enumerate(slices):
            w = None if weights is None else (weights[i] if weights.ndim == 2 else weights)
            yield from quantize_slice(np.ascontiguousarray(rows, dtype=np.float32), plan, w)

    return OutputTensor(t.name, plan.new_type, t.shape, chunks)


def output_kv(model: GGUFModel, plan: QuantPlan, imatrix: ImportanceMatrix | None) -> dict[str, KVValue]:
    """Keys quantize sets: quantization version, file type, imatrix provenance (as llama-quantize), our own."""
    kv = {
        "general.quantization_version": KVValue(QUANTIZATION_VERSION, GGUFValueType.UINT32),
        "moeprep.version": KVValue(__version__, GGUFValueType.STRING),
        "moeprep.attn_type": KVValue(plan.attn_type.name, GGUFValueType.STRING),
        "moeprep.type_rules": KVValue([r.text for r in plan.rules], GGUFValueType.ARRAY, GGUFValueType.STRING),
    }
    quantized = {p.new_type.name for p in plan.tensors if p.new_type.name not in UNQUANTIZED and len(p.tensor.shape) > 1}
    if len(quantized) == 1 and quantized <= FILE_TYPES.keys():
        kv["general.file_type"] = KVValue(int(FILE_TYPES[quantized.pop()]), GGUFValueType.UINT32)
    if imatrix is not None:  # strings and INT32 counts, as llama-quantize writes them
        kv.update({key: KVValue(v, GGUFValueType.STRING if isinstance(v, str) else GGUFValueType.INT32)
                   for key, v in imatrix.quantize_kv().items()})
    return kv


def check_outputs(model: GGUFModel, out: Path, plan: QuantPlan, split_max_size: int | None) -> None:
    """Refuse to write over the input and to start without the disk space to finish."""
    inputs = {p.resolve() for p in model.shard_paths}
    first = shard_path(out, 0, 2 if split_max_size else 1).resolve()
    if out.resolve() in inputs or first in inputs:
        raise MoeprepError(f"{out}: this is the input model; choose another output path")
    if not out.parent.is_dir():
        raise MoeprepError(f"{out.parent}: output folder does not exist")
    free = shutil.disk_usage(out.parent).free
    if free < plan.bytes_after + DISK_MARGIN:
        raise MoeprepError(f"{out.parent}: {free >> 20} MiB free, the output needs about {plan.bytes_after >> 20} MiB")


def quantize_model(model: GGUFModel, out: Path, plan: QuantPlan, *, imatrix: ImportanceMatrix | None = None,
                   split_max_size: int | None = None, threads: int = 1, device: str = "cpu",
                   progress: bool = True) -> QuantizeResult:
    """Write `model` with `plan` applied to `out` (shards when split_max_size is set), quantizing on `device`
    ("cpu" or "cuda": the same bytes)."""
    quantizers_on(device)  # no such device: fail before anything is written
    check_outputs(model, out, plan, split_max_size)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool, \
            tqdm(total=plan.bytes_after, unit="B", unit_scale=True, desc="quantize", disable=not progress) as bar:
        quantize_slice = slice_quantizer(device, pool)
        tensors = [requantized_tensor(model, p, imatrix, quantize_slice) if p.requantize
                   else copied_tensor(model, p.tensor)
                   for p in plan.tensors]
        paths = write_gguf(out, model, tensors=tensors, kv_set=output_kv(model, plan, imatrix),
                           split_max_size=split_max_size, on_bytes=bar.update)
    return QuantizeResult(paths, plan, time.perf_counter() - start)


def format_summary(result: QuantizeResult, report: VerifyReport | None) -> str:
    plan = result.plan
    fallbacks = [p for p in plan.tensors if p.fell_back_from is not None]
    lines = [
        f"wrote {', '.join(str(p) for p in result.paths)}",
        f"tensors requantized: {len(plan.changed)} of {len(plan.tensors)} "
        f"({', '.join(sorted({f'{p.tensor.type_name}->{p.new_type.name}' for p in plan.changed})) or 'none'})",
        f"bytes: {plan.bytes_before} -> {plan.bytes_after} ({plan.bytes_after / plan.bytes_before:.1%})",
        f"time: {result.seconds:.1f} s, {result.throughput:.1f} MB/s of float32 requantized",
    ]
    if fallbacks:
        lines.append(f"fallbacks ({len(fallbacks)}): " + "; ".join(f"{p.tensor.name} {p.reason.split(': ', 1)[1]}"
                                                               for p in fallbacks))
    lines.append("verify: skipped (--no-verify)" if report is None else f"verify: {report.summary()}")
    return "\n".join(lines)
