"""Render every chat template of llama.cpp's models/templates/ with `moerun serve`'s renderer and with transformers'
`apply_chat_template`, on the same conversations, and compare the texts byte for byte.

The templates are read from the llama-cpp-python 0.3.36 source package (downloaded into a temporary folder with
`pip download` when the script runs; they are not stored in this repository). transformers is needed by this script
only: `pip install transformers`.

    python bench/bench_chat_templates.py [--sdist llama_cpp_python-0.3.36.tar.gz] [-v]

A conversation the template refuses counts as identical when both renderers refuse it with the same message.

It then lists the tool-call format `moerun serve` picks for each template (as the server does: harmony for a
template that writes `<|channel|>`, else formats.tool_format), and the templates with none: those that show the
model its tools (a request with `tools` is a 400 naming why) and those that take no tools.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from moerun.serve.chat import ChatTemplate
from moerun.serve.formats import tool_format
from moerun.serve.protocol import ApiError

SDIST = "llama-cpp-python==0.3.36"
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city's name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
]
CONVERSATIONS: dict[str, tuple[list[dict], list[dict] | None]] = {
    "plain": (
        [
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi there. How can I help?"},
            {"role": "user", "content": "What is a mixture of experts?"},
        ],
        None,
    ),
    "system": (
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "Another, in ünïcödé words?"},
        ],
        None,
    ),
    "tools": (
        [
            {"role": "system", "content": "Use the tools when they help."},
            {"role": "user", "content": "What's the weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [  # what the server passes for content: null
                    {
                        "id": "a1B2c3D4e",
                        "type": "function",  # 9 alphanumerics, as Mistral's templates demand
                        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "a1B2c3D4e", "name": "get_weather", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "It is 21 °C in Paris."},
            {"role": "user", "content": "And in Rome?"},
        ],
        TOOLS,
    ),
    "reasoning": (
        [
            {"role": "user", "content": "What is 17 * 3?"},
            {"role": "assistant", "reasoning_content": "17 * 3 = 51.", "content": "51"},
            {"role": "user", "content": "And 51 * 2?"},
        ],
        None,
    ),
}


def templates(sdist: Path | None, work: Path) -> dict[str, str]:
    if sdist is None:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                SDIST,
                "-d",
                str(work),
                "-q",
            ],
            check=True,
        )
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
    found = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            if "/models/templates/" in member.name and member.name.endswith(".jinja"):
                found[Path(member.name).stem] = tar.extractfile(member).read().decode()
    return dict(sorted(found.items()))


def hf_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL.values())}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), **SPECIAL)


def hf_render(tokenizer, source: str, messages: list[dict], tools: list[dict] | None) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=source, add_generation_prompt=True, tokenize=False
        )
    except Exception as e:
        return f"<raises {type(e).__name__}: {e}>"


def moerun_render(source: str, messages: list[dict], tools: list[dict] | None) -> str:
    try:
        return ChatTemplate(source, SPECIAL).render(messages, tools)
    except ApiError as e:
        return f"<raises 400: {e.message}>"


def same_error(ours: str, theirs: str) -> bool:
    """Both refused, ours naming their message (ours adds what failed and the exception's type)."""
    if not (ours.startswith("<raises") and theirs.startswith("<raises")):
        return False
    message = theirs.split(": ", 1)[1].rstrip(">")
    return message in ours


def tool_formats(found: dict[str, str]) -> None:
    """Print how many templates pick each tool-call format, and the ones that pick none."""
    picked, without, no_tools = collections.Counter(), [], []
    for name, source in found.items():
        written = "harmony" if "<|channel|>" in source else getattr(tool_format(source), "name", None)
        if written is not None:
            picked[written] += 1
        elif TOOLS[1]["function"]["name"] in moerun_render(source, [{"role": "user", "content": "Hi"}], TOOLS):
            without.append(name)
        else:
            no_tools.append(name)
    print(
        f"{sum(picked.values())} of {len(found)} templates pick a tool-call format: "
        + ", ".join(f"{name} {n}" for name, n in picked.most_common())
    )
    print(f"  {len(without)} show the model its tools in no format the server parses: {', '.join(without)}")
    print(f"  {len(no_tools)} take no tools: {', '.join(no_tools)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help="the llama-cpp-python source package (default: pip download it)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the first difference of each")
    args = parser.parse_args()
    tokenizer = hf_tokenizer()
    with tempfile.TemporaryDirectory() as work:
        found = templates(args.sdist, Path(work))
    identical, differing = 0, collections.defaultdict(list)
    errors_alike = collections.defaultdict(list)
    for name, source in found.items():
        diffs = []
        for conv, (messages, tools) in CONVERSATIONS.items():
            ours, theirs = moerun_render(source, messages, tools), hf_render(tokenizer, source, messages, tools)
            if ours == theirs:
                continue
            if same_error(ours, theirs):
                errors_alike[name].append(f"{conv}: {theirs[8:80]}")
                continue
            diffs.append(conv)
            if args.verbose:
                at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                print(
                    f"{name} [{conv}] at {at}:\n  ours:   {ours[max(0, at - 60) : at + 100]!r}\n"
                    f"  theirs: {theirs[max(0, at - 60) : at + 100]!r}"
                )
        if diffs:
            differing[name] = diffs
        else:
            identical += 1
    print(
        f"{identical} of {len(found)} templates render identical to transformers' apply_chat_template on all "
        f"{len(CONVERSATIONS)} conversations ({', '.join(CONVERSATIONS)}); "
        f"{sum(map(len, errors_alike.values()))} renders both refuse alike:"
    )
    for name, refused in errors_alike.items():
        print(f"  both refuse: {name}: {'; '.join(refused)}")
    for name, convs in differing.items():
        print(f"  differs: {name} ({', '.join(convs)})")
    tool_formats(found)


if __name__ == "__main__":
    main()
