"""`moeprep verify OUT --against IN`: prove a requantized model kept what it must keep.

Checks: the same tensors in the same order; every tensor whose type did not change is byte-identical (sha256,
streamed); every requantized tensor dequantizes close to the source (relative RMS error under its type's bound);
every source key is kept with its value and order, except the keys quantize itself sets.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from moeprep.gguf.reader import GGUFModel, TensorInfo
from moeprep.gguf.writer import COPY_CHUNK

# Keys quantize sets or replaces; everything else must survive unchanged.
CHANGED_KEY_PREFIXES = ("general.file_type", "general.quantization_version", "quantize.", "moeprep.", "split.")
# Largest relative RMS error (||deq(out) - src|| / ||src||) accepted per target type. ggml's quantizers land well
# under these on weight-like data (Q4_K about 0.09 on Gaussian rows); a bound breached means a broken tensor.
MAX_RELATIVE_ERROR = {
    "F32": 0.0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 0.01, "Q6_K": 0.04, "Q5_K": 0.07, "Q5_0": 0.07, "Q5_1": 0.07,
    "Q4_K": 0.14, "Q4_0": 0.16, "Q4_1": 0.14,
}


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


def tensor_sha256(model: GGUFModel, t: TensorInfo) -> str:
    h = hashlib.sha256()
    for chunk in model.iter_bytes(t, COPY_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def relative_error(out: GGUFModel, t_out: TensorInfo, src: GGUFModel, t_src: TensorInfo) -> float:
    a = out.dequantize(t_out).astype(np.float64)
    b = src.dequantize(t_src).astype(np.float64)
    norm = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / norm) if norm else float(np.linalg.norm(a))


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


def verify_model(out: GGUFModel, src: GGUFModel) -> VerifyReport:
    report = VerifyReport()
    _check_metadata(out, src, report)
    if [t.name for t in out.tensors] != [t.name for t in src.tensors]:
        report.problems.append("tensor names or order differ")
        return report
    for t_out, t_src in zip(out.tensors, src.tensors):
        if t_out.shape != t_src.shape:
            report.problems.append(f"{t_out.name}: shape {t_out.shape} != {t_src.shape}")
        elif t_out.ggml_type == t_src.ggml_type:
            if tensor_sha256(out, t_out) == tensor_sha256(src, t_src):
                report.identical += 1
            else:
                report.problems.append(f"{t_out.name}: bytes differ")
        else:
            err = relative_error(out, t_out, src, t_src)
            report.worst_error[t_out.name] = err
            bound = MAX_RELATIVE_ERROR.get(t_out.type_name, 0.2)
            if err <= bound:
                report.requantized += 1
            else:
                report.problems.append(f"{t_out.name}: relative error {err:.4f} > {bound} for {t_out.type_name}")
    return report
