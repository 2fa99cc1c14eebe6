"""Training loss curve of the bench model: train and held-out cross-entropy against step, from train-log.jsonl.

python -m bench.train_moe.plot LOG.jsonl [--compare OTHER.jsonl --compare-label TEXT] [-o bench/train_moe/loss.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_log(path: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """-> (step, train loss) and (step, held-out loss) pairs."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    heldout = [(r["step"] + 1, r["heldout_loss"]) for r in records if "heldout_loss" in r]
    return train, heldout


def plot(log: Path, out: Path, compare: Path | None, compare_label: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=90)
    runs = [(log, "-", "")] + ([(compare, ":", f" ({compare_label})")] if compare else [])
    for path, style, suffix in runs:
        train, heldout = read_log(path)
        ax.plot(*zip(*train), style, color="tab:blue", lw=1, label=f"train{suffix}")
        ax.plot(*zip(*heldout), style, color="tab:red", marker="o", ms=3, lw=1, label=f"held-out{suffix}")
    ax.set_xlabel("step (64 x 512 tokens)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0.8, 5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("bench qwen3moe (22M params, 32 experts, top-4)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", type=Path)
    p.add_argument("--compare", type=Path)
    p.add_argument("--compare-label", default="earlier run")
    p.add_argument("-o", "--out", type=Path, default=Path(__file__).resolve().parent / "loss.png")
    a = p.parse_args()
    plot(a.log, a.out, a.compare, a.compare_label)


if __name__ == "__main__":
    main()
