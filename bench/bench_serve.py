"""Serving throughput and latency: 1, 4 and 8 concurrent streaming clients against `moerun serve`, and the same
client against llama.cpp's llama-server on the same file (--llama-server PATH starts one, --peer-url takes a
running one).

    python bench/bench_serve.py MODEL [--device cpu|cuda] [--streams 1,4,8] [--requests 2] [--rounds 1] [--prompt 64]
                                      [--gen 32] [-t THREADS] [--chat] [--ignore-eos] [--serve-args "--vram-budget 20G"]
                                      [--llama-server PATH [--peer-args "..."] | --peer-url URL] [--json OUT]
                                      [--trace FILE]
    python bench/bench_serve.py --url http://127.0.0.1:8080 ...        # a moerun serve already running

Ours: `moerun serve -m MODEL -np <most streams> -c <prompt + gen + 16> --device DEVICE` started on a free port, with
--serve-args appended. The peer: with --llama-server, `PATH -m MODEL -np <most streams> -c <streams x the same>
-ngl 999 (cuda) or 0 (cpu) [-t THREADS]` on a free port, --peer-args appended (llama-server's -c is the total over its
sequences); or start it yourself the same way and pass --peer-url.

Each level runs N clients at once, each sending --requests streamed /v1/completions requests one after another
(--chat: /v1/chat/completions, for models with a chat template), greedy, with a prompt of --prompt seeded random
token ids of its own (token-id prompts: no tokenizer or template differences between servers) and max_tokens
--gen (with --ignore-eos each answer runs to --gen tokens: the request's `ignore_eos`, which both servers take, as
serving benchmarks send it for random prompts; without it a random prompt's answer may end early, at a different
step in each stream, and the token counts differ between rounds). Measured on the client: time to first token
(request sent -> first text chunk), per-token latency (gaps between text chunks; both servers send one token per
chunk), and aggregate tok/s (completion tokens of all requests, from the servers' usage counts, over the level's
wall time, prefills included). Before each level, N
warm-up requests at once (prompts and max_tokens as measured, so the batch sizes met while requests finish come
too) let either server compile or capture what those batch sizes need (moerun: a CUDA graph per batch size).
A level's few seconds make one run's ratio of the most streams to the fewest move by a tenth or two on the GPU:
--rounds N runs the levels N times over, interleaved (1, 4, 8, 1, 4, 8, ...: a drift of the machine touches every
level alike) with fresh prompts each round (a prompt seen before would find its KV cached), and reports each level's
median and range and the ratio of the medians. The client needs aiohttp only (no openai package). With --trace FILE
ours runs through trace_serve.py, which times the engine's steps and the model passes inside the server and writes
where the time went to FILE when the server stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one_request(
    session: aiohttp.ClientSession, url: str, prompt: list[int], gen: int, chat: bool, extra: dict
) -> dict:
    body = {"max_tokens": gen, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **extra}
    if chat:  # token ids cannot be sent as a message: the ids' text instead, the same for both servers
        body["messages"] = [{"role": "user", "content": " ".join(map(str, prompt))}]
    else:
        body["prompt"] = prompt
    start = time.perf_counter()
    stamps: list[float] = []
    n_tokens = 0
    async with session.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter())
    return {
        "ttft": stamps[0] - start if stamps else float("nan"),
        "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
        "tokens": n_tokens or len(stamps),
    }


async def run_level(
    url: str, streams: int, requests: int, prompt_len: int, gen: int, vocab: int, chat: bool, extra: dict, seed: int
) -> dict:
    rng = random.Random(seed)
    prompts = [[[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(requests)] for _ in range(streams)]

    async def client(session: aiohttp.ClientSession, i: int) -> list[dict]:
        return [await one_request(session, url, p, gen, chat, extra) for p in prompts[i]]

    warm_up = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(streams)]
    # a new connection per request: llama-server closes idle keep-alive connections the pool would reuse
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), connector=connector) as session:
        await asyncio.gather(*(one_request(session, url, p, gen, chat, extra) for p in warm_up))
        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(client(session, i) for i in range(streams))) for r in rs]
        wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    return {
        "streams": streams,
        "requests": len(results),
        "tokens": sum(r["tokens"] for r in results),
        "wall_s": wall,
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "tpot_p50_ms": 1e3 * percentile(gaps, 50) if gaps else float("nan"),
        "tpot_p99_ms": 1e3 * percentile(gaps, 99) if gaps else float("nan"),
    }


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not become ready")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(name: str, cmd: list[str], port: int) -> tuple[subprocess.Popen, str]:
    log = tempfile.NamedTemporaryFile("w", prefix=f"{name}-", suffix=".log", delete=False)
    print(shlex.join(cmd), f"(log: {log.name})", file=sys.stderr)
    return subprocess.Popen(cmd, stdout=log, stderr=log), f"http://127.0.0.1:{port}"


def moerun_command(
    model: str,
    parallel: int,
    n_ctx: int,
    device: str,
    threads: int | None,
    extra: str,
    port: int,
    trace: str | None = None,
) -> list[str]:
    """`moerun serve` on the port; with `trace`, through trace_serve.py, which writes its summary there at the end."""
    start = (
        [sys.executable, str(Path(__file__).with_name("trace_serve.py")), "--summary", trace]
        if trace
        else [sys.executable, "-m", "moerun"]
    )
    return (
        start
        + ["serve", "-m", model, "-np", str(parallel), "-c", str(n_ctx), "--device", device, "--port", str(port)]
        + (["-t", str(threads)] if threads else [])
        + shlex.split(extra)
    )


def llama_server_command(
    binary: str, model: str, parallel: int, n_ctx: int, device: str, threads: int | None, extra: str, port: int
) -> list[str]:
    return (
        [
            binary,
            "-m",
            model,
            "-np",
            str(parallel),
            "-c",
            str(parallel * n_ctx),
            "--port",
            str(port),
            "-ngl",
            "999" if device.startswith("cuda") else "0",
        ]
        + (["-t", str(threads)] if threads else [])
        + shlex.split(extra)
    )


def report(name: str, row: dict) -> dict:
    print(
        f"{name:12s} streams {row['streams']}: {row['tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms "
        f"p99 {row['ttft_p99_ms']:.0f} ms, per token p50 {row['tpot_p50_ms']:.1f} ms "
        f"p99 {row['tpot_p99_ms']:.1f} ms",
        file=sys.stderr,
        flush=True,
    )
    return {"server": name, **row}


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="GGUF file to serve with moerun (or --url)")
    ap.add_argument("--url", help="a moerun serve already running")
    ap.add_argument("--peer-url", help="llama.cpp's llama-server, running on the same file")
    ap.add_argument("--llama-server", help="llama-server binary: start it on the same file as the peer")
    ap.add_argument("--serve-args", default="", help="more moerun serve options, e.g. '--vram-budget 20G'")
    ap.add_argument("--peer-args", default="", help="more llama-server options")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("-t", "--threads", type=int)
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--requests", type=int, default=2, help="requests per client at each level")
    ap.add_argument("--rounds", type=int, default=1, help="run the levels this many times over, interleaved")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=32, help="max_tokens")
    ap.add_argument("--vocab", type=int, default=2000, help="prompt token ids are drawn below this")
    ap.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (both servers take it): every answer "
        "runs to --gen tokens, none ends early on an end-of-generation token",
    )
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--trace", help="start ours through trace_serve.py: its steps' and passes' times go to this file")
    args = ap.parse_args()
    if not (args.model or args.url):
        ap.error("give MODEL or --url")
    if args.llama_server and (args.peer_url or not args.model):
        ap.error("--llama-server starts the peer on MODEL: give MODEL, and not --peer-url")
    if args.trace and args.url:
        ap.error("--trace starts ours: give MODEL, not --url")
    levels = [int(s) for s in args.streams.split(",")]
    n_ctx = args.prompt + args.gen + 16
    ours, peer = free_port(), free_port()
    # (name, the URL of a running server, or the command that starts one on its port), measured one after the other
    servers: list[tuple[str, str | tuple[list[str], int]]] = [
        (
            "moerun",
            args.url
            or (
                moerun_command(
                    args.model, max(levels), n_ctx, args.device, args.threads, args.serve_args, ours, args.trace
                ),
                ours,
            ),
        )
    ]
    if args.peer_url or args.llama_server:
        servers.append(
            (
                "llama-server",
                args.peer_url
                or (
                    llama_server_command(
                        args.llama_server,
                        args.model,
                        max(levels),
                        n_ctx,
                        args.device,
                        args.threads,
                        args.peer_args,
                        peer,
                    ),
                    peer,
                ),
            )
        )
    rows, extra = [], {"ignore_eos": True} if args.ignore_eos else {}
    for name, where in servers:
        proc, url = (None, where) if isinstance(where, str) else start_server(name, *where)
        try:
            wait_ready(url, proc)
            for round_ in range(args.rounds):
                for streams in levels:
                    row = asyncio.run(
                        run_level(
                            url,
                            streams,
                            args.requests,
                            args.prompt,
                            args.gen,
                            args.vocab,
                            args.chat,
                            extra,
                            seed=streams + 1000 * round_,
                        )
                    )
                    rows.append(report(name, {"round": round_, **row}))
        finally:
            if proc is not None:
                stop(proc)
    print(
        "| server | round | streams | requests | tokens | aggregate tok/s | TTFT p50 / p99 ms "
        "| per token p50 / p99 ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['server']} | {r['round'] + 1} | {r['streams']} | {r['requests']} | {r['tokens']} | "
            f"{r['tok_s']:.1f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} / "
            f"{r['tpot_p99_ms']:.1f} |"
        )
    medians = {}  # (server, streams) -> the median aggregate over the rounds
    for name in dict.fromkeys(r["server"] for r in rows):
        for streams in levels:
            runs = [r["tok_s"] for r in rows if r["server"] == name and r["streams"] == streams]
            medians[name, streams] = statistics.median(runs)
            if args.rounds > 1:
                print(
                    f"{name} at {streams} streams: median {medians[name, streams]:.1f} tok/s over {len(runs)} rounds "
                    f"({min(runs):.1f} - {max(runs):.1f})"
                )
        print(
            f"{name}: {max(levels)} streams give {medians[name, max(levels)] / medians[name, min(levels)]:.2f}x the "
            f"aggregate tok/s of {min(levels)}" + (" (medians)" if args.rounds > 1 else "")
        )
    for streams in levels:
        if ("llama-server", streams) in medians:
            print(
                f"moerun / llama-server at {streams} streams: "
                f"{medians['moerun', streams] / medians['llama-server', streams]:.2f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
