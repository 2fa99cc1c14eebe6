"""Structured output's validity and cost: `moerun serve`'s grammar-constrained decoding (llguidance) on a suite of
generated JSON schemas, and decode speed with a grammar against without, at 1 and 8 streams; with `--tool-calls N`,
the validity of constrained tool calls (`tool_choice` "required") in every tool format.

    python bench/bench_grammar.py [--model bench/models/bench-qwen3moe-q4k.gguf] [--schemas 120] [--tokens 64]
    python bench/bench_grammar.py --schemas 0 --repeats 0 --tool-calls 16

Tool calls: for each tool format, N answers, each offered two tools whose parameters are object schemas of the
suite, sampled at temperature 1 under the format's call grammar; each answer is parsed as the server parses it
(answers.ChatAnswer / HarmonyAnswer) and must hold exactly one call, its arguments valid against the called tool's
schema.

Validity: each schema of the suite (nested objects, arrays with item bounds, enums, patterns, integers and numbers
with bounds, booleans, consts, anyOf; strings bounded by maxLength or a pattern) gets one answer sampled at
temperature 1 (seed = its index) through the scheduler, 8 at a time in one batch, and the answer is parsed and
validated with jsonschema. Speed: `--tokens` decode steps of 1 or 8 streams, the same sampler, with and without
a grammar that cannot finish within them (an array of objects); prefill excluded; the best of `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import jsonschema

import moerun
from moerun.serve.answers import ChatAnswer, HarmonyAnswer
from moerun.serve.chat import ChatFormat
from moerun.serve.formats import TOOL_FORMATS
from moerun.serve.grammar import Constraint, Grammars
from moerun.serve.scheduler import Job, Scheduler
from moerun.serve.tool_grammar import CALL_SHAPES

PATTERNS = ["^[a-z]{3,8}$", "^[0-9]{3}-[0-9]{4}$", "^[A-Z][a-z]{2,6}$", "^(yes|no|maybe)$", "^[a-f0-9]{6}$"]
WORDS = ["red", "green", "blue", "alpha", "beta", "north", "south", "low", "high", "cat", "dog"]


def leaf(rng: random.Random) -> dict:
    kind = rng.choice(["integer", "number", "boolean", "enum", "pattern", "string", "const"])
    if kind == "integer":
        low = rng.randint(-100, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        low = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(low, 2), "maximum": round(low + rng.uniform(0.5, 100), 2)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 5))}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 16)}
    return {"const": rng.choice(WORDS)}


def schema(rng: random.Random, depth: int = 0) -> dict:
    roll = rng.random()
    if depth >= 3 or (depth > 0 and roll < 0.35):
        return leaf(rng) if rng.random() > 0.1 else {"anyOf": [leaf(rng), leaf(rng)]}
    if roll < 0.75 or depth == 0:
        keys = rng.sample(
            ["id", "name", "kind", "size", "tags", "owner", "point", "value", "items", "flag"], rng.randint(1, 5)
        )
        properties = {k: schema(rng, depth + 1) for k in keys}
        required = [k for k in keys if rng.random() < 0.8]
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    low = rng.randint(0, 2)
    return {"type": "array", "items": schema(rng, depth + 1), "minItems": low, "maxItems": low + rng.randint(0, 3)}


def suite(n: int) -> list[dict]:
    rng = random.Random(0)
    return [schema(rng) for _ in range(n)]


def run(sched: Scheduler, jobs: list[Job]) -> tuple[list[str], list[str], float, int]:
    """-> (texts, finish reasons, decode seconds, decode tokens): decode counted from the step after which every
    job has its first token."""
    ids = {sched.add(job): i for i, job in enumerate(jobs)}
    texts, finish = [""] * len(jobs), [""] * len(jobs)
    started, start, tokens = set(), None, 0
    while sched.busy:
        outputs = sched.step()
        for o in outputs:
            i = ids[o.job]
            texts[i] += o.text
            finish[i] = o.finish_reason or finish[i]
            tokens += start is not None
            started.add(i)
        if start is None and len(started) == len(jobs):
            start = time.perf_counter()
    return texts, finish, time.perf_counter() - start, tokens


def tool_call_validity(
    sched: Scheduler,
    grammars: Grammars,
    prompt: list[int],
    schemas: list[dict],
    n: int,
    names: list[str],
    max_tokens: int,
) -> None:
    """Per tool format: how many of n constrained calls parse into one call valid against its tool's schema."""
    formats = {f.name: f for f in TOOL_FORMATS}
    for name in names:
        start = time.perf_counter()
        valid, failures = 0, []
        for at in range(0, n, 8):
            offered = [
                [
                    {"type": "function", "function": {"name": f"tool_{k}", "parameters": schemas[k % len(schemas)]}}
                    for k in (2 * i, 2 * i + 1)
                ]
                for i in range(at, min(at + 8, n))
            ]
            jobs = [
                Job(
                    prompt,
                    max_tokens,
                    moerun.make_sampler(1.0, seed=at + i),
                    grammar=Constraint(grammars, grammars.tool_call(name, tools, {}, "tool_choice")),
                )
                for i, tools in enumerate(offered)
            ]
            texts, finish, _, _ = run(sched, jobs)
            for i, (tools, text) in enumerate(zip(offered, texts)):
                by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
                if name == "harmony":
                    answer = HarmonyAnswer()
                else:  # (the prompt ends with the text a format opens the answer with, functionary v3.2's >>>)
                    written = formats[name]
                    answer = ChatAnswer(tools=written, schemas=by_name, opening=written.prompt_end)
                answer.push(text)
                answer.end()
                try:
                    (call,) = answer.fields()["tool_calls"]
                    function = call["function"]
                    jsonschema.validate(json.loads(function["arguments"]), by_name[function["name"]])
                    valid += 1
                except (KeyError, ValueError, jsonschema.ValidationError) as e:
                    failures.append((at + i, finish[i], str(e)[:100], text[:80] + " ... " + text[-80:]))
        print(f"tool calls, {name}: {valid}/{n} valid ({time.perf_counter() - start:.0f} s)")
        for f in failures:
            print("  invalid:", f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(__file__).parent / "models" / "bench-qwen3moe-q4k.gguf")
    parser.add_argument("--schemas", type=int, default=120)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tool-calls", type=int, default=0, help="constrained calls per tool format (0: none)")
    parser.add_argument("--formats", default=",".join(CALL_SHAPES), help="the tool formats of --tool-calls")
    parser.add_argument("--call-tokens", type=int, default=1024, help="the token limit of a constrained call")
    args = parser.parse_args()
    names = args.formats.split(",")
    unknown = sorted(set(names) - set(CALL_SHAPES))
    if unknown:
        parser.error(f"--formats: no tool format {', '.join(unknown)} (known: {', '.join(CALL_SHAPES)})")
    model = moerun.load_model(args.model, n_ctx=1024, n_seq=8, device=args.device)
    grammars = Grammars(model.tokenizer, ChatFormat(model.gguf, model.tokenizer).control_names())
    prompt = model.tokenizer.encode("Here is the record as JSON: ")
    sched = Scheduler(model)

    schemas = suite(args.schemas)
    start = time.perf_counter()
    valid, failures = 0, []
    for at in range(0, len(schemas), 8):
        batch = schemas[at : at + 8]
        jobs = [
            Job(
                prompt,
                512,
                moerun.make_sampler(1.0, seed=at + i),
                grammar=Constraint(grammars, grammars.json_schema(s, "schema")),
            )
            for i, s in enumerate(batch)
        ]
        texts, finish, _, _ = run(sched, jobs)
        for i, (s, text) in enumerate(zip(batch, texts)):
            try:
                jsonschema.validate(json.loads(text), s)
                valid += 1
            except (ValueError, jsonschema.ValidationError) as e:
                failures.append((at + i, finish[i], str(e)[:100], text[:120]))
    print(f"validity: {valid}/{len(schemas)} answers valid against their schema ({time.perf_counter() - start:.0f} s)")
    for f in failures:
        print("  invalid:", f)

    if args.tool_calls:
        schemas = suite(max(args.schemas, 2 * args.tool_calls))
        tool_call_validity(sched, grammars, prompt, schemas, args.tool_calls, names, args.call_tokens)
    if not args.repeats:
        return

    long_schema = {
        "type": "array",
        "minItems": 1000,
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "tag": {"enum": ["red", "green", "blue"]},
            },
            "required": ["name", "age", "tag"],
            "additionalProperties": False,
        },
    }
    long_grammar = grammars.json_schema(long_schema, "schema")
    masks = grammars.masks
    mask_seconds = [0.0]

    def timed_masks(matchers):
        start = time.perf_counter()
        out = masks(matchers)
        mask_seconds[0] += time.perf_counter() - start
        return out

    grammars.masks = timed_masks
    sample = sched._sample
    sample_seconds = [0.0]

    def timed_sample(runs, logits, masks=([], None)):
        start = time.perf_counter()
        out = sample(runs, logits, masks)
        sample_seconds[0] += time.perf_counter() - start
        return out

    sched._sample = timed_sample
    for streams in (1, 8):
        speeds: dict[str, list[float]] = {"without": [], "with": []}
        share = []
        sampling: dict[str, list[float]] = {"without": [], "with": []}  # seconds per decode step
        for r in range(args.repeats):  # alternated, so that the machine's load falls on both alike
            for name in ("without", "with"):
                jobs = [
                    Job(
                        prompt,
                        args.tokens + 1,
                        moerun.make_sampler(1.0, seed=r * 8 + i),
                        ignore_eos=True,
                        grammar=Constraint(grammars, long_grammar) if name == "with" else None,
                    )
                    for i in range(streams)
                ]
                mask_seconds[0] = sample_seconds[0] = 0.0
                _, _, seconds, tokens = run(sched, jobs)
                speeds[name].append(tokens / seconds)
                sampling[name].append(sample_seconds[0] / (tokens / streams))
                if name == "with":
                    share.append(mask_seconds[0] / seconds)
        best = {name: max(v) for name, v in speeds.items()}
        print(
            f"{streams} stream(s): {best['without']:.1f} tok/s without a grammar, {best['with']:.1f} with "
            f"({best['with'] / best['without']:.2f}x; best of {args.repeats}); the masks took "
            f"{100 * min(share):.1f}-{100 * max(share):.1f}% of the constrained runs' time (in a thread, beside "
            f"the pass); picking the tokens took {1e3 * min(sampling['without']):.2f} ms a step without, "
            f"{1e3 * min(sampling['with']):.2f} with (waiting for the masks included)"
        )


if __name__ == "__main__":
    main()
