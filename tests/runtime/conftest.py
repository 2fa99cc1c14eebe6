"""Runtime test fixtures: synthetic models written once per session, the test text, one CPU thread per test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import moerun
from moeprep.synth import write_synth_model
from moeprep.synth.corpus import CALIBRATION_PATH
from moerun.models import ARCHS

# Every architecture moerun runs but glm5-next, whose four-stream file has its own tests (tests/test_glm5_next.py):
# the expert-cache, profile, batched-decode and perplexity checks run over these.
SMOKE_ARCHS = [arch for arch in ARCHS if arch != "glm5-next"]

# English prose, code, Unicode of several scripts, emoji, odd whitespace, digits and special-token look-alikes.
MIXED_TEXT = (
    "Hello, World! It's a test: don't we'll they've I'm you'd.\n"
    "def f(x):\n\tif x >= 10_000: return x**2  # comment\r\n    else: return None\n\n\n"
    "Ünïcödé naïve café — 日本語のテキスト 中文 한국어 Ελληνικά русский עברית العربية 🙂🎉👍🏽\n"
    "numbers 1234567 3.14159 1,000,000 $99.99 50% 2024-01-01\n"
    "   leading spaces and trailing   \n\t\ttabs\tand  double  spaces\u00a0nbsp\u2003emsp\n"
    "CamelCaseWords snake_case_words kebab-case-words URL https://example.com/a?b=c&d=e\n"
    "```python\nprint('hi')\n```\n<|endoftext|> <s> [INST] \\n \\t\n"
)


@pytest.fixture(scope="session")
def calibration_text() -> str:
    return CALIBRATION_PATH.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """synth_model(arch, **write_synth_model options) -> path, each distinct model written once per session."""
    folder = tmp_path_factory.mktemp("runtime-models")
    written: dict[tuple, Path] = {}

    def make(arch: str, **options) -> Path:
        key = (arch, *sorted(options.items()))
        if key not in written:
            name = "-".join([arch, *(f"{k}={v}" for k, v in sorted(options.items()))]) + ".gguf"
            written[key] = write_synth_model(folder / name, arch, **options)
        return written[key]

    return make


def profile_model(model: Path, out: Path) -> Path:
    """`moeprep profile` of `model` on the calibration text, as the cache tests use it (3 chunks of 64 tokens, a
    third held out) -> `out`, the .moeprof it wrote."""
    from click.testing import CliRunner

    from moeprep.cli import main as moeprep_main

    args = ["profile", str(model), "--dataset", str(CALIBRATION_PATH), "-c", "64", "--chunks", "3", "--holdout", "0.34"]
    result = CliRunner().invoke(moeprep_main, [*args, "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def assert_batched_decode_equals_alone(path: Path) -> None:
    """Two prompts prefilled into sequences of one model, then a decode token of each in one forward_batch: each
    sequence's logits equal the model's with that sequence alone."""
    alone, batched = moerun.load_model(path), moerun.load_model(path, n_seq=2)
    prompts = [alone.tokenizer.encode(p) for p in ("def bisect(a, x):", "Once upon a time, in a land")]
    expected = [
        torch.stack([alone.forward(torch.tensor(p))[-1], alone.forward(torch.tensor([7]), len(p))[0]]) for p in prompts
    ]
    first = [batched.forward(torch.tensor(p), 0, seq=s)[-1] for s, p in reversed(list(enumerate(prompts)))][::-1]
    step = batched.forward_batch(torch.tensor([7, 7]), torch.tensor([len(p) for p in prompts]), torch.tensor([0, 1]))
    for s in range(2):
        torch.testing.assert_close(torch.stack([first[s], step[s]]), expected[s], rtol=1e-4, atol=1e-4)


@pytest.fixture(autouse=True)
def one_thread():
    """The test machines are small and shared; torch's thread pool only adds contention for tiny models."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
