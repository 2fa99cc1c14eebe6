"""Whole-file `moeprep quantize --attn Q4_K` vs a plain `cp` of the same file and vs llama.cpp's own quantizer.

    python bench/bench_quantize_file.py [MODEL] [--workdir DIR] [--threads N] [--device cpu|cuda]
        [--rounds R] [--cache cold|as-is] [--no-peer] [--skip-verify]

Without MODEL it writes the Qwen3-30B-A3B-shaped synthetic model (about 17 GB, Q4_K experts, Q8_0 attention) into
the work folder first. Each round times, one after the other, in child processes and until their writes are synced:

- `cp MODEL COPY`, the plain copy every ratio is against;
- `moeprep quantize MODEL OUT --attn Q4_K`, the default run, which verifies the output against MODEL before the
  rename;
- the same with `--no-verify`.

With `--cache cold` (the default) MODEL's pages are dropped from the page cache before every step
(posix_fadvise DONTNEED; the file is clean after the sync), so every step reads it from the disk (`verify alone`
reads the output from the disk too); `--cache as-is`
leaves whatever the previous step left. The share of MODEL in the page cache and the load average are printed
before every step. `--threads` is passed to quantize only when given (otherwise quantize's own default, the core
count). After the rounds: `moeprep verify` alone and the peer, llama.cpp's llama_model_quantize (what llama-quantize
runs, through llama-cpp-python) doing the same job with the same threads: tests/oracle.py's llama_quantize, whose
output tests/quant/test_whole_file_peer.py checks equal to ours tensor for tensor.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed_child(argv: list[str]) -> tuple[float, int]:
    """Wall seconds (until its writes reach the disk) and peak RSS (bytes) of a child process."""
    start = time.perf_counter()
    pid = subprocess.Popen(argv).pid
    _, status, usage = os.wait4(pid, 0)
    os.sync()
    if status != 0:
        sys.exit(f"{argv} failed with status {status}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to forget the file's clean cached pages, so the next reader goes to the disk."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_share(path: Path) -> str:
    """The share of the file's pages in the page cache, from util-linux's fincore when it is installed."""
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        return f"{int(out[0]) / max(int(out[1]), 1):.0%}"
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return "unknown"


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    ap.add_argument("--threads", type=int, help="quantize --threads (default: quantize's own, the core count)")
    ap.add_argument("--device", default="cpu", help="quantize --device (cpu or cuda)")
    ap.add_argument("--rounds", type=int, default=1, help="copy / quantize / quantize --no-verify rounds")
    ap.add_argument(
        "--cache",
        choices=["cold", "as-is"],
        default="cold",
        help="cold: drop MODEL from the page cache before every step",
    )
    ap.add_argument("--skip-verify", action="store_true", help="do not time `moeprep verify` alone afterwards")
    ap.add_argument("--no-peer", action="store_true", help="do not time llama.cpp's quantizer (needs llama-cpp-python)")
    args = ap.parse_args()
    if args.rounds < 1 or (args.threads is not None and args.threads < 1):
        ap.error("--rounds and --threads must be at least 1")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else work / "bench-qwen3-30b-a3b.gguf"
    if not model.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "moeprep",
                "synth",
                str(model),
                "--preset",
                "qwen3-30b-a3b",
                "--expert-type",
                "Q4_K",
                "--attn-type",
                "Q8_0",
                "--fast-random-blocks",
            ],
            check=True,
        )
    copy_path, out = work / "bench-copy.gguf", work / "bench-q4k-attn.gguf"
    threads = [] if args.threads is None else ["--threads", str(args.threads)]
    quantize = [
        sys.executable,
        "-m",
        "moeprep",
        "quantize",
        str(model),
        str(out),
        "--attn",
        "Q4_K",
        "--device",
        args.device,
        *threads,
    ]
    steps = [
        ("cp", ["cp", str(model), str(copy_path)], copy_path),
        ("quantize (default, verifies)", quantize, out),
        ("quantize --no-verify", [*quantize, "--no-verify"], out),
    ]
    rows: list[tuple[int, str, float, int, str, str]] = []

    def run(round_no: int, label: str, argv: list[str], written: Path | None, read_too: Path | None = None) -> float:
        if args.cache == "cold":
            for path in (model, read_too):
                if path is not None:
                    drop_from_page_cache(path)
        cached, before = cached_share(model), load()
        seconds, rss = timed_child(argv)
        rows.append((round_no, label, seconds, rss, cached, before))
        if written is not None:
            written.unlink()
        return seconds

    copies, verified, unverified = [], [], []
    for r in range(1, args.rounds + 1):
        for (label, argv, written), times in zip(steps, (copies, verified, unverified)):
            times.append(run(r, label, argv, written))
    if not args.skip_verify:
        subprocess.run([*quantize, "--no-verify"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        run(
            0,
            "verify alone",
            [sys.executable, "-m", "moeprep", "verify", str(out), "--against", str(model)],
            out,
            read_too=out,
        )
    if not args.no_peer:
        peer_out = work / "bench-q4k-attn-llama.gguf"
        n = args.threads or os.cpu_count() or 1
        peer_call = (
            f"from tests.oracle import llama_quantize; llama_quantize({str(model)!r}, {str(peer_out)!r}, 'Q4_K', {n})"
        )
        run(0, "llama.cpp quantize", [sys.executable, "-c", peer_call], peer_out)

    size = model.stat().st_size
    print(
        f"\nmodel {model} ({size / 2**30:.2f} GiB), quantize {' '.join(threads) or 'default threads'} "
        f"--device {args.device}, page cache: {args.cache}, {os.cpu_count()} cores"
    )
    print(f"{'round':<6}{'step':<30}{'seconds':>9}{'peak RSS':>11}{'cached':>8}  load 1/5/15 min before")
    for r, label, seconds, rss, cached, before in rows:
        print(f"{r or '-':<6}{label:<30}{seconds:>9.1f}{rss / 2**20:>7.0f} MiB{cached:>8}  {before}")
    for r in range(args.rounds):
        print(
            f"round {r + 1}: default run / cp = {verified[r] / copies[r]:.2f}x, "
            f"--no-verify / cp = {unverified[r] / copies[r]:.2f}x"
        )
    if args.rounds > 1:  # on a shared machine the best of each step is the steadier figure
        print(
            f"best of {args.rounds}: cp {min(copies):.1f} s, default run {min(verified):.1f} s "
            f"({min(verified) / min(copies):.2f}x), --no-verify {min(unverified):.1f} s "
            f"({min(unverified) / min(copies):.2f}x)"
        )
    print(f"load after: {load()}")


if __name__ == "__main__":
    main()
