"""Train the bench model on the tokenized corpus (bench/train_moe/corpus.py) and save its weights in shards.

    python -m bench.train_moe.train --data bench/train_moe/work --out OUT [--steps N] [--config bench|tiny]

Everything random is seeded (weights, batch offsets), so a rerun on the same kind of GPU reproduces a model of the
same quality (not bit for bit: cuBLAS and SDPA kernels may sum in another order). Training is bf16 autocast with
float32 master weights, AdamW, linear warm-up then cosine decay to a tenth, gradient clipping at 1.0, and the
Switch/GShard load-balancing loss averaged over layers.

Writes to OUT: weights-NN.pt (state-dict shards under 15 MiB each: matrices fp16, norms and routers fp32),
train-log.jsonl (one line per logged step and per evaluation), config.json (model and training arguments).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.train_moe.model import CONFIGS, ModelArgs, Routing, Transformer

SHARD_BYTES = 15 << 20
MAX_EVAL_WINDOWS = 512  # the bench model's held-out text has about 250 windows of 512


@dataclass(frozen=True)
class TrainArgs:
    steps: int = 1600  # about 6 epochs: a first run of 2400 steps without dropout overfit after 1400
    batch_size: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    aux_coef: float = 0.003
    dropout: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    eval_every: int = 200
    log_every: int = 25
    max_minutes: float = 7.5  # safety stop on training time (0: none); a stopped run says so in its log


def lr_at(step: int, t: TrainArgs) -> float:
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    progress = (step - t.warmup) / max(1, t.steps - t.warmup)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def top_share(routings: list[Routing], n_experts: int) -> list[float]:
    """Per layer: share of the batch's selections taken by the most used 10% of experts."""
    n_top = max(1, round(n_experts / 10))
    out = []
    for r in routings:
        counts = torch.bincount(r.ids.flatten(), minlength=n_experts).float()
        out.append(float(counts.sort(descending=True).values[:n_top].sum() / counts.sum()))
    return out


def heldout_windows(ids: np.ndarray, context: int) -> torch.Tensor:
    """Non-overlapping windows of context+1 tokens. -> [N, context+1]"""
    n = (len(ids) - 1) // context
    return torch.stack(
        [torch.from_numpy(ids[i * context : i * context + context + 1].astype(np.int64)) for i in range(n)]
    )


@torch.no_grad()
def evaluate(model: Transformer, windows: torch.Tensor, batch_size: int, device: torch.device) -> float:
    """Mean next-token cross-entropy (nats) over every position of every window."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, _ = model(w[:, :-1])
        total += float(F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        count += w[:, 1:].numel()
    model.train()
    return total / count


def param_groups(model: Transformer, weight_decay: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def save_shards(model: Transformer, out: Path) -> list[Path]:
    """State dict in shards of at most SHARD_BYTES: norms and routers float32, other matrices float16."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, p in model.state_dict().items():
        keep_f32 = p.ndim == 1 or name.endswith("router")
        t = p.detach().to("cpu", torch.float32 if keep_f32 else torch.float16).contiguous()
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    paths = []
    for i, shard in enumerate(shards):
        paths.append(out / f"weights-{i:02d}.pt")
        torch.save(shard, paths[-1])
    return paths


def load_shards(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for p in sorted(folder.glob("weights-*.pt")):
        state.update(torch.load(p, map_location="cpu"))
    return state


def train(args: ModelArgs, t: TrainArgs, data: Path, out: Path, device: torch.device, compile_model: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"model": args.to_dict(), "train": asdict(t)}, indent=1))
    log = open(out / "train-log.jsonl", "w")

    def emit(record: dict) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()
        print(json.dumps(record), flush=True)

    torch.manual_seed(t.seed)
    train_ids = torch.from_numpy(np.load(data / "train.npy").astype(np.int64)).to(device)
    windows = heldout_windows(np.load(data / "heldout.npy"), args.context)
    model = Transformer(args, t.dropout)
    model.init_weights(t.seed)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    emit(
        {
            "event": "start",
            "params": n_params,
            "train_tokens": len(train_ids),
            "heldout_windows": len(windows),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        }
    )
    opt = torch.optim.AdamW(
        param_groups(model, t.weight_decay), lr=t.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda"
    )
    step_fn = torch.compile(model) if compile_model else model
    batches = torch.Generator(device=device).manual_seed(t.seed)
    offsets_max = len(train_ids) - args.context - 1
    arange = torch.arange(args.context + 1, device=device)
    train_seconds = 0.0  # excludes evaluations
    start = tick = time.perf_counter()
    stopped_early = False
    for step in range(t.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        offsets = torch.randint(0, offsets_max, (t.batch_size,), generator=batches, device=device)
        batch = train_ids[offsets[:, None] + arange]  # [B, S+1]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, routings = step_fn(batch[:, :-1])
        ce = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        aux = torch.stack([r.balance_loss(args.n_experts) for r in routings]).mean()
        loss = ce + t.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        last = step == t.steps - 1
        now = time.perf_counter()
        train_seconds += now - tick
        tick, elapsed = now, train_seconds
        if t.max_minutes and elapsed > t.max_minutes * 60 and not last:
            stopped_early = last = True
        if step % t.log_every == 0 or last:
            emit(
                {
                    "step": step,
                    "loss": float(ce.detach()),
                    "aux": float(aux.detach()),
                    "lr": lr_at(step, t),
                    "grad_norm": float(grad_norm),
                    "seconds": round(elapsed, 1),
                    "tokens_per_s": round((step + 1) * t.batch_size * args.context / max(elapsed, 1e-9)),
                    "top10_share": [round(s, 3) for s in top_share(routings, args.n_experts)],
                }
            )
        if (step + 1) % t.eval_every == 0 or last:
            emit(
                {
                    "step": step,
                    "heldout_loss": evaluate(model, windows[:MAX_EVAL_WINDOWS], t.batch_size, device),
                    "seconds": round(train_seconds, 1),
                }
            )
            tick = time.perf_counter()
        if last:
            break
    paths = save_shards(model, out)
    emit(
        {
            "event": "done",
            "steps": step + 1,
            "stopped_early": stopped_early,
            "train_seconds": round(train_seconds, 1),
            "wall_seconds": round(time.perf_counter() - start, 1),
            "shards": [p.name for p in paths],
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=Path(__file__).resolve().parent / "work")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--config", choices=sorted(CONFIGS), default="bench")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (GPU)")
    for f, default in asdict(TrainArgs()).items():
        p.add_argument(f"--{f.replace('_', '-')}", type=type(default), default=default)
    a = p.parse_args()
    t = TrainArgs(**{f: getattr(a, f) for f in asdict(TrainArgs())})
    train(CONFIGS[a.config], t, a.data, a.out, torch.device(a.device), a.compile)


if __name__ == "__main__":
    main()
