"""The ops of one decode step, per layer: what a captured CUDA-graph step launches, kernel by kernel.

    python bench/count_decode_ops.py [MODEL] [--device cuda] [--kernels torch|fused] [--ctx 64] [--json OUT]

Logs every aten op that runs a kernel (views and allocations launch none) through a TorchDispatchMode, and every
Triton launch, for one eager decode step (one token after a prompt of --ctx tokens); prints the ops of one layer in
order, the count per layer and the count outside the layers (embedding, final norm, head). With --device cuda it also
counts the CUDA kernels torch's profiler sees in the same step (cuBLAS and copies included), the number a graph
replays.

Without MODEL it writes a small synthetic qwen3moe (Q4_K experts, Q8_0 attention). On a machine without a GPU,
`--device cpu --as-gpu` runs the GPU path's code on the CPU (GGUF blocks through Triton's interpreter, bfloat16
activations, the fused kernels unless --kernels torch), so the op list is the GPU's; plain `--device cpu` counts
the CPU path's (its fused kernels are numba's, kernels/cpu/fused.py: they launch no aten op). E.g.

    TRITON_INTERPRET=1 python bench/count_decode_ops.py --device cpu --as-gpu --kernels torch
    TRITON_INTERPRET=1 python bench/count_decode_ops.py --device cpu --as-gpu --kernels fused
    python bench/count_decode_ops.py /tmp/bench-qwen3-30b-a3b.gguf --device cuda --kernels fused   # GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

if "--as-gpu" in sys.argv:  # Triton reads the variable when it decorates a kernel: before anything imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moerun
from moerun.options import RuntimeOptions

# aten ops that allocate: they launch no kernel.
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh"}


class OpLog(TorchDispatchMode):
    """Records aten ops that launch kernels, and markers, in order. An op whose result lies in its first input's
    storage without writing it (a view, a reshape, a .to() to the same dtype) launches nothing and is left out."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self.paused = False  # inside a Triton launch (the interpreter's own tensor work is not the step's)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.paused and name not in ALLOCATIONS and not _aliases_input(name, args, out):
            self.events.append(f"aten.{name}")
        return out


def _aliases_input(name: str, args, out) -> bool:
    outs = out if isinstance(out, (list, tuple)) else [out]
    if name.endswith("_") or not args or not isinstance(args[0], torch.Tensor) or not outs:
        return False
    storage = args[0].untyped_storage().data_ptr()
    return all(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() == storage for o in outs)


def log_triton_launches(log: OpLog) -> None:
    """Every Triton kernel launch (compiled or interpreted) appends `triton.<kernel name>` to the log."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    for cls in (jit.JITFunction, interpreter.InterpretedFunction):
        run = cls.run

        def logged(self, *args, _run=run, **kwargs):
            if not kwargs.get("warmup") and not log.paused:
                fn = getattr(self, "fn", None)
                log.events.append(f"triton.{getattr(fn, '__name__', type(self).__name__)}")
            paused, log.paused = log.paused, True
            try:
                return _run(self, *args, **kwargs)
            finally:
                log.paused = paused

        cls.run = logged


def mark_blocks(net: torch.nn.Module, log: OpLog) -> None:
    """Block i's ops sit between markers `[block i` and `]`."""
    for i, block in enumerate(net.blocks):
        forward = block.forward

        def marked(*args, _forward=forward, _i=i, **kwargs):
            log.events.append(f"[block {_i}")
            out = _forward(*args, **kwargs)
            log.events.append("]")
            return out

        block.forward = marked


def emulate_gpu_path() -> None:
    """Build the CUDA path's modules on the CPU: QuantLinear and DeviceExperts on the GGUF bytes (their kernels run
    in Triton's interpreter). Patches the two device checks of model building, nothing else; load with
    RuntimeOptions(triton_on_cpu=True) for the GPU's fused kernels too."""
    from moerun.backend import Backend
    from moerun.kernels.gguf_matmul import QWeight, supports
    from moerun.layers.gguf_gpu import DeviceExperts
    from moerun.weights import Weights, device_bytes

    def blocks(self, name):
        info = self.info(name)
        if len(info.shape) != 2 or not supports(info.ggml_type):
            return None
        rows, cols = info.shape
        return QWeight(
            device_bytes(self.gguf.raw(info).reshape(rows, -1), self.device).clone(), info.ggml_type, rows, cols
        )

    Weights.blocks = blocks
    Backend.experts = lambda self, w, hooks, layer, activation: DeviceExperts.load(
        w, hooks, layer, activation, self.kernels
    )


def split_layers(events: list[str]) -> tuple[list[list[str]], list[str]]:
    """(ops of each block, ops outside the blocks)."""
    blocks, outside, current = [], [], None
    for e in events:
        if e.startswith("[block"):
            current = []
        elif e == "]":
            blocks.append(current)
            current = None
        else:
            (outside if current is None else current).append(e)
    return blocks, outside


def cuda_kernels(model, token: int, pos: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.forward(torch.tensor([token]), pos)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--as-gpu", action="store_true", help="on the CPU: the GPU path's modules and kernels")
    ap.add_argument("--kernels", choices=("torch", "fused"), default="fused")
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    path = args.model
    if path is None:
        from moeprep.synth import write_synth_model

        path = write_synth_model(
            Path(tempfile.mkdtemp()) / "qwen3moe.gguf", "qwen3moe", expert_type="Q4_K", attn_type="Q8_0"
        )
    gpu_like = args.device == "cuda" or args.as_gpu
    if args.as_gpu:
        emulate_gpu_path()
    # the GPU's Triton kernels (in the interpreter on the CPU), or numba's; or torch's alone
    options = RuntimeOptions(fused=args.kernels == "fused", triton_on_cpu=gpu_like)
    model = moerun.load_model(
        path, device=args.device, dtype=torch.bfloat16 if gpu_like else None, n_ctx=args.ctx + 8, options=options
    )
    model.forward(torch.randint(1, model.args.n_vocab, (args.ctx,)), 0)
    log = OpLog()
    log_triton_launches(log)
    mark_blocks(model.net, log)
    with log:
        model.forward(torch.tensor([1]), args.ctx)
    blocks, outside = split_layers(log.events)
    layer = blocks[len(blocks) // 2]
    result = {
        "model": str(path),
        "device": args.device,
        "as_gpu": args.as_gpu,
        "kernels": args.kernels,
        "layers": len(blocks),
        "ops_per_layer": [len(b) for b in blocks],
        "ops_outside_layers": len(outside),
        "layer_ops": layer,
        "outside_ops": outside,
    }
    print(
        f"{Path(path).name}: {len(blocks)} layers, kernels={args.kernels}, device={args.device}"
        f"{' (GPU path on the CPU)' if args.as_gpu else ''}"
    )
    print(
        f"ops per layer: {sorted(set(result['ops_per_layer']))}, outside the layers: {len(outside)}, "
        f"step total: {sum(result['ops_per_layer']) + len(outside)}"
    )
    print(f"layer {len(blocks) // 2}, in order:")
    for i, op in enumerate(layer, 1):
        print(f"  {i:3d} {op}")
    print("by op:", ", ".join(f"{op} x{n}" for op, n in Counter(layer).most_common()))
    if args.device == "cuda":
        kernels = cuda_kernels(model, 1, args.ctx + 1)
        result["cuda_kernels_per_step"] = len(kernels)
        result["cuda_kernel_names"] = Counter(kernels).most_common()
        print(
            f"CUDA kernels in one eager step (torch profiler): {len(kernels)} "
            f"({len(kernels) / max(len(blocks), 1):.1f} per layer)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
