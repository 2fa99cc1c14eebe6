"""The moerun command through click's CliRunner: generation, perplexity, and one-line errors with exit code 2."""

from __future__ import annotations

from click.testing import CliRunner
from gguf import GGUFValueType

from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, write_gguf
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
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moerun: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_bad_inputs_exit_2_with_one_line(synth_model, tmp_path):
    _assert_one_line_error(run("-m", str(tmp_path / "missing.gguf"), "-p", "x"), "no such file")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file at all")
    _assert_one_line_error(run("-m", str(junk), "-p", "x"), "not a GGUF file")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(synth_model("qwen3moe").read_bytes()[:5000])
    _assert_one_line_error(run("-m", str(truncated), "-p", "x"))
    _assert_one_line_error(run("perplexity", "-m", str(synth_model("qwen3moe")), "-f", str(tmp_path / "none.txt")),
                           "cannot read")
    _assert_one_line_error(run("-m", str(synth_model("qwen3moe")), "-p", "x", "-n", "100", "-c", "32"), "raise -c")


def test_unsupported_architecture_names_the_supported_ones(synth_model, tmp_path):
    foreign = tmp_path / "foreign.gguf"
    write_gguf(foreign, open_gguf(synth_model("qwen3moe")),
               kv_set={"general.architecture": KVValue("mamba", GGUFValueType.STRING)})
    _assert_one_line_error(run("-m", str(foreign), "-p", "x"), "'mamba' is not supported", "qwen3moe", "deepseek2", "gpt-oss")
