"""The fused kernels of the decode step (runtime/kernels/fused.py, gguf_moe_glu) against the torch ops they replace,
per op and for the whole CUDA-graph decode step. GPU only.

    python bench/bench_fused.py [MODEL] [--ctx 512] [--steps 64] [--repeat 20] [--json OUT]

Per op (Qwen3-30B-A3B shapes: D 2048, 32 query / 4 KV heads of 128, 128 experts of 768 with 8 used, Q4_K experts):
each side is captured in a CUDA graph of 50 calls and replayed (launch overhead out of the picture, as in a captured
step); median of --repeat replays; the table gives us per call and the kernels per call (torch profiler).
With MODEL: the decode step as a CUDA graph (model.decode after a prompt of --ctx tokens), with the layers on torch
ops (layers.TORCH_KERNELS) and on the fused kernels, and how far their logits are apart. Both loads keep
gguf_moe_glu and the fused MoE combine, which DeviceExperts uses in either case; the step of the commit before
the fused kernels (843d515) is profile_decode.py's graph_ms there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q
from gpu_timing import replay_seconds  # bench/gpu_timing.py
from torch.profiler import ProfilerActivity, profile

import moerun
from moeprep.gguf.reader import open_gguf
from moerun import backend, layers
from moerun.config import GATING_SOFTMAX
from moerun.kernels import fused
from moerun.kernels.gguf_matmul import QWeight, gguf_moe, gguf_moe_glu
from moerun.kernels.qtypes import BLOCK_TYPES
from moerun.kv_cache import KVCache
from moerun.models import arch_module
from moerun.options import RuntimeOptions
from moerun.step import Step

D, H, G, DH, E, K, I = 2048, 32, 4, 128, 128, 8, 768
CALLS = 50


def graph_us(fn: Callable[[], object], repeat: int) -> float:
    """Microseconds per call: CALLS calls in one CUDA graph, replayed; median over replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    return replay_seconds(graph, repeat) * 1e6 / CALLS


def kernels_per_call(fn: Callable[[], object]) -> int:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def rope_args(path: Path) -> moerun.config.ModelArgs:
    args = arch_module("qwen3moe", path).read_args(open_gguf(path))
    return dataclasses.replace(
        args, dim=D, n_heads=H, n_kv_heads=G, head_dim=DH, v_head_dim=DH, rope_dim=DH, rope_base=1e6
    )


