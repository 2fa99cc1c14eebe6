"""Carry out a QuantPlan: stream the model into a new GGUF, requantizing the planned tensors through float32.

Copied tensors go file to file (the writer's copy_file_range); requantized ones are dequantized and quantized on a
thread pool one row group (or, on a GPU, one 2-D slice) per task, started ahead of the writer (Lookahead) so that the
quantizing overlaps the copying. Memory stays at the row groups in work plus LOOKAHEAD_BYTES of finished output,
whatever the model size. On `device="cuda"` a type the GPU quantizes (registry.quantizers_on) goes to it one whole
2-D slice at a time; every other type is quantized on the CPU.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType
from tqdm import tqdm

from moeprep import __version__
from moeprep.atomic import staged_outputs
from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel, TensorInfo, open_gguf
from moeprep.gguf.writer import KVValue, OutputTensor, copied_tensor, shard_path, write_gguf
from moeprep.quant.imatrix import ImportanceMatrix
from moeprep.quant.plan import QuantPlan, TensorPlan
from moeprep.quant.registry import quantize_rows, quantizers_on
from moeprep.quant.verify import VerifyReport, verify_model

QUANTIZATION_VERSION = 2  # ggml's current block layouts
# general.file_type when every quantized tensor ends up in one type (the "pure" file types of llama-quantize).
FILE_TYPES = {
    "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": LlamaFileType.MOSTLY_Q5_1,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_S,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_S,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K,
}
UNQUANTIZED = {"F32", "F16", "BF16"}
ROWS_PER_TASK = 256  # rows per thread task: big enough to vectorize, small enough to spread over threads
LOOKAHEAD_BYTES = 256 << 20  # quantized output submitted ahead of the writer: many layers of attention
DISK_MARGIN = 64 << 20


@dataclass
class QuantizeResult:
    paths: list[Path]
    plan: QuantPlan
    seconds: float  # writing, not verifying
    report: VerifyReport | None = None  # None: not verified

    @property
    def throughput(self) -> float:
        """MB of float32 requantized per second."""
        f32_bytes = sum(p.tensor.n_elements * 4 for p in self.plan.changed)
        return f32_bytes / 1e6 / self.seconds if self.seconds else 0.0


class Lookahead:
    """Requantizes the planned tensors on the thread pool in file order, ahead of the writer.

    While the writer copies the tensors in between (a layer's experts: most of the bytes), the pool is already
    quantizing the next layers' attention, so compute hides behind I/O instead of adding to it. At most `budget`
    bytes of output are submitted and not yet written; a task holds only its own rows as float32.
    """

    def __init__(
        self,
        model: GGUFModel,
        plans: list[TensorPlan],
        imatrix: ImportanceMatrix | None,
        pool: ThreadPoolExecutor,
        device: str,
        budget: int = LOOKAHEAD_BYTES,
    ) -> None:
        self.model, self.imatrix, self.pool, self.budget = model, imatrix, pool, budget
        self.on_device = set() if device == "cpu" else set(quantizers_on(device))
        self.device = device
        self._waiting: deque[TensorPlan] = deque(plans)  # not yet submitted, in file order
        self._submitted: dict[str, tuple[int, list[Future]]] = {}
        self._in_flight = 0  # output bytes submitted and not yet handed to the writer
        self._device_lock = threading.Lock()

    def output_tensor(self, plan: TensorPlan) -> OutputTensor:
        t = plan.tensor
        return OutputTensor(t.name, plan.new_type, t.shape, lambda: self._results(t.name))

    def _results(self, name: str) -> Iterator[np.ndarray]:
        self._submit_ahead(until=name)
        n_bytes, futures = self._submitted.pop(name)
        for future in futures:
            yield future.result()
        self._in_flight -= n_bytes
        self._submit_ahead()

    def _submit_ahead(self, until: str | None = None) -> None:
        """Submit tensors in order while the budget allows, and at least up to `until`."""
        while self._waiting:
            if self._in_flight >= self.budget and (until is None or until in self._submitted):
                return
            plan = self._waiting.popleft()
            self._submitted[plan.tensor.name] = (plan.new_bytes, self._submit(plan))
            self._in_flight += plan.new_bytes

    def _submit(self, plan: TensorPlan) -> list[Future]:
        """One task per 2-D slice (an expert of a 3-D tensor) for a device, per ROWS_PER_TASK rows on the CPU."""
        t = plan.tensor
        n_rows = t.shape[-2] if len(t.shape) > 1 else 1  # per 2-D slice
        weights = self.imatrix.for_tensor(t.name, t.row_length) if self.imatrix is not None else None
        device = self.device if plan.new_type in self.on_device else "cpu"
        step = n_rows if device != "cpu" else ROWS_PER_TASK
        futures = []
        # 3-D tensors (stacked over an expert axis) use one imatrix row per slice, as llama.cpp does.
        for i in range(t.n_elements // (n_rows * t.row_length)):
            w = None if weights is None else (weights[i] if weights.ndim == 2 else weights)
            futures += [
                self.pool.submit(
                    self._quantize, t, i * n_rows + r, i * n_rows + min(r + step, n_rows), plan.new_type, w, device
                )
                for r in range(0, n_rows, step)
            ]
        return futures

    def _quantize(
        self,
        t: TensorInfo,
        start: int,
        stop: int,
        new_type: GGMLQuantizationType,
        weights: np.ndarray | None,
        device: str,
    ) -> np.ndarray:
        """Rows start..stop of `t` (counted over all its slices) requantized to new_type."""
        rows = self.model.dequantize_rows(t, start, stop)
        if not np.isfinite(rows).all():
            raise MoeprepError(f"{self.model.path}: tensor {t.name} contains NaN or Inf; the source model is damaged")
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if device == "cpu":
            return quantize_rows(rows, new_type, weights)
        # One slice at a time on the device: it fills the GPU alone, and many threads launching its small kernels
        # at once only contend for the GIL (measured: 24 s instead of 19 s on the 30B-shaped file).
        with self._device_lock:
            return quantize_rows(rows, new_type, weights, device)


def output_kv(model: GGUFModel, plan: QuantPlan, imatrix: ImportanceMatrix | None) -> dict[str, KVValue]:
    """Keys quantize sets: quantization version, file type, imatrix provenance (as llama-quantize), our own."""
    kv = {
        "general.quantization_version": KVValue(QUANTIZATION_VERSION, GGUFValueType.UINT32),
        "moeprep.version": KVValue(__version__, GGUFValueType.STRING),
        "moeprep.attn_type": KVValue(plan.attn_type.name, GGUFValueType.STRING),
        "moeprep.type_rules": KVValue([r.text for r in plan.rules], GGUFValueType.ARRAY, GGUFValueType.STRING),
    }
    quantized = {
        p.new_type.name for p in plan.tensors if p.new_type.name not in UNQUANTIZED and len(p.tensor.shape) > 1
    }
    if len(quantized) == 1 and quantized <= FILE_TYPES.keys():
        kv["general.file_type"] = KVValue(int(FILE_TYPES[quantized.pop()]), GGUFValueType.UINT32)
    if imatrix is not None:  # strings and INT32 counts, as llama-quantize writes them
        kv.update(
            {
                key: KVValue(v, GGUFValueType.STRING if isinstance(v, str) else GGUFValueType.INT32)
                for key, v in imatrix.quantize_kv().items()
            }
        )
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


def quantize_model(
    model: GGUFModel,
    out: Path,
    plan: QuantPlan,
    *,
    imatrix: ImportanceMatrix | None = None,
    split_max_size: int | None = None,
    threads: int = 1,
    device: str = "cpu",
    progress: bool = True,
    verify: bool = True,
) -> QuantizeResult:
    """Write `model` with `plan` applied to `out` (shards when split_max_size is set), quantizing on `device`
    ("cpu" or "cuda": the same bytes).

    With `verify`, the output is checked against `model` (verify_model) before it is renamed into place, so `out`
    appears only verified; when the check fails nothing is written and result.paths is empty."""
    quantizers_on(device)  # no such device: fail before anything is written
    check_outputs(model, out, plan, split_max_size)
    start = time.perf_counter()
    report = None
    with staged_outputs(out) as stage:
        pool = ThreadPoolExecutor(max_workers=max(1, threads))
        try:
            with tqdm(total=plan.bytes_after, unit="B", unit_scale=True, desc="quantize", disable=not progress) as bar:
                lookahead = Lookahead(model, [p for p in plan.tensors if p.requantize], imatrix, pool, device)
                tensors = [
                    lookahead.output_tensor(p) if p.requantize else copied_tensor(model, p.tensor) for p in plan.tensors
                ]
                staged = write_gguf(
                    stage / out.name,
                    model,
                    tensors=tensors,
                    kv_set=output_kv(model, plan, imatrix),
                    split_max_size=split_max_size,
                    on_bytes=bar.update,
                )
        finally:
            pool.shutdown(cancel_futures=True)  # after an error or Ctrl-C, tasks not yet started never run
        seconds = time.perf_counter() - start
        if verify:
            report = verify_model(open_gguf(staged[0]), model, threads=threads, progress=progress)
            if not report.ok:
                for p in staged:  # a failed check: leave nothing behind to be mistaken for a good output
                    p.unlink()
    paths = [out.parent / p.name for p in staged] if report is None or report.ok else []
    return QuantizeResult(paths, plan, seconds, report)


def format_summary(result: QuantizeResult, out: Path) -> str:
    plan, report = result.plan, result.report
    fallbacks = [p for p in plan.tensors if p.fell_back_from is not None]
    lines = [
        f"wrote {', '.join(str(p) for p in result.paths)}"
        if result.paths
        else f"{out} was not written (it does not verify against the input)",
        f"tensors requantized: {len(plan.changed)} of {len(plan.tensors)} "
        f"({', '.join(sorted({f'{p.tensor.type_name}->{p.new_type.name}' for p in plan.changed})) or 'none'})",
        f"bytes: {plan.bytes_before} -> {plan.bytes_after} ({plan.bytes_after / plan.bytes_before:.1%})",
        f"time: {result.seconds:.1f} s, {result.throughput:.1f} MB/s of float32 requantized",
    ]
    if fallbacks:
        lines.append(
            f"fallbacks ({len(fallbacks)}): "
            + "; ".join(f"{p.tensor.name} {p.reason.split(': ', 1)[1]}" for p in fallbacks)
        )
    lines.append("verify: skipped (--no-verify)" if report is None else f"verify: {report.summary()}")
    return "\n".join(lines)
