"""`moeprep demo`: take a small synthetic MoE model through every capability, printing each command and its output.

Each step runs the real command line in a subprocess, exactly as a user would type it, so the demo doubles as a
smoke test of the installed package.
"""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import click

from moeprep.errors import MoeprepError

SERVER_START_S = 300  # the first start on a fresh install compiles the CPU kernels


@dataclass
class ServeStep:
    """A server started with `argv` (a free port added), sent `requests` (path, JSON body) as a client would, then
    stopped."""

    argv: list[str]
    requests: list[tuple[str, dict]]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def demo_steps(folder: Path) -> list[tuple[str, list[str] | ServeStep]]:
    """(what the step shows, the command or the server step) in order; paths inside `folder`."""
    model = folder / "demo-qwen3moe.gguf"
    calibration = Path(__file__).parent / "data" / "calibration.txt"
    imatrix, quantized = folder / "demo.imatrix.gguf", folder / "demo-qwen3moe-attnQ4K.gguf"
    profile, baked, upload = folder / "demo-attnQ4K.moeprof", folder / "demo-attnQ4K-baked.gguf", folder / "upload"
    trace = folder / "demo-qwen3-30b.trace.npz"
    calib = ["--dataset", str(calibration), "-c", "64", "--chunks", "6", "--holdout", "0.34"]
    return [
        (
            "Write a small synthetic Qwen3-MoE model (skewed routing, byte-level BPE tokenizer, a chat template with "
            "tool calls)",
            [
                "moeprep",
                "synth",
                str(model),
                "--arch",
                "qwen3moe",
                "--preset",
                "small",
                "--skew",
                "0.5",
                "--chat-template",
            ],
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
            "Serve it over the OpenAI API and send two requests as a client would: a chat turn, and a forced tool "
            "call (tool_choice required: a grammar makes the arguments valid JSON of the tool's schema; the synthetic "
            "model's words are random)",
            ServeStep(
                ["moerun", "serve", "-m", str(baked), "--device", "cpu", "-c", "512", "-np", "2"],
                [
                    (
                        "/v1/chat/completions",
                        {
                            "messages": [{"role": "user", "content": "What does an expert cache hold?"}],
                            "max_tokens": 12,
                        },
                    ),
                    (
                        "/v1/chat/completions",
                        {
                            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                            "tools": [WEATHER_TOOL],
                            "tool_choice": "required",
                            "max_tokens": 128,  # room for the call's longest form: its city at most 24 characters
                        },
                    ),
                ],
            ),
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
    for i, (title, step) in enumerate(demo_steps(folder), 1):
        click.secho(f"\n== step {i}: {title}", bold=True)
        start = time.perf_counter()
        if isinstance(step, ServeStep):
            run_serve_step(step, folder / "server.log", f"demo step {i}")
        else:
            click.echo(f"$ {shlex.join(step)}")
            result = subprocess.run(_runner(step[0]) + step[1:], capture_output=True, text=True)
            click.echo(result.stdout.rstrip())
            if result.returncode != 0:
                click.echo(result.stderr.rstrip(), err=True)
                raise MoeprepError(f"demo step {i} ({step[0]} {step[1]}) failed with exit code {result.returncode}")
        click.secho(f"   ({time.perf_counter() - start:.1f} s)", dim=True)
    click.secho(f"\nDone. The demo's files are in {folder}", bold=True)


def _runner(program: str) -> list[str]:
    """The installed package's command line, run by this Python (the console scripts may not be on PATH)."""
    return [sys.executable, "-m", "moerun" if program == "moerun" else "moeprep"]


def run_serve_step(step: ServeStep, log: Path, what: str) -> list[dict]:
    """Start the server on a free local port (its output to `log`), send the requests, print each answer's message,
    stop the server. -> the answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [*step.argv, "--port", str(port)]
    click.echo(f"$ {shlex.join(argv)} &")
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        server = subprocess.Popen(_runner(argv[0]) + argv[1:], stdout=out, stderr=subprocess.STDOUT)
    answers = []
    try:
        _wait_for_health(server, base, log, what)
        for path, body in step.requests:
            click.echo(f"$ curl {base}{path} -d '{json.dumps(body)}'")
            answers.append(_post(base + path, body, what))
            choice = answers[-1]["choices"][0]
            message = {k: v for k, v in choice["message"].items() if v is not None}
            click.echo(json.dumps({"message": message, "finish_reason": choice["finish_reason"]}, indent=1))
        return answers
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_for_health(server: subprocess.Popen, base: str, log: Path, what: str) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise MoeprepError(f"{what}: the server exited with code {server.returncode}: {' / '.join(tail)}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:  # not listening yet (urllib's errors are OSErrors)
            pass
        time.sleep(0.5)
    raise MoeprepError(f"{what}: the server did not answer /health within {SERVER_START_S} s (its log: {log})")


def _post(url: str, body: dict, what: str) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise MoeprepError(f"{what}: {url} answered {e.code}: {e.read().decode(errors='replace')[:300]}") from None
    except OSError as e:
        raise MoeprepError(f"{what}: {url}: {e}") from None