def op_pairs(args, ctx: int, dev: str = "cuda") -> dict[str, tuple[Callable, Callable]]:
    """name -> (torch ops, fused), on fresh random inputs of the 30B decode shapes."""
    x, delta, w = torch.randn(1, D, device=dev), torch.randn(1, D, device=dev), torch.randn(D, device=dev)
    rope = layers.Rope(args, 4096, torch.device(dev))
    q, k, v = torch.randn(1, H, DH, device=dev), torch.randn(1, G, DH, device=dev), torch.randn(1, G, DH, device=dev)
    qn, kn = (layers.RMSNorm(torch.randn(DH, device=dev), 1e-6, layers.TORCH_KERNELS) for _ in range(2))
    pos = torch.tensor([ctx - 1], device=dev)
    step, cache = Step(pos, n_slots=ctx), KVCache(4096, G, DH, DH, torch.bfloat16, torch.device(dev))
    fused_kernels = backend.fused_kernels()
    cache_k, cache_v = (torch.randn(4096, G, DH, device=dev, dtype=torch.bfloat16) for _ in range(2))
    allowed = torch.arange(ctx, device=dev)[None, :] <= pos[:, None]
    logits = torch.randn(1, E, device=dev)
    router_args = dataclasses.replace(
        args, n_experts_used=K, gating=GATING_SOFTMAX, expert_weights_norm=True, expert_weights_scale=0.0
    )
    router = layers.Router(layers.Linear(torch.zeros(1, 1), None, "gate", None), router_args, layers.TORCH_KERNELS)
    gate_h, up_h = torch.randn(1, K, I, device=dev), torch.randn(1, K, I, device=dev)
    y, weights = torch.randn(1, K, D, device=dev), torch.rand(1, K, device=dev)
    slots = torch.randperm(E, device=dev)[:K][None]
    bt = BLOCK_TYPES[Q.Q4_K]
    gate_bank, up_bank = (
        QWeight(torch.randint(0, 256, (E, I, D // bt.values * bt.nbytes), dtype=torch.uint8, device=dev), Q.Q4_K, I, D)
        for _ in range(2)
    )
    t = layers.TORCH_KERNELS
    return {
        "rms_norm": (lambda: t.rms_norm(x, w, 1e-6), lambda: fused.rms_norm(x, w, 1e-6)),
        "residual add + rms_norm": (
            lambda: t.add_rms_norm(x, delta, w, 1e-6),
            lambda: fused.add_rms_norm_i8(x, delta, w, 1e-6),
        ),  # as a step runs it
        "q/k norm + rope + kv cache write": (
            lambda: t.norm_rope_store(q, k, v, qn, kn, rope, step, cache),
            lambda: fused_kernels.norm_rope_store(q, k, v, qn, kn, rope, step, cache),
        ),
        f"attention, {ctx} slots": (
            lambda: t.attend(q, cache_k[:ctx], cache_v[:ctx], allowed, 0.088),
            lambda: fused.attend_decode_i8(q, cache_k[:ctx], cache_v[:ctx], allowed, 0.088),
        ),
        "router softmax/top-k/normalize": (
            lambda: router.choose_general(logits),
            lambda: fused.route(logits, K, GATING_SOFTMAX, True, 0.0),
        ),
        "swiglu": (lambda: t.activations["swiglu"](gate_h, up_h), lambda: fused.swiglu(gate_h, up_h)),
        "experts gate + up + swiglu (Q4_K 2048x768, 8 of 128)": (
            lambda: layers.swiglu(gguf_moe(x, gate_bank, slots), gguf_moe(x, up_bank, slots)),
            lambda: gguf_moe_glu(x, gate_bank, up_bank, slots),
        ),
        "moe combine": (
            lambda: torch.einsum("tkd,tk->td", y, torch.where(slots >= 0, weights, 0.0)),
            lambda: fused.moe_combine(y, weights, slots),
        ),
    }


def bench_ops(pairs: dict[str, tuple[Callable, Callable]], repeat: int) -> list[dict]:
    rows = []
    for name, (ref, new) in pairs.items():
        row = {
            "op": name,
            "torch_us": graph_us(ref, repeat),
            "fused_us": graph_us(new, repeat),
            "torch_kernels": kernels_per_call(ref),
            "fused_kernels": kernels_per_call(new),
        }
        rows.append(row)
        print(
            f"| {name} | {row['torch_us']:.1f} | {row['torch_kernels']} | {row['fused_us']:.1f} | "
            f"{row['fused_kernels']} |",
            flush=True,
        )
    return rows


def bench_step(path: str, kernels: str, ctx: int, steps: int) -> tuple[dict, torch.Tensor]:
    """ms per CUDA-graph decode step with the layers on `kernels`, and the logits of the steps."""
    model = moerun.load_model(
        path, device="cuda", n_ctx=ctx + steps + 8, options=RuntimeOptions(fused=kernels == "fused")
    )
    prompt = torch.randint(1, model.args.n_vocab, (ctx,), generator=torch.Generator().manual_seed(0))
    model.forward(prompt, 0)
    tokens = torch.randint(1, model.args.n_vocab, (steps + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = [model.decode(tokens[0], ctx)]  # capture
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        logits.append(model.decode(tokens[i + 1], ctx + 1 + i))
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    out = torch.stack(logits).cpu()
    del model
    torch.cuda.empty_cache()
    return {"kernels": kernels, "graph_ms": ms, "tok_s": 1e3 / ms}, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    from moeprep.synth import write_synth_model

    tiny = write_synth_model(Path(tempfile.mkdtemp()) / "tiny.gguf", "qwen3moe")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| op (one decode token) | torch us | kernels | fused us | kernels |\n| --- | ---: | ---: | ---: | ---: |")
    args = rope_args(tiny)
    long = {name: pair for name, pair in op_pairs(args, 4096).items() if name.startswith("attention")}
    result = {"ops": bench_ops(op_pairs(args, a.ctx), a.repeat) + bench_ops(long, a.repeat)}
    if a.model:
        steps = {}
        for kernels in ("torch", "fused"):
            steps[kernels], logits = bench_step(a.model, kernels, a.ctx, a.steps)
            steps[kernels + "_logits"] = logits
        diff = (steps["fused_logits"] - steps["torch_logits"]).abs().max() / steps["torch_logits"].abs().max()
        same_top1 = (steps["fused_logits"].argmax(-1) == steps["torch_logits"].argmax(-1)).float().mean()
        result["step"] = {k: steps[k] for k in ("torch", "fused")}
        result["step"]["logits_max_rel_diff"] = float(diff)
        result["step"]["same_top1"] = float(same_top1)
        print(
            f"decode step (CUDA graph, {a.ctx}-token prompt, {a.steps} steps): torch ops "
            f"{steps['torch']['graph_ms']:.2f} ms ({steps['torch']['tok_s']:.1f} tok/s), fused "
            f"{steps['fused']['graph_ms']:.2f} ms ({steps['fused']['tok_s']:.1f} tok/s); logits max rel diff "
            f"{float(diff):.2e}, same top-1 {float(same_top1):.0%}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
