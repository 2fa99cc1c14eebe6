"""`moeprep demo`: take a small synthetic MoE model through every capability, printing each command and its output.

Each step runs the real command line in a subprocess, exactly as a user would type it, so the demo doubles as a
smoke test of the installed package.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import click

from moeprep.errors import MoeprepError


def demo_steps(folder: Path) -> list[tuple[str, list[str]]]:
    """(what the step shows, the command) in order; paths inside `folder`."""
    model = folder / "demo-qwen3moe.gguf"
    calibration = Path(__file__).parent / "data" / "calibration.txt"
    imatrix, quantized = folder / "demo.imatrix.gguf", folder / "demo-qwen3moe-attnQ4K.gguf"
    profile, baked, upload = folder / "demo-attnQ4K.moeprof", folder / "demo-attnQ4K-baked.gguf", folder / "upload"
    trace = folder / "demo-qwen3-30b.trace.npz"
    calib = ["--dataset", str(calibration), "-c", "64", "--chunks", "6", "--holdout", "0.34"]
    return [
        (
            "Write a small synthetic Qwen3-MoE model (skewed routing, byte-level BPE tokenizer)",
            ["moeprep", "synth", str(model), "--arch", "qwen3moe", "--preset", "small", "--skew", "0.5"],
        ),
        (
            "Inspect it: layers, experts, bytes per tensor role, and expert-cache slots on two 24 GB GPUs",
            ["moeprep", "inspect", str(model), "--vram", "24G,24G"],
        ),
        (
            "Profile expert use on the shipped calibration text; the same pass writes llama.cpp's importance matrix",
            [
                "moeprep",
                "profile",
                str(model),
                *calib,
                "--imatrix-out",
                str(imatrix),
                "-o",
                str(folder / "demo-qwen3moe.moeprof"),
            ],
        ),
        (
            "Plan the requantization: attention to Q4_K, experts copied byte for byte",
            ["moeprep", "quantize", str(model), str(quantized), "--attn", "Q4_K", "--dry-run"],
        ),
        (
            "Requantize attention to Q4_K with that imatrix; the result is verified against the source",
            ["moeprep", "quantize", str(model), str(quantized), "--attn", "Q4_K", "--imatrix", str(imatrix)],
        ),
        (
            "Profile the quantized model: the profile to publish, judged on held-out text",
            ["moeprep", "profile", str(quantized), *calib, "-o", str(profile)],
        ),
        (
            "Bake the profile into the GGUF as moe_cache.expert_usage, an expert cache's warm start",
            ["moeprep", "profile", "bake", str(profile), str(quantized), str(baked)],
        ),
        (
            "Generate with moeprep's own runtime on the requantized model",
            ["moerun", "-m", str(baked), "-p", "The expert cache", "-n", "16", "--seed", "0"],
        ),
        (
            "moerun bench with the expert cache warmed by the profile: 6 slots per layer of 16 experts (the CPU stands "
            "in for the GPU here; on a GPU --vram-budget 24G sizes the slots), hit rate, uploads, where the time goes",
            [
                "moerun",
                "bench",
                "-m",
                str(baked),
                "--device",
                "cpu",
                "--vram-budget",
                "1560M",
                "--cache-slots",
                "6",
                "--expert-profile",
                str(profile),
                "-p",
                "32",
                "-n",
                "16",
                "-f",
                str(calibration),
            ],
        ),
        (
            "Generate a routing trace of a named regime (Qwen3-30B-A3B-like reuse) at the model's shape",
            [
                "moeprep",
                "routing",
                "generate",
                "--regime",
                "qwen3-30b",
                "--layers",
                "4",
                "--experts",
                "16",
                "--top-k",
                "4",
                "--tokens",
                "2048",
                "--chunk",
                "512",
                "-o",
                str(trace),
            ],
        ),
        (
            "Its skew, reuse and the hit rates of the cache policies at 10-50% of the experts cached",
            ["moeprep", "routing", "stats", str(trace)],
        ),
        (
            "moerun bench replaying that routing: the same expert cache, its plan and policy chosen for this routing",
            [
                "moerun",
                "bench",
                "-m",
                str(baked),
                "--device",
                "cpu",
                "--vram-budget",
                "1560M",
                "--cache-slots",
                "6",
                "--routing",
                str(trace),
                "-p",
                "32",
                "-n",
                "16",
            ],
        ),
        (
            "Write the upload folder: llama.cpp shards under the size limit, model card, profile, imatrix, SHA256SUMS",
            [
                "moeprep",
                "publish",
                str(baked),
                str(upload),
                "--base-model",
                "example/synthetic-qwen3moe",
                "--profile",
                str(profile),
                "--imatrix",
                str(imatrix),
                "--split-max-size",
                "16M",
            ],
        ),
        ("Check the folder before `hf upload USER/REPO` takes it", ["moeprep", "publish", "--check", str(upload)]),
    ]


def run_demo(folder: Path) -> None:
    if folder.exists() and any(folder.iterdir()):
        raise MoeprepError(f"{folder}: not empty; give the demo a new or empty folder")
    folder.mkdir(parents=True, exist_ok=True)
    for i, (title, argv) in enumerate(demo_steps(folder), 1):
        click.secho(f"\n== step {i}: {title}", bold=True)
        click.echo(f"$ {shlex.join(argv)}")
        start = time.perf_counter()
        runner = [sys.executable, "-m", "moerun"] if argv[0] == "moerun" else [sys.executable, "-m", "moeprep"]
        result = subprocess.run(runner + argv[1:], capture_output=True, text=True)
        click.echo(result.stdout.rstrip())
        if result.returncode != 0:
            click.echo(result.stderr.rstrip(), err=True)
            raise MoeprepError(f"demo step {i} ({argv[0]} {argv[1]}) failed with exit code {result.returncode}")
        click.secho(f"   ({time.perf_counter() - start:.1f} s)", dim=True)
    click.secho(f"\nDone. The demo's files are in {folder}", bold=True)
