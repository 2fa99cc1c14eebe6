"""Every architecture moerun runs, on CUDA against its own CPU path, and its decode speed all resident beside
llama-bench on the same synthetic file.

    python bench/bench_archs_gpu.py OUTDIR [--archs mimo2,llama4] [--llama-bench PATH] [--gen 128] [--json OUT]

For each architecture: the `small` synthetic preset (Q4_K experts, Q8_0 attention) is written to OUTDIR, the same
prompt is decoded greedily for 32 tokens on the CPU and on CUDA, and the table says how many of those tokens agree,
and where they first part, the CPU's margin between its top two logits there (a small margin is a near-tie that
bfloat16 activations may break the other way; a large one points at a wrong kernel). Then `moerun bench`'s
measurement (runtime/bench.py: pp512 and tg over the calibration text, CUDA graphs as the defaults take them) and,
with --llama-bench, llama-bench `-ngl 99 -p 512 -n GEN` on the same file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import moerun
from moeprep.synth import write_synth_model
from moeprep.synth.corpus import CALIBRATION_PATH
from moerun.bench import run_bench
from moerun.models import ARCHS

PROMPT = "def bisect(a, x):\n    lo, hi = 0, len(a)\n    while lo < hi:"


def greedy_tokens(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """n greedy tokens and the logits each was chosen from."""
    out, logits_seen = [], []
    tokens = list(prompt)
    for _ in range(n):
        logits = model.forward(torch.tensor(tokens)).float().cpu()[-1]
        token = int(logits.argmax())
        out.append(token)
        logits_seen.append(logits)
        tokens.append(token)
    return out, logits_seen


def llama_bench(binary: str, path: Path, n_gen: int) -> dict:
    """pp512 and tg tok/s of llama-bench all on the GPU, or the error's last line."""
    run = subprocess.run(
        [binary, "-m", str(path), "-p", "512", "-n", str(n_gen), "-r", "2", "-ngl", "99", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if run.returncode:
        return {"error": (run.stderr.strip().splitlines() or ["failed"])[-1]}
    rows = json.loads(run.stdout)
    found = {}
    for row in rows:
        key = "pp512" if row.get("n_prompt") else f"tg{n_gen}"
        found[key] = round(float(row["avg_ts"]), 1)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--archs", help="comma-separated (default: every architecture moerun runs)")
    ap.add_argument("--llama-bench", help="llama-bench binary (CUDA build) to measure beside")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="the device measured against the CPU (cpu: a dry run)")
    ap.add_argument("--json")
    args = ap.parse_args()
    archs = args.archs.split(",") if args.archs else sorted(ARCHS)
    unknown = sorted(set(archs) - set(ARCHS))
    if unknown:
        print(f"error: moerun does not run {', '.join(unknown)}; it runs {', '.join(sorted(ARCHS))}", file=sys.stderr)
        sys.exit(2)
    folder = Path(args.outdir)
    folder.mkdir(parents=True, exist_ok=True)
    text = CALIBRATION_PATH.read_text()
    results = {}
    print(
        f"{'arch':14} {'greedy':>7} {'1st split':>9} {'margin':>7} {'pp512':>8} {'tg':>8} {'peer pp':>8} {'peer tg':>8}"
    )
    for arch in archs:
        row: dict = {}
        started = time.perf_counter()
        try:
            path = folder / f"{arch}-small-q4k.gguf"
            if not path.exists():
                write_synth_model(path, arch, preset="small", expert_type="Q4_K", attn_type="Q8_0")
            cpu, gpu = moerun.load_model(path), moerun.load_model(path, device=args.device, n_ctx=1024)
            prompt = cpu.tokenizer.encode(PROMPT)
            ours, _ = greedy_tokens(gpu, prompt, 32)
            ref, ref_logits = greedy_tokens(cpu, prompt, 32)
            split = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
            row["greedy_equal"] = sum(a == b for a, b in zip(ours, ref)) if split is None else split
            row["first_split"] = split
            if split is not None:
                top2 = ref_logits[split].topk(2).values
                row["cpu_margin_at_split"] = round(float(top2[0] - top2[1]), 4)
            del cpu
            result = run_bench(gpu, 512, args.gen, text)
            row["moerun"] = {"pp512": round(result.prefill_tok_s, 1), f"tg{args.gen}": round(result.decode_tok_s, 1)}
            del gpu
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if args.llama_bench:
                row["llama_bench"] = llama_bench(args.llama_bench, path, args.gen)
        except Exception as e:  # one architecture's failure is reported, the others still run
            row["error"] = f"{type(e).__name__}: {e}"
        row["seconds"] = round(time.perf_counter() - started, 1)
        results[arch] = row
        peer = row.get("llama_bench", {})
        ours_speed = row.get("moerun", {})
        print(
            f"{arch:14} {row.get('greedy_equal', '-')!s:>4}/32 {row.get('first_split')!s:>9} "
            f"{row.get('cpu_margin_at_split', '-')!s:>7} {ours_speed.get('pp512', '-')!s:>8} "
            f"{ours_speed.get(f'tg{args.gen}', '-')!s:>8} {peer.get('pp512', '-')!s:>8} "
            f"{peer.get(f'tg{args.gen}', peer.get('error', '-'))!s:>8}"
            + (f"  {row['error']}" if "error" in row else ""),
            flush=True,
        )
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
