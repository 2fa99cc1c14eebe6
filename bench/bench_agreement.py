"""How often moerun and llama.cpp agree on quantized synthetic models, and how often moerun agrees with itself.

    python bench/bench_agreement.py [--archs qwen3moe,deepseek2] [--types Q8_0,Q4_K,Q6_K] [--seeds 3]

For each architecture and weight type (the "small" synthetic preset, 256 positions of the calibration text, CPU
float32) it prints top-1 and expert-choice agreement with llama.cpp end to end and layer by layer (each of our layers
fed llama.cpp's input for it; tests/runtime/test_models.py), the worst layer's relative output error, and the
chaos floor: moerun against itself with a 1e-6 relative jitter on every matmul input, once per seed. A model whose
own floor is below 99% cannot meet a 99% end-to-end bar against any implementation that is not bit-identical.
The llama.cpp columns count, like the tests, only the positions no routing near-tie decides in our own run
(tests/near_ties.py: about 4% are left out); the self-jitter columns count every position.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

import moerun
from moeprep.synth import write_synth_model
from moeprep.synth.corpus import CALIBRATION_PATH
from moerun.layers import GGUFExperts
from tests.runtime.test_models import N_POSITIONS, compare

ROUNDING_ATTRS = ("round_input", "round_q", "round_out", "round_latent")


def jitter_roundings(model: moerun.Model, seed: int, rel: float = 1e-6) -> None:
    """Multiply every matmul input by (1 + rel * N(0, 1)) just before its llama.cpp-style rounding."""
    g = torch.Generator().manual_seed(seed)

    def wrap(rounding):
        return lambda x: rounding(x * (1 + rel * torch.randn(x.shape, generator=g)))

    for module in model.net.modules():
        holders = [module] + ([module.gate, module.up, module.down] if isinstance(module, GGUFExperts) else [])
        for holder in holders:
            for attr in ROUNDING_ATTRS:
                if getattr(holder, attr, None) is not None:
                    setattr(holder, attr, wrap(getattr(holder, attr)))


def run(path: Path, tokens: list[int], seed: int | None) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    model = moerun.load_model(path)
    if seed is not None:
        jitter_roundings(model, seed)
    experts: dict[int, np.ndarray] = {}
    model.add_routing_hook(lambda ev: experts.__setitem__(ev.layer, ev.expert_ids.numpy()))
    return model.forward(torch.tensor(tokens)).numpy(), experts


def agreement(a: tuple[np.ndarray, dict], b: tuple[np.ndarray, dict]) -> tuple[float, float]:
    top1 = float((a[0].argmax(-1) == b[0].argmax(-1)).mean())
    experts = float(np.mean([set(x) == set(y) for layer in a[1] for x, y in zip(a[1][layer], b[1][layer])]))
    return top1, experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="qwen3moe,qwen2moe,olmoe,llama,gpt-oss,deepseek2,glm4moe")
    ap.add_argument("--types", default="Q8_0,Q4_K,Q6_K")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    text = CALIBRATION_PATH.read_text(encoding="utf-8")
    print(
        "| arch | type | end to end top-1 / experts % | layer by layer top-1 / experts % | worst layer error "
        "| self-jitter top-1 % | self-jitter experts % |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            for qtype in args.types.split(","):
                path = write_synth_model(
                    Path(tmp) / f"{arch}-{qtype}.gguf", arch, preset="small", expert_type=qtype, attn_type=qtype
                )
                c = compare(path, text)
                tokens = moerun.load_model(path).tokenizer.encode(text)[:N_POSITIONS]
                plain = run(path, tokens, None)
                floors = np.array([agreement(plain, run(path, tokens, seed)) for seed in range(1, args.seeds + 1)])
                span = lambda v: f"{100 * v.min():.2f}-{100 * v.max():.2f}"  # noqa: E731
                print(
                    f"| {arch} | {qtype} | {100 * c.top1_agreement:.2f} / {100 * c.expert_agreement:.2f} "
                    f"| {100 * c.forced.top1_agreement:.2f} / {100 * c.forced.expert_agreement:.2f} "
                    f"| {max(c.layer_errors):.1e} | {span(floors[:, 0])} | {span(floors[:, 1])} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
