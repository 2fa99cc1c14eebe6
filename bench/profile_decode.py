"""Where a decode step's time goes: host time per step eager and as a CUDA graph, and the GPU time of one eager step
by kind of work (attention, router, experts, dense products, norms and the rest), from torch's profiler.

    python bench/profile_decode.py MODEL [--device cuda] [--steps 32] [--ctx 512] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import moerun
from moerun.graphs import graph_blockers

# Module classes -> the kind of work their kernels are counted under; the rest (norms, embedding, head, residual
# adds) is "other". Kinds do not nest: a shared expert's FeedForward sits beside the routed experts, not inside.
KINDS = {
    "Attention": "attention",
    "MLAttention": "attention",
    "Router": "router",
    "GGUFExperts": "routed experts",
    "DeviceExperts": "routed experts",
    "CPUExperts": "routed experts",
    "FeedForward": "shared/dense FFN",
}


def label_modules(net: torch.nn.Module) -> None:
    """Run each counted module's forward inside a profiler range named after its kind."""
    for module in net.modules():
        kind = KINDS.get(type(module).__name__)
        if kind:
            module.forward = _labelled(module.forward, kind)


def _labelled(forward, kind: str):
    def run(*args, **kwargs):
        with record_function(kind):
            return forward(*args, **kwargs)

    return run


def timed_steps(model, token: int, start: int, steps: int, use_graph: bool) -> float:
    """Seconds per decode step, measured over `steps` steps after one warm-up."""
    step = model.decode if use_graph else (lambda t, p: model.forward(torch.tensor([t]), p)[0])
    step(token, start)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        step(token, start + 1 + i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def gpu_time_by_kind(model, token: int, pos: int) -> dict[str, float]:
    """GPU milliseconds of one eager decode step by kind of work (call after label_modules)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.forward(torch.tensor([token]), pos)
        torch.cuda.synchronize()
    events = prof.key_averages()
    totals = {e.key: e.device_time_total / 1e3 for e in events if e.key in KINDS.values()}
    all_kernels = sum(e.self_device_time_total for e in events) / 1e3
    totals["other"] = all_kernels - sum(totals.values())
    totals["all kernels"] = all_kernels
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--json")
    args = ap.parse_args()
    model = moerun.load_model(args.model, device=args.device, n_ctx=args.ctx + args.steps + 8)
    model.forward(torch.randint(1, model.args.n_vocab, (args.ctx,)), 0)
    result = {
        "eager_ms": 1e3 * timed_steps(model, 1, args.ctx, args.steps, use_graph=False),
        "graph_blockers": graph_blockers(model),
    }
    if not result["graph_blockers"]:
        result["graph_ms"] = 1e3 * timed_steps(model, 1, args.ctx, args.steps, use_graph=True)
    label_modules(model.net)
    result["gpu_ms_by_kind"] = gpu_time_by_kind(model, 1, args.ctx)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
