"""Whole-file `moeprep quantize --attn Q4_K` vs a plain copy of the same file and vs llama.cpp's own quantizer.

    python bench/bench_quantize_file.py [MODEL] [--workdir DIR] [--threads N] [--device cpu|cuda] [--no-peer]

Without MODEL it writes the Qwen3-30B-A3B-shaped synthetic model (about 17 GB, Q4_K experts, Q8_0 attention) into
the work folder first. The peer is llama.cpp's llama_model_quantize (what llama-quantize runs, through
llama-cpp-python) doing the same job with the same threads: tests/oracle.py's llama_quantize, whose output
tests/quant/test_whole_file_peer.py checks equal to ours tensor for tensor. Prints one table: copy, quantize, peer
and verify times, peak RSS, and the ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed_child(argv: list[str]) -> tuple[float, int]:
    """Wall seconds (until its writes reach the disk, as for the copy) and peak RSS (bytes) of a child process."""
    start = time.perf_counter()
    pid = subprocess.Popen(argv).pid
    _, status, usage = os.wait4(pid, 0)
    os.sync()
    if status != 0:
        sys.exit(f"{argv} failed with status {status}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--device", default="cpu", help="quantize --device (cpu or cuda)")
    ap.add_argument("--skip-verify", action="store_true", help="do not time `moeprep verify` afterwards")
    ap.add_argument("--no-peer", action="store_true", help="do not time llama.cpp's quantizer (needs llama-cpp-python)")
    args = ap.parse_args()
    work = Path(args.workdir)
    model = Path(args.model) if args.model else work / "bench-qwen3-30b-a3b.gguf"
    if not model.exists():
        subprocess.run([sys.executable, "-m", "moeprep", "synth", str(model), "--preset", "qwen3-30b-a3b",
                        "--expert-type", "Q4_K", "--attn-type", "Q8_0", "--fast-random-blocks"], check=True)
    copy_path, out = work / "bench-copy.gguf", work / "bench-q4k-attn.gguf"
    start = time.perf_counter()
    shutil.copyfile(model, copy_path)
    os.sync()
    copy_s = time.perf_counter() - start
    copy_path.unlink()
    quant_s, quant_rss = timed_child([sys.executable, "-m", "moeprep", "quantize", str(model), str(out),
                                      "--attn", "Q4_K", "--no-verify", "--threads", str(args.threads),
                                      "--device", args.device])
    if not args.skip_verify:
        verify_s, verify_rss = timed_child([sys.executable, "-m", "moeprep", "verify", str(out), "--against", str(model)])
    if not args.no_peer:
        peer_out = work / "bench-q4k-attn-llama.gguf"
        peer_call = (f"from tests.oracle import llama_quantize; "
                     f"llama_quantize({str(model)!r}, {str(peer_out)!r}, 'Q4_K', {args.threads})")
        peer_s, peer_rss = timed_child([sys.executable, "-c", peer_call])
        peer_out.unlink()
    size = model.stat().st_size
    print(f"\nmodel {model} ({size / 2**30:.2f} GiB), {args.threads} threads, quantize --device {args.device}")
    print(f"{'step':<28}{'seconds':>10}{'peak RSS':>14}")
    print(f"{'plain copy':<28}{copy_s:>10.1f}{'-':>14}")
    print(f"{'quantize --attn Q4_K':<28}{quant_s:>10.1f}{quant_rss / 2**20:>11.0f} MiB")
    if not args.no_peer:
        print(f"{'llama.cpp quantize':<28}{peer_s:>10.1f}{peer_rss / 2**20:>11.0f} MiB")
    if not args.skip_verify:
        print(f"{'verify':<28}{verify_s:>10.1f}{verify_rss / 2**20:>11.0f} MiB")
    print(f"quantize / copy = {quant_s / copy_s:.2f}x")
    if not args.no_peer:
        print(f"llama.cpp quantize / copy = {peer_s / copy_s:.2f}x, quantize / llama.cpp quantize = {quant_s / peer_s:.2f}x")
    out.unlink()


if __name__ == "__main__":
    main()
