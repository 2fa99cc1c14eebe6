"""Where `moerun serve`'s time goes, without HTTP: the scheduler's steps timed one by one, and prompts of several
lengths.

    python bench/profile_serve_steps.py MODEL [--device cuda] [--prefill-chunk N] [--profile [--profile-tokens 64,512]]
                                              [--no-dense-bf16]

Loads MODEL with 8 sequences, captures the decode and prompt steps as the server does at start with --prefill-chunk
(and compiles its prompt kernels), then times `model.forward` of 16 to 512 tokens three times each (the first time of
a length shows a compile or capture, if any), with the prompt graphs and eagerly, 8 prompt chunks of 64 tokens as one
step (`prefill_chunks`, as 8 requests that come together), and a decode step of 1 to 8 sequences (`decode_batch`: CUDA
graphs where they run); with --profile it prints torch.profiler's tables for a forward of each of --profile-tokens
(512) tokens and for a decode step of 8. Then it drives the scheduler (serve/scheduler.py) with waves of 64-token
prompts and 32-token answers at 1, 4 and 8 streams, a second wave joining after ten steps as bench_serve.py's clients
do, and prints each level's slowest passes: (kind, tokens, sequences, ms), kind being a decode batch, prompt chunks
(of one or several sequences), or a pass mixing both.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import moerun
from moerun.serve.scheduler import Job, Scheduler


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true", help="torch.profiler's tables for forwards and a decode step")
    ap.add_argument("--profile-tokens", default="512", help="the forwards --profile profiles, tokens, comma-separated")
    ap.add_argument("--prefill-chunk", type=int, help="as moerun serve's (default: its default on the device)")
    ap.add_argument(
        "--no-dense-bf16", action="store_true", help="as moerun serve's: no bfloat16 copies of the dense weights"
    )
    args = ap.parse_args()
    model = moerun.load_model(args.model, device=args.device, n_ctx=640, n_seq=8, dense_bf16=not args.no_dense_bf16)
    print(f"dense weights' bfloat16 copies: {model.decoded_bytes / 2**30:.2f} GiB")
    scheduler = Scheduler(model, prefill_chunk=args.prefill_chunk)  # (its default on the model's device)
    prefill_chunk = scheduler.prefill_chunk
    start = time.perf_counter()
    captured = model.capture_decode_steps()
    print(f"captured {captured} decode steps in {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    captured = model.capture_prompt_steps(prefill_chunk)
    model.warm_up()
    print(f"captured {captured} prompt steps and compiled the prompt kernels in {time.perf_counter() - start:.2f} s")
    prompt_graphs = model.prompt_graphs
    rng = random.Random(0)
    vocab = model.net.embed.n_vocab

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    def timed_ms(run) -> float:
        sync()
        start = time.perf_counter()
        run()
        sync()
        return (time.perf_counter() - start) * 1000

    def forward_ms(n: int) -> float:
        tokens = torch.tensor(prompt(n))
        return timed_ms(lambda: model.forward(tokens, 0, 0, last_only=True))

    def decode_ms(n: int) -> float:
        sync()
        start = time.perf_counter()
        for i in range(10):
            model.decode_batch(prompt(n), [100 + i] * n, list(range(n)))
        sync()
        return (time.perf_counter() - start) * 100

    for graphs in (prompt_graphs, None):
        model.prompt_graphs = graphs
        for n in (16, 64, 65, 256, 512):
            print(
                f"forward of {n} tokens{f' (graphs up to {prefill_chunk})' if graphs else ' eager'}: "
                + " ".join(f"{forward_ms(n):.1f}" for _ in range(3))
                + " ms"
            )
    model.prompt_graphs = prompt_graphs
    for n in (4, 8):
        chunks = [[(prompt(64), 0, s) for s in range(n)] for _ in range(3)]
        print(
            f"{n} prompt chunks of 64 tokens as one step: "
            + " ".join(f"{timed_ms(lambda: model.prefill_chunks(c)):.1f}" for c in chunks)
            + " ms"
        )
    for n in range(1, 9):
        print(f"decode step of {n} sequences: {decode_ms(n):.2f} ms")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        runs = [(f"a {n}-token forward", lambda n=n: forward_ms(n)) for n in map(int, args.profile_tokens.split(","))]
        for what, run in runs + [("a decode step of 8", lambda: decode_ms(8))]:
            with profile(activities=activities) as prof:
                run()
            print(f"== {what}")
            print(prof.key_averages().table(sort_by=sort, row_limit=25))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))

    forward, steps = scheduler._forward, []

    def timed(chunks, starts, rows):
        sync()
        start = time.perf_counter()
        out = forward(chunks, starts, rows)
        sync()
        sizes = [len(chunk) for _, chunk in chunks]
        kind = "decode" if max(sizes) == 1 else "prompt" if min(sizes) > 1 else "mixed"
        steps.append((kind, sum(sizes), len(chunks), round((time.perf_counter() - start) * 1000, 1)))
        return out

    scheduler._forward = timed
    for streams in (1, 4, 8):
        steps.clear()
        for wave in range(2):
            for _ in range(streams):
                scheduler.add(Job(prompt(64), 32))
            n = 0
            while scheduler.busy and (wave == 1 or n < 10):
                scheduler.step()
                n += 1
        while scheduler.busy:
            scheduler.step()
        total = sum(s[3] for s in steps)
        print(
            f"{streams} streams: {len(steps)} steps, {total:.0f} ms; slowest {sorted(steps, key=lambda s: -s[3])[:6]}"
        )


if __name__ == "__main__":
    main()
