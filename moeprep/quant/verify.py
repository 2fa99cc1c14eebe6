"""`moeprep verify OUT --against IN`: prove a requantized model kept what it must keep.

Checks: the same tensors in the same order; every tensor whose type did not change is byte-identical (both files
read and compared chunk by chunk: stronger than comparing hashes, and several times faster than hashing); every
requantized tensor dequantizes close to the source (relative RMS error under its type's bound, accumulated over row
groups); every source key is kept with its value and order, except the keys quantize itself sets. Tensors are
checked on a thread pool (file reads, comparisons and numpy release the GIL), with a progress bar over the bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from moeprep.gguf.reader import GGUFModel, TensorInfo

# Keys quantize sets or replaces; everything else must survive unchanged.
CHANGED_KEY_PREFIXES = ("general.file_type", "general.quantization_version", "quantize.", "moeprep.", "split.")
# Largest relative RMS error (||deq(out) - src|| / ||src||) accepted per target type. ggml's quantizers land well
# under these on weight-like data (Q4_K about 0.09 on Gaussian rows); a bound breached means a broken tensor.
MAX_RELATIVE_ERROR = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 8e-3,
    "Q8_0": 0.01,
    "Q6_K": 0.04,
    "Q5_K": 0.07,
    "Q5_0": 0.07,
    "Q5_1": 0.07,
    "Q4_K": 0.14,
    "Q4_0": 0.16,
    "Q4_1": 0.14,
}
COMPARE_CHUNK = 16 << 20  # bytes of each file read per comparison step
ERROR_ROWS = 1024  # rows dequantized (as float64) per step of the error sum


@dataclass
class VerifyReport:
    identical: int = 0
    requantized: int = 0
    worst_error: dict[str, float] = field(default_factory=dict)  # tensor name -> relative RMS error
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if not self.ok:
            return f"FAILED: {len(self.problems)} problem(s): " + "; ".join(self.problems[:5])
        worst = max(self.worst_error.items(), key=lambda kv: kv[1], default=None)
        tail = f", worst relative error {worst[1]:.4f} ({worst[0]})" if worst else ""
        return f"OK: {self.identical} tensors byte-identical, {self.requantized} requantized within bounds{tail}"


def same_bytes(out: GGUFModel, t_out: TensorInfo, src: GGUFModel, t_src: TensorInfo) -> bool:
    if t_out.n_bytes != t_src.n_bytes:
        return False
    return all(a == b for a, b in zip(out.iter_bytes(t_out, COMPARE_CHUNK), src.iter_bytes(t_src, COMPARE_CHUNK)))


def _row_groups(model: GGUFModel, t: TensorInfo) -> Iterator[np.ndarray]:
    """The tensor's values as float64 [rows, row_length], ERROR_ROWS rows at a time."""
    for r in range(0, t.n_elements // t.row_length, ERROR_ROWS):
        yield model.dequantize_rows(t, r, r + ERROR_ROWS).astype(np.float64)


def relative_error(out: GGUFModel, t_out: TensorInfo, src: GGUFModel, t_src: TensorInfo) -> float:
    """||deq(out) - src|| / ||src|| (||deq(out)|| when the source is all zeros)."""
    diff2 = src2 = out2 = 0.0
    for a, b in zip(_row_groups(out, t_out), _row_groups(src, t_src)):
        diff2 += float(np.square(a - b).sum())
        src2 += float(np.square(b).sum())
        out2 += float(np.square(a).sum())
    return float(np.sqrt(diff2 / src2)) if src2 else float(np.sqrt(out2))


def _kept_keys(kv: dict) -> dict:
    return {k: v for k, v in kv.items() if not k.startswith(CHANGED_KEY_PREFIXES)}


def _check_metadata(out: GGUFModel, src: GGUFModel, report: VerifyReport) -> None:
    src_kv, out_kv = _kept_keys(src.kv), _kept_keys(out.kv)
    for key, value in src_kv.items():
        if key not in out_kv:
            report.problems.append(f"key {key} missing")
        elif out_kv[key] != value:
            report.problems.append(f"key {key} changed")
    if [k for k in out_kv if k in src_kv] != list(src_kv):
        report.problems.append("metadata key order changed")


def _check_tensor(out: GGUFModel, t_out: TensorInfo, src: GGUFModel, t_src: TensorInfo) -> tuple[str, float | str]:
    """('identical', 0), ('requantized', error) or ('problem', text) for one pair of tensors."""
    if t_out.shape != t_src.shape:
        return "problem", f"{t_out.name}: shape {t_out.shape} != {t_src.shape}"
    if t_out.ggml_type == t_src.ggml_type:
        return ("identical", 0.0) if same_bytes(out, t_out, src, t_src) else ("problem", f"{t_out.name}: bytes differ")
    err = relative_error(out, t_out, src, t_src)
    bound = MAX_RELATIVE_ERROR.get(t_out.type_name, 0.2)
    if err > bound:
        return "problem", f"{t_out.name}: relative error {err:.4f} > {bound} for {t_out.type_name}"
    return "requantized", err


def verify_model(out: GGUFModel, src: GGUFModel, threads: int = 1, progress: bool = False) -> VerifyReport:
    """Check `out` against its source `src`, `threads` tensors at a time."""
    report = VerifyReport()
    _check_metadata(out, src, report)
    if [t.name for t in out.tensors] != [t.name for t in src.tensors]:
        report.problems.append("tensor names or order differ")
        return report
    pairs = list(zip(out.tensors, src.tensors))
    pool = ThreadPoolExecutor(max_workers=max(1, threads))
    try:
        with tqdm(
            total=sum(t.n_bytes for t in out.tensors), unit="B", unit_scale=True, desc="verify", disable=not progress
        ) as bar:

            def check(pair: tuple[TensorInfo, TensorInfo]) -> tuple[str, float | str]:
                result = _check_tensor(out, pair[0], src, pair[1])
                bar.update(pair[0].n_bytes)
                return result

            for (t_out, _), (kind, value) in zip(pairs, pool.map(check, pairs)):
                if kind == "identical":
                    report.identical += 1
                elif kind == "requantized":
                    report.requantized += 1
                    report.worst_error[t_out.name] = value
                else:
                    report.problems.append(value)
    finally:
        pool.shutdown(cancel_futures=True)  # after a Ctrl-C the checks not yet started never run
    return report
