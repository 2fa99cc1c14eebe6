"""The moerun command through click's CliRunner: generation, perplexity, and one-line errors with exit code 2."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from gguf import GGUFValueType

import moerun
from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, write_gguf
from moerun.cache import host
from moerun.cli import main


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_generate_streams_text_and_speed(synth_model):
    result = run("-m", str(synth_model("qwen3moe")), "-p", "def main():", "-n", "8", "--temp", "0", "-t", "1")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("def main():")
    assert "prompt:" in result.stderr and "tokens/s" in result.stderr and "generation:" in result.stderr
    # `run` is the default command; naming it gives the same output
    named = run("run", "-m", str(synth_model("qwen3moe")), "-p", "def main():", "-n", "8", "--temp", "0")
    assert named.stdout == result.stdout


def test_perplexity_command(synth_model, tmp_path, calibration_text):
    text = tmp_path / "text.txt"
    text.write_text(calibration_text[:3000])
    result = run("perplexity", "-m", str(synth_model("qwen3moe")), "-f", str(text), "-c", "128")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("perplexity: ")


def _assert_one_line_error(result, *fragments: str) -> None:
    """One error line, after at most the line naming the device (errors found once the model is loading)."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    if lines and lines[0].startswith("moerun: running on "):
        lines = lines[1:]
    assert len(lines) == 1 and lines[0].startswith("moerun: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture
def loads(monkeypatch):
    """The device each command asks moerun.load_model for; the load itself stops there with an error."""
    devices = []

    def load_model(g, device, **kwargs):
        devices.append(device)
        raise MoeprepError("stopped before loading")

    monkeypatch.setattr(moerun, "load_model", load_model)
    return devices


def pretend_gpus(monkeypatch, names: list[str]) -> None:
    """torch sees these GPUs (nothing touches CUDA: only is_available, device_count and the names answer)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(names))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: names[i])
    monkeypatch.setattr(host, "fits_device", lambda g, device: True)  # would ask the GPU for its free memory


COMMANDS = {  # every command that loads a model, with the rest of its arguments
    "run": ["-p", "x", "-n", "1"],
    "bench": ["-p", "8", "-n", "4"],
    "serve": ["--port", "1"],
    "perplexity": ["-f", __file__],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_device_defaults_to_the_gpu_when_torch_sees_one(command, synth_model, monkeypatch, loads):
    pretend_gpus(monkeypatch, ["NVIDIA H200"])
    model = str(synth_model("qwen3moe"))
    result = run(command, "-m", model, *COMMANDS[command])
    assert loads == ["cuda"], result.output
    assert result.stderr.splitlines()[0] == "moerun: running on cuda (NVIDIA H200)"
    result = run(command, "-m", model, *COMMANDS[command], "--device", "cpu")  # still forces the CPU
    assert loads == ["cuda", "cpu"] and result.stderr.splitlines()[0] == "moerun: running on cpu (--device cpu)"


def test_device_defaults_to_the_cpu_without_a_gpu(synth_model, monkeypatch, loads):
    pretend_gpus(monkeypatch, [])
    result = run("-m", str(synth_model("qwen3moe")), "-p", "x", "-n", "1")
    assert loads == ["cpu"]
    assert result.stderr.splitlines() == [
        "moerun: running on cpu (no GPU found)",
        "moerun: error: stopped before loading",
    ]


def test_device_line_names_every_gpu(monkeypatch):
    from moerun.cli import device_line

    pretend_gpus(monkeypatch, ["NVIDIA H200", "NVIDIA H200"])
    assert device_line("cuda", None) == "moerun: running on cuda (2 x NVIDIA H200)"
    pretend_gpus(monkeypatch, ["NVIDIA H200", "NVIDIA L4"])
    assert device_line("cuda", "cuda") == "moerun: running on cuda (NVIDIA H200, NVIDIA L4)"
    pretend_gpus(monkeypatch, [])
    assert device_line("cuda", "cuda") is None  # loading says there is no GPU, in one line of its own


def test_bad_inputs_exit_2_with_one_line(synth_model, tmp_path):
    _assert_one_line_error(run("-m", str(tmp_path / "missing.gguf"), "-p", "x"), "no such file")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file at all")
    _assert_one_line_error(run("-m", str(junk), "-p", "x"), "not a GGUF file")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(synth_model("qwen3moe").read_bytes()[:5000])
    _assert_one_line_error(run("-m", str(truncated), "-p", "x"))
    _assert_one_line_error(
        run("perplexity", "-m", str(synth_model("qwen3moe")), "-f", str(tmp_path / "none.txt")), "cannot read"
    )
    _assert_one_line_error(run("-m", str(synth_model("qwen3moe")), "-p", "x", "-n", "100", "-c", "32"), "raise -c")
    _assert_one_line_error(run("-m", str(synth_model("qwen3moe")), "-p", ""), "the prompt has no tokens")


def test_unsupported_architecture_names_the_supported_ones(synth_model, tmp_path):
    foreign = tmp_path / "foreign.gguf"
    write_gguf(
        foreign,
        open_gguf(synth_model("qwen3moe")),
        kv_set={"general.architecture": KVValue("mamba", GGUFValueType.STRING)},
    )
    _assert_one_line_error(
        run("-m", str(foreign), "-p", "x"), "'mamba' is not supported", "qwen3moe", "deepseek2", "gpt-oss"
    )


def test_bench_with_the_expert_cache(synth_model, tmp_path, calibration_text):
    """moerun bench on a CPU standing in for the GPU: llama-bench's rows, the cache's hit rate, uploads and time split,
    and the same in JSON."""
    import json

    text = tmp_path / "text.txt"
    text.write_text(calibration_text[:4000])
    out = tmp_path / "bench.json"
    result = run(
        "bench",
        "-m",
        str(synth_model("qwen3moe")),
        "--device",
        "cpu",
        "--vram-budget",
        "1540M",
        "--cache-slots",
        "2",
        "-p",
        "16",
        "-n",
        "8",
        "-f",
        str(text),
        "--json",
        str(out),
        "-t",
        "1",
    )
    assert result.exit_code == 0, result.output
    assert "expert cache: " in result.stderr and "slots per layer 2 2 2" in result.stderr  # printed at start
    assert "| pp16 | 16 |" in result.stdout and "| tg8 | 8 |" in result.stdout
    assert "expert cache, decode: hit rate" in result.stdout and "ms per token: router sync" in result.stdout
    report = json.loads(out.read_text())
    assert report["gen_tokens"] == 8 and report["decode_tok_s"] > 0
    decode = report["cache_decode"]
    assert 0 < decode["hit_rate"] < 1 and len(decode["hit_rate_per_layer"]) == 3
    # without cache options on the CPU every expert stays where the model is: no cache lines
    plain = run("bench", "-m", str(synth_model("qwen3moe")), "--device", "cpu", "-p", "8", "-n", "4")
    assert plain.exit_code == 0, plain.output
    assert "| tg4 | 4 |" in plain.stdout and "expert cache" not in plain.stdout + plain.stderr


def test_cache_options_refuse_bad_input(synth_model, tmp_path, calibration_text):
    model = ["-m", str(synth_model("qwen3moe")), "--device", "cpu"]  # the CPU standing in for the GPU
    _assert_one_line_error(run("bench", *model, "--vram-budget", "lots"), "--vram-budget")
    _assert_one_line_error(run("bench", *model, "--vram-budget", "1540M", "--cache-slots", "0"), "--cache-slots")
    _assert_one_line_error(run(*model, "-p", "x", "--cache-slots", "3"), "--vram-budget")  # cpu needs a budget
    for option in (["--cache-policy", "lru"], ["--cache-plan", "static"], ["--cache-gbps", "25,6"]):
        # each asks for the cache as --cache-slots does, never ignored
        _assert_one_line_error(run(*model, "-p", "x", "-n", "1", *option), "--vram-budget")
    _assert_one_line_error(run("bench", *model, "--vram-budget", "64M"), "larger --vram-budget")
    _assert_one_line_error(run("bench", *model, "-p", "0", "-n", "0"), "nothing to measure")
    _assert_one_line_error(run("bench", *model, "--json", str(tmp_path / "no" / "b.json")), "does not exist")
    short = tmp_path / "short.txt"
    short.write_text("two words")
    _assert_one_line_error(run("bench", *model, "-p", "64", "-n", "8", "-f", str(short)), "longer -f")
    _assert_one_line_error(
        run("bench", *model, "--vram-budget", "1540M", "--expert-profile", str(tmp_path / "missing.moeprof")),
        "missing.moeprof",
    )


def test_a_second_run_compiles_no_kernel_again(synth_model, tmp_path):
    """numba's on-disk cache serves every CPU kernel a run compiled to the next process: a kernel that misses it is
    compiled again on every start (0.6 s for the input roundings' closure this caught) and adds a file each time.
    The first run compiles before it times anything, and says so."""
    import os
    import subprocess
    import sys

    script = f"""
import torch
from moerun.kernels import rounding
from moerun.cli import main
for rounding_of_type in set(rounding.INPUT_ROUNDING.values()):
    rounding_of_type(torch.randn(2, 512))
main(["-m", {str(synth_model("qwen3moe", expert_type="Q4_K", attn_type="Q8_0"))!r}, "-p", "def main():", "-n", "4",
      "--device", "cpu", "-t", "1"], standalone_mode=False)
"""
    cache = tmp_path / "numba-cache"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    files, notices = [], []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True)
        files.append(sorted(p.name for p in cache.rglob("*.nbc")))
        notices.append("s compiling kernels (once" in run.stderr)
    assert files[0] and files[1] == files[0], sorted(set(files[1]) - set(files[0]))
    assert notices == [True, False]


def _warnings(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("moerun: warning: ")]


@pytest.mark.parametrize("command", ["run", "bench", "perplexity", "serve"])
def test_a_context_past_training_warns_once_and_runs(command, synth_model, monkeypatch):
    """-c above the file's context_length: one warning line, then the command goes on (here the load, which this
    test stops right after the warning is due)."""
    from moerun import cli

    def stop_after_warning(model):
        warn(model)
        raise MoeprepError("stopped after loading")

    warn = cli.warn_past_training_context
    monkeypatch.setattr(cli, "warn_past_training_context", stop_after_warning)
    model = str(synth_model("qwen3moe", n_ctx=64))
    rest = {"perplexity": ["-f", __file__], "serve": ["--port", "1"], "bench": ["-p", "4", "-n", "4"]}
    rest["run"] = ["-p", "x", "-n", "1"]
    past = run(command, "-m", model, "-c", "128", "--device", "cpu", *rest[command])
    assert past.exit_code == 2, past.output  # the stop, not a refusal of -c
    assert _warnings(past) == [
        "moerun: warning: a context of 128 is above the 64 positions the model was trained for (context_length); "
        "past them output may degrade"
    ]
    within = run(command, "-m", model, "-c", "64", "--device", "cpu", *rest[command])
    assert within.exit_code == 2 and _warnings(within) == [], within.output


def test_a_context_the_rope_scaling_covers_does_not_warn(synth_model):
    """linear scaling by 4 over a context_length of 64 covers 256 positions; YaRN's original context of 16 times 4
    covers the 64 of context_length alone."""
    from moerun.cli import warn_past_training_context

    linear = moerun.load_model(synth_model("qwen3moe", n_ctx=64, rope_scaling="linear"), n_ctx=256)
    assert linear.args.context_covered == 256
    yarn = moerun.load_model(synth_model("qwen3moe", n_ctx=64, rope_scaling="yarn"), n_ctx=128)
    assert yarn.args.context_covered == 64
    runner = CliRunner()
    with runner.isolation() as (_, err, _):
        warn_past_training_context(linear)
        assert err.getvalue() == b""
        warn_past_training_context(yarn)
        assert err.getvalue().decode() == (
            "moerun: warning: a context of 128 is above the 64 positions the model was trained for (context_length); "
            "past them output may degrade\n"
        )
    scaled_past = moerun.load_model(synth_model("qwen3moe", n_ctx=64, rope_scaling="linear"), n_ctx=300)
    with runner.isolation() as (_, err, _):
        warn_past_training_context(scaled_past)
        assert err.getvalue().decode() == (
            "moerun: warning: a context of 300 is above the 256 positions the file's linear RoPE scaling covers "
            "(64 x 4); past them output may degrade\n"
        )


def test_generation_goes_on_past_the_training_context(synth_model):
    result = run("-m", str(synth_model("qwen3moe", n_ctx=64)), "-c", "96", "-p", "x", "-n", "70", "--temp", "0")
    assert result.exit_code == 0, result.output
    assert len(_warnings(result)) == 1 and "generation: 69 tokens" in result.stderr


def test_cache_slots_above_the_experts_are_refused(synth_model):
    model = ["-m", str(synth_model("qwen3moe")), "--device", "cpu", "--vram-budget", "8G"]
    _assert_one_line_error(
        run("bench", *model, "--cache-slots", "17", "-p", "4", "-n", "4"),
        "--cache-slots 17: a MoE layer of this model has 16 experts; give at most 16",
    )
    every = run("bench", *model, "--cache-slots", "16", "-p", "4", "-n", "4", "-t", "1")  # every expert resident
    assert every.exit_code == 0, every.output
    assert "slots per layer 16 16 16" in every.stderr


def test_perplexity_refuses_a_file_that_is_not_utf8(synth_model, tmp_path, calibration_text):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(calibration_text[:100].encode() + b"\xff\xfe\x00\x01" + bytes(range(256)))
    result = run("perplexity", "-m", str(synth_model("qwen3moe")), "-f", str(binary), "-c", "128")
    _assert_one_line_error(result, f"{binary}: not UTF-8 text (byte 0xff at offset 100)")
    assert "running on" not in result.stderr  # refused before the model loads
    # a character of several bytes is text, and so is a byte-order mark
    text = tmp_path / "text.txt"
    text.write_bytes("\ufeff".encode() + ("naïve café – 東京 " * 200).encode())
    ok = run("perplexity", "-m", str(synth_model("qwen3moe")), "-f", str(text), "-c", "64", "-t", "1")
    assert ok.exit_code == 0, ok.output
