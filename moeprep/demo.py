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
    q4 = folder / "demo-qwen3moe-attn-q4k.gguf"
    return [
        ("Write a small synthetic Qwen3-MoE model (skewed routing, byte-level BPE tokenizer)",
         ["moeprep", "synth", str(model), "--arch", "qwen3moe", "--preset", "small", "--skew", "0.5"]),
        ("Inspect it: layers, experts, bytes per tensor role, and expert-cache slots on two 24 GB GPUs",
         ["moeprep", "inspect", str(model), "--vram", "24G,24G"]),
        ("Plan the requantization: attention to Q4_K, experts copied byte for byte",
         ["moeprep", "quantize", str(model), str(q4), "--attn", "Q4_K", "--dry-run"]),
        ("Requantize; the result is verified against the source at the end",
         ["moeprep", "quantize", str(model), str(q4), "--attn", "Q4_K"]),
        ("Generate with moeprep's own runtime on the requantized model",
         ["moerun", "-m", str(q4), "-p", "The expert cache", "-n", "16", "--seed", "0"]),
    ]


def run_demo(folder: Path) -> None:
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
