"""`moerun serve` through the official openai client and raw HTTP, against live servers on 127.0.0.1.

The served model is the tiny synthetic qwen3moe with a ChatML chat template and <|im_end|> as its end-of-turn
token. Expected answers come from `moerun.generate` on the same file in this process (greedy, or the same seeded
sampler): the server must give exactly what the prompt gets alone, however many other requests share its batch.
Those references first check that no greedy step is a near-tie (top-2 logit gap over 1e-4, far above the batch's
float32 jitter), so equality is a fair demand on any CPU.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from click.testing import CliRunner
from gguf import GGUFValueType

import moerun
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, write_gguf
from moerun.cli import main
from moerun.serve.chat import ChatFormat
from moerun.serve.protocol import ApiError
from moerun.serve.scheduler import Job, QueueFull, Scheduler, TextStream
from moerun.tokenizer import Tokenizer

API_KEY = "sk-test-key"
N_CTX = 256
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
IM_START, IM_END = 1, 2  # the synthetic vocabulary's control tokens
BENCH_MODEL = Path(__file__).resolve().parents[2] / "bench" / "models" / "bench-qwen3moe-q4k.gguf"  # trained, Q4_K
PROMPTS = [f"Request {i}: " + "the quick brown fox jumps over the lazy dog "[: 5 + 3 * i] for i in range(16)]


def with_kv(src: Path, dest: Path, **kv: KVValue) -> Path:
    write_gguf(dest, open_gguf(src), kv_set={k.replace("__", "."): v for k, v in kv.items()})
    return dest


@pytest.fixture(scope="module")
def chat_model(synth_model, tmp_path_factory) -> Path:
    return with_kv(
        synth_model("qwen3moe"),
        tmp_path_factory.mktemp("serve") / "chat.gguf",
        tokenizer__chat_template=KVValue(CHATML, GGUFValueType.STRING),
        tokenizer__ggml__eot_token_id=KVValue(IM_END, GGUFValueType.UINT32),
    )


class Server:
    def __init__(self, model: Path, log: Path, *args: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "moerun",
                "serve",
                "-m",
                str(model),
                "-c",
                str(N_CTX),
                "--device",
                "cpu",
                "-t",
                "1",
                "--port",
                str(self.port),
                *args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=log.open("w"),
        )

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited: {self.log.read_text()}"
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"server not ready: {self.log.read_text()}")

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict | None = None,
        key: str | None = API_KEY,
        headers: dict | None = None,
    ) -> tuple[int, dict]:
        """-> (status, JSON body) of a raw HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            hdrs = {
                "Content-Type": "application/json",
                **({"Authorization": f"Bearer {key}"} if key else {}),
                **(headers or {}),
            }
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    def client(self, key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0, timeout=120)

    def health(self) -> dict:
        status, body = self.request("GET", "/health", key=None)
        assert status == 200 and body["status"] == "ok"
        return body

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def servers(chat_model, tmp_path_factory):
    """`main`: 4 sequences, an API key. `single`: one sequence and no queue, for the 503 and disconnect tests.
    `bench`: the trained bench model, 4 sequences."""
    logs = tmp_path_factory.mktemp("serve-logs")
    started = {
        "main": Server(chat_model, logs / "main.log", "-np", "4", "--api-key", API_KEY),
        "single": Server(chat_model, logs / "single.log", "-np", "1", "--max-queue", "0"),
        "bench": Server(BENCH_MODEL, logs / "bench.log", "-np", "4"),
    }
    try:
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        for s in started.values():
            s.stop()


def served_alone(path: Path):
    """The model in this process, one sequence: answer(ids, max_tokens[, sampler]) is what a prompt gets when it is
    served alone."""
    model = moerun.load_model(path, n_ctx=N_CTX)

    def answer(ids: list[int], max_tokens: int, sampler=moerun.greedy) -> tuple[str, str, int]:
        """-> (text, finish_reason, completion tokens), checking that no greedy step is a near-tie."""
        logits = model.forward(torch.tensor(ids))[-1]
        tokens: list[int] = []
        for i in range(max_tokens):
            if sampler is moerun.greedy:
                top = torch.topk(logits, 2).values
                assert top[0] - top[1] > 1e-4, "a near-tied greedy step: pick other test prompts"
            tokens.append(sampler(logits))
            if tokens[-1] in model.tokenizer.eog_ids:
                return model.tokenizer.decode(tokens), "stop", len(tokens)
            if i < max_tokens - 1:
                logits = model.forward(torch.tensor([tokens[-1]]), len(ids) + i)[0]
        return model.tokenizer.decode(tokens), "length", len(tokens)

    answer.model = model
    answer.chat = ChatFormat(model.gguf, model.tokenizer)
    return answer


@pytest.fixture(scope="module")
def alone(chat_model):
    return served_alone(chat_model)


# ------------------------------------------------------------------------------------------ the openai client


def test_completion_equals_moerun_greedy(servers, alone):
    client = servers["main"].client()
    for prompt in PROMPTS[:3]:
        ids = alone.model.tokenizer.encode(prompt)
        r = client.completions.create(model="chat.gguf", prompt=prompt, max_tokens=12, temperature=0)
        text, finish, n = alone(ids, 12)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (text, finish)
        assert r.object == "text_completion" and r.model == "chat.gguf"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), n, len(ids) + n)
    assert [m.id for m in client.models.list()] == ["chat.gguf"]


def test_chat_uses_the_gguf_template_and_special_tokens(servers, alone):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a router?"}]
    encode = alone.model.tokenizer.encode
    expected_ids = (
        [IM_START]
        + encode("system\nBe brief.", add_bos=False)
        + [IM_END]
        + encode("\n", add_bos=False)
        + [IM_START]
        + encode("user\nWhat is a router?", add_bos=False)
        + [IM_END]
        + encode("\n", add_bos=False)
        + [IM_START]
        + encode("assistant\n", add_bos=False)
    )
    assert alone.chat.encode(messages) == expected_ids
    r = servers["main"].client().chat.completions.create(model="x", messages=messages, max_tokens=10, temperature=0)
    text, finish, n = alone(expected_ids, 10)
    choice = r.choices[0]
    assert (choice.message.content, choice.message.role, choice.finish_reason) == (text, "assistant", finish)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(expected_ids), n)


def test_chat_takes_content_parts_template_kwargs_and_a_whole_agent_turn(servers, alone):
    """Through the openai client: text parts (joined for this template, which reads strings), chat_template_kwargs
    (passed; ChatML reads none), an assistant tool call with content null and the tool's result (rendered through
    the template, arguments as an object); reasoning_effort, which this template does not read, is a 400."""
    client = servers["main"].client()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "MoE?"}]}]
    r = client.chat.completions.create(
        model="x",
        messages=messages,
        max_tokens=5,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    ids = alone.chat.encode([{"role": "user", "content": "What is MoE?"}])
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == alone(ids, 5)[0]
    turn = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "21"},
    ]
    r = client.chat.completions.create(model="x", messages=turn, max_tokens=5, temperature=0)
    ids = alone.chat.encode(
        [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": ""},
            {"role": "tool", "content": "21"},
        ]
    )
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == alone(ids, 5)[0]
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client.chat.completions.create(model="x", messages=turn, max_tokens=5, reasoning_effort="low")


def test_streaming_gives_the_same_text_then_usage(servers, alone):
    client = servers["main"].client()
    ids = alone.model.tokenizer.encode(PROMPTS[3])
    text, finish, n = alone(ids, 14)
    chunks = list(
        client.completions.create(
            model="x",
            prompt=PROMPTS[3],
            max_tokens=14,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert not chunks[-1].choices
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), n)
    messages = [{"role": "user", "content": PROMPTS[4]}]
    chat_text, chat_finish, _ = alone(alone.chat.encode(messages), 9)
    deltas = list(
        client.chat.completions.create(model="x", messages=messages, max_tokens=9, temperature=0, stream=True)
    )
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == chat_text
    assert deltas[-1].choices[0].finish_reason == chat_finish


def test_stop_strings_cut_the_text_where_they_start(servers, alone):
    client = servers["main"].client()
    ids = alone.model.tokenizer.encode(PROMPTS[5])
    full, _, _ = alone(ids, 24)
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # three characters from the middle, likely across tokens
    expected = full[: full.index(stop)]
    r = client.completions.create(model="x", prompt=PROMPTS[5], max_tokens=24, temperature=0, stop=[stop, "\x00never"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    assert r.usage.completion_tokens < 24
    streamed = client.completions.create(
        model="x", prompt=PROMPTS[5], max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_seed_reproduces_the_same_sample(servers, alone):
    client = servers["main"].client()
    ids = alone.model.tokenizer.encode(PROMPTS[6])

    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model="x",
                prompt=PROMPTS[6],
                max_tokens=16,
                temperature=0.7,
                top_p=0.9,
                seed=seed,
                extra_body={"top_k": 4},
            )
            .choices[0]
            .text
        )

    first = sample(7)
    assert sample(7) == first == alone(ids, 16, margin_checked(moerun.make_sampler(0.7, 0.9, 7, top_k=4)))[0]
    assert sample(8) != first


def margin_checked(sampler):
    """A seeded sampler (temperature > 0) that asserts each draw falls at least 1e-2 of the kept probability mass
    away from a boundary between two tokens: batched logits differ from these by float rounding, and a draw that
    close to a boundary could pick the neighbour."""

    def pick(logits):
        kept, _ = sampler.distribution(sampler.adjust(logits))
        cumulative = (torch.cumsum(kept, dim=-1) / kept.sum())[: int((kept > 0).sum()) - 1]  # the inner boundaries
        peek = torch.Generator()
        peek.set_state(sampler.generator.get_state())
        u = float(torch.rand(1, generator=peek))
        assert not len(cumulative) or (cumulative - u).abs().min() > 1e-2, "a draw at a boundary: pick another seed"
        return sampler(logits)

    return pick


def greedy_logprobs(alone, ids: list[int], n: int, k: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Greedy steps in this process, with the model's own log-softmax: (token, its log-probability, the top k's),
    checking that no step's top k + 1 holds a near-tie."""
    steps, tokens = [], []
    for _ in range(n):
        row = torch.log_softmax(alone.model.forward(torch.tensor(ids + tokens))[-1].float(), dim=-1)
        top = torch.topk(row, k + 2)
        assert (top.values[:-1] - top.values[1:] > 1e-4).all(), "a near-tie: pick another prompt"
        token = int(top.indices[0])
        steps.append((token, float(row[token]), list(zip(top.indices[:k].tolist(), top.values[:k].tolist()))))
        tokens.append(token)
        if token in alone.model.tokenizer.eog_ids:
            break
    return steps


def test_logprobs_equal_the_models_log_softmax(servers, alone):
    """Chat (logprobs + top_logprobs, whole and streamed) and completions (logprobs=k): each token's log-probability
    and its alternatives' are the model's log-softmax at that step, the tokens the answer's."""
    client = servers["main"].client()
    token_bytes = alone.model.tokenizer.token_bytes
    messages = [{"role": "user", "content": PROMPTS[9]}]
    expected = greedy_logprobs(alone, alone.chat.encode(messages), 6, 3)
    r = client.chat.completions.create(
        model="x", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == len(expected)
    for c, (token, logprob, top) in zip(content, expected):
        assert bytes(c.bytes) == token_bytes(token) and c.logprob == pytest.approx(logprob, abs=1e-3)
        assert [bytes(t.bytes) for t in c.top_logprobs] == [token_bytes(t) for t, _ in top]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([lp for _, lp in top], abs=1e-3)
    streamed = [
        ch.choices[0]
        for ch in client.chat.completions.create(
            model="x", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
        if ch.choices
    ]
    again = [c for ch in streamed if ch.logprobs for c in ch.logprobs.content]
    assert [c.token for c in again] == [c.token for c in content]
    assert [c.logprob for c in again] == pytest.approx([c.logprob for c in content], abs=1e-3)
    plain = client.chat.completions.create(model="x", messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    # completions: the legacy shape, offsets into the answer's text
    expected = greedy_logprobs(alone, alone.model.tokenizer.encode(PROMPTS[10]), 5, 2)
    c = client.completions.create(model="x", prompt=PROMPTS[10], max_tokens=5, temperature=0, logprobs=2).choices[0]
    lp = c.logprobs
    assert lp.tokens == [token_bytes(t).decode("utf-8", errors="replace") for t, _, _ in expected]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.token_logprobs == pytest.approx([logprob for _, logprob, _ in expected], abs=1e-3)
    for got, (_, _, top) in zip(lp.top_logprobs, expected):
        assert list(got) == [token_bytes(t).decode("utf-8", errors="replace") for t, _ in top]
        assert list(got.values()) == pytest.approx([v for _, v in top], abs=1e-3)


def test_n_choices_each_sample_with_their_own_seed(servers, alone):
    """n=3 with a seed: choice i is what a request seeded seed + i gets alone; streamed, the chunks of the choices
    interleave by index and add up to the same texts; usage counts the prompt once and every choice's tokens."""
    client = servers["main"].client()
    ids = alone.model.tokenizer.encode(PROMPTS[11])
    answers = [alone(ids, 8, margin_checked(moerun.make_sampler(0.7, 1.0, 1 + i, top_k=4))) for i in range(3)]
    expected = [text for text, _, _ in answers]
    assert len(set(expected)) > 1
    r = client.completions.create(
        model="x", prompt=PROMPTS[11], max_tokens=8, temperature=0.7, seed=1, n=3, extra_body={"top_k": 4}
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == expected
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == sum(n for _, _, n in answers)
    texts = ["", "", ""]
    for chunk in client.completions.create(
        model="x", prompt=PROMPTS[11], max_tokens=8, temperature=0.7, seed=1, n=3, stream=True, extra_body={"top_k": 4}
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == expected
    chat = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, n=2
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


def greedy_gap_checked(sampler):
    """A temperature-0 PenalizedSampler that asserts each pick is no near-tie of its adjusted logits."""

    def pick(logits):
        top = torch.topk(sampler.adjust(logits), 2).values
        assert top[0] - top[1] > 1e-4, "a near-tied penalized step: pick other test settings"
        return sampler(logits)

    return pick


def test_penalties_top_k_min_p_and_logit_bias_through_the_server(servers, alone):
    """Each setting, greedy or seeded, gives what the same sampler gives the prompt alone in this process; and each
    of them changes the answer of that prompt (so none is silently ignored)."""
    client = servers["main"].client()
    ids = alone.model.tokenizer.encode(PROMPTS[12])
    plain = alone(ids, 12)[0]
    first = alone.model.tokenizer.encode(plain, add_bos=False)[0]
    cases = [
        ({"frequency_penalty": 1.5}, 0.0),
        ({"presence_penalty": 2.0}, 0.0),
        ({"repeat_penalty": 1.8, "repeat_last_n": 16}, 0.0),
        ({"logit_bias": {first: -100}}, 0.0),
        ({"top_k": 1}, 1.0),
        ({"min_p": 0.95}, 1.0),
    ]
    for settings, temperature in cases:
        body = {k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in settings.items()}
        sampler = moerun.make_sampler(temperature, 1.0, 3, prompt=ids, **settings)
        want = alone(ids, 12, (greedy_gap_checked if temperature == 0 else margin_checked)(sampler))[0]
        r = client.completions.create(
            model="x", prompt=PROMPTS[12], max_tokens=12, temperature=temperature, seed=3, extra_body=body
        )
        assert r.choices[0].text == want, settings
        if temperature == 0:
            assert want != plain, settings
    # top_k=1 and min_p near 1 keep only the most likely token: the greedy answer, whatever the seed
    for settings in ({"top_k": 1}, {"min_p": 1.0}):
        r = client.completions.create(
            model="x", prompt=PROMPTS[12], max_tokens=12, temperature=1.5, seed=99, extra_body=settings
        )
        assert r.choices[0].text == plain


def test_models_lists_the_context_length(servers):
    (model,) = servers["main"].request("GET", "/v1/models")[1]["data"]
    assert (model["id"], model["context_length"], model["max_model_len"]) == ("chat.gguf", N_CTX, N_CTX)


def test_max_tokens_and_a_huge_max_tokens(servers, alone):
    client = servers["main"].client()
    r = client.completions.create(model="x", prompt=PROMPTS[7], max_tokens=3, temperature=0)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (3, "length")
    # a limit past the context generates until the context is full
    r = client.completions.create(model="x", prompt=PROMPTS[7], max_tokens=10**12, temperature=0)
    ids = alone.model.tokenizer.encode(PROMPTS[7])
    assert r.usage.completion_tokens <= N_CTX - len(ids)
    assert r.choices[0].finish_reason == ("length" if r.usage.completion_tokens == N_CTX - len(ids) else "stop")


def test_a_chat_that_goes_on_reuses_its_kv_cache(servers, alone):
    client = servers["main"].client()
    turn = [{"role": "user", "content": "Tell me about experts."}]
    first = client.chat.completions.create(model="x", messages=turn, max_tokens=6, temperature=0)
    turn += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "More."}]
    second = client.chat.completions.create(model="x", messages=turn, max_tokens=6, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert second.choices[0].message.content == alone(alone.chat.encode(turn), 6)[0]


def test_eight_clients_at_once_each_get_what_they_get_alone(servers, alone):
    """8 clients x 4 requests on 4 sequences: requests queue, join and leave batches, reuse sequences that held other
    prompts (and identical ones), streamed and whole; every answer must be that prompt's answer alone."""
    main_server = servers["main"]
    work = [[(PROMPTS[(c * 4 + i) % len(PROMPTS)], 6 + (c + i) % 7) for i in range(4)] for c in range(8)]

    def client_run(c: int) -> list[tuple[str, str, int]]:
        client, out = main_server.client(), []
        for prompt, max_tokens in work[c]:
            if c % 2:
                chunks = list(
                    client.completions.create(
                        model="x",
                        prompt=prompt,
                        max_tokens=max_tokens,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
                choices = [ch.choices[0] for ch in chunks if ch.choices]
                out.append(
                    ("".join(ch.text for ch in choices), choices[-1].finish_reason, chunks[-1].usage.completion_tokens)
                )
            else:
                r = client.completions.create(model="x", prompt=prompt, max_tokens=max_tokens, temperature=0)
                out.append((r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens))
        return out

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(client_run, range(8)))
    for c in range(8):
        for (prompt, max_tokens), got in zip(work[c], answers[c]):
            assert got == alone(alone.model.tokenizer.encode(prompt), max_tokens), (c, prompt)
    assert main_server.health()["running"] == 0


def test_the_trained_bench_model_batched_equals_moerun_greedy(servers):
    alone_bench = served_alone(BENCH_MODEL)
    texts = ["The expert cache keeps", "def fib(n):", "Once upon a time", "In 1905, Einstein"]
    client = servers["bench"].client()
    with ThreadPoolExecutor(len(texts)) as pool:
        replies = list(
            pool.map(lambda t: client.completions.create(model="x", prompt=t, max_tokens=12, temperature=0), texts)
        )
    for text, r in zip(texts, replies):
        expected = alone_bench(alone_bench.model.tokenizer.encode(text), 12)
        assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == expected, text


def test_serve_takes_the_expert_cache_options(chat_model, alone, tmp_path):
    """The cache options every model command shares reach `moerun serve`; through the cache (a CPU standing in for
    the GPU, its kernels in Triton's interpreter, tests/conftest.py) two requests batched together get what they get
    alone without it."""
    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    assert all(
        o in help_text
        for o in ("--vram-budget", "--cache-slots", "--expert-profile", "--cache-policy", "--no-dense-bf16")
    )
    server = Server(chat_model, tmp_path / "cache.log", "-np", "2", "--vram-budget", "8G", "--cache-slots", "4")
    try:
        server.wait_ready()
        assert "expert cache: " in server.log.read_text()
        client = server.client()
        with ThreadPoolExecutor(2) as pool:
            replies = list(
                pool.map(
                    lambda p: client.completions.create(model="x", prompt=p, max_tokens=6, temperature=0), PROMPTS[:2]
                )
            )
    finally:
        server.stop()
    for prompt, r in zip(PROMPTS[:2], replies):
        expected = alone(alone.model.tokenizer.encode(prompt), 6)
        assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == expected, prompt


# -------------------------------------------------------------------------------------------- hostile input


HOSTILE: list[tuple[str, str, bytes | dict | None, int]] = [
    ("POST", "/v1/completions", b"{not json", 400),
    ("POST", "/v1/completions", b"", 400),
    ("POST", "/v1/completions", b"\xff\xfe\x00garbage", 400),
    ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400),
    ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400),
    ("POST", "/v1/completions", b"[1, 2, 3]", 400),
    ("POST", "/v1/completions", b'"a string"', 400),
    ("POST", "/v1/completions", {}, 400),
    ("POST", "/v1/completions", {"prompt": 3}, 400),
    ("POST", "/v1/completions", {"prompt": []}, 400),
    ("POST", "/v1/completions", {"prompt": [1, 2, 10**9]}, 400),
    ("POST", "/v1/completions", {"prompt": ["a", "b"]}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": True}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "seed": 1.5}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "stop": 5}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "ignore_eos": 1}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "stream_options": []}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "n": 9}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "n": 0}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": True}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": "a"}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "min_p": 2}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "frequency_penalty": -2.5}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "repeat_penalty": 0}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "repeat_last_n": -2}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"1": 200}}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"999999999": 1}}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": [1]}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "mirostat": 2}, 400),  # changes the output, not implemented
    ("POST", "/v1/completions", {"prompt": "x", "repetition_penalty": 1.1}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "echo": True}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        400,
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
        400,
    ),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]}, 400),
    ("POST", "/v1/completions", {"prompt": "word " * 400}, 400),  # longer than the context
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400),
    ("POST", "/v1/chat/completions", {"messages": []}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("POST", "/v1/chat/completions", {"prompt": "completions field on the chat route"}, 400),
    ("GET", "/v1/completions", None, 405),
    ("POST", "/v1/nothing", {"prompt": "x"}, 404),
    ("GET", "/", None, 404),
]


def assert_api_error(status: int, body: dict, expected: int) -> None:
    assert status == expected, body
    assert isinstance(body["error"]["message"], str) and body["error"]["type"], body


def test_hostile_requests_get_json_errors_and_the_server_stays_up(servers):
    server = servers["main"]
    for method, path, body, expected in HOSTILE:
        assert_api_error(*server.request(method, path, body), expected)
    # unknown fields are ignored, as OpenAI-compatible servers do; the known-but-unsupported ones were refused above
    status, body = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "frobnicate": [1]})
    assert status == 200 and body["usage"]["completion_tokens"] <= 2
    # fields that do not change the answer are accepted
    status, body = server.request(
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "user": "u1",
            "metadata": {"k": "v"},
            "store": False,
            "service_tier": "auto",
            "model": "anything",
            "modalities": ["text"],
            "response_format": {"type": "text"},
        },
    )
    assert status == 200 and body["usage"]["completion_tokens"] <= 2
    # a body past the limit: a 413 JSON error, or the connection closed while the body was still being sent
    try:
        assert_api_error(*server.request("POST", "/v1/completions", b"{" + b" " * (9 << 20) + b"}"), 413)
    except (ConnectionError, http.client.HTTPException):
        pass
    # the API key, on every /v1 route; /health needs none
    for key in (None, "sk-wrong"):
        assert_api_error(*server.request("POST", "/v1/completions", {"prompt": "x"}, key=key), 401)
        assert_api_error(*server.request("GET", "/v1/models", key=key), 401)
    with pytest.raises(openai.AuthenticationError):
        server.client("sk-wrong").completions.create(model="x", prompt="x", max_tokens=1)
    assert server.health()["running"] == 0


def test_full_queue_503_and_a_client_that_disconnects_mid_stream(servers, alone):
    """One sequence, no queue: while a stream runs, another request is a 503; the stream's client hangs up, its
    sequence is freed at once (a cancellation, not a finished job) and the next request is served."""
    server = servers["single"]
    assert alone(alone.model.tokenizer.encode(PROMPTS[8]), 64)[1] == "length"  # no early end of generation
    before = server.health()["cancelled"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = {"prompt": PROMPTS[8], "max_tokens": N_CTX, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    assert resp.readline().startswith(b"data: {")  # the stream is running
    assert_api_error(*server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}), 503)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 60
    while (h := server.health())["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (h["running"], h["cancelled"]) == (0, before + 1)
    status, body = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")


def test_serve_refuses_a_port_in_use_with_one_line(servers, chat_model):
    result = CliRunner().invoke(
        main, ["serve", "-m", str(chat_model), "-c", "64", "--device", "cpu", "--port", str(servers["main"].port)]
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()  # the device line, then the error
    assert len(lines) == 2 and lines[0] == "moerun: running on cpu (--device cpu)"
    assert lines[1].startswith("moerun: error: cannot listen on 127.0.0.1:")


# ------------------------------------------------------------------------------- the pieces, in this process


def test_chat_template_runs_sandboxed_and_its_errors_are_400(chat_model, tmp_path):
    def chat_format(template: str) -> ChatFormat:
        path = with_kv(
            chat_model,
            tmp_path / f"t{len(list(tmp_path.iterdir()))}.gguf",
            tokenizer__chat_template=KVValue(template, GGUFValueType.STRING),
        )
        g = open_gguf(path)
        return ChatFormat(g, Tokenizer(g))

    messages = [{"role": "user", "content": "hi"}]
    escapes = [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.append(1) }}",
        "{{ raise_exception('no system role here') }}",
        "{{ cycler.__init__.__globals__.os.system('true') }}",
    ]
    for template in escapes:
        with pytest.raises(ApiError) as e:
            chat_format(template).encode(messages)
        assert e.value.status == 400
    with pytest.raises(ApiError, match="does not compile"):
        chat_format("{% for %}").encode(messages)


def test_a_model_without_a_template_refuses_chat(synth_model):
    g = open_gguf(synth_model("qwen3moe"))
    with pytest.raises(ApiError, match="no chat template") as e:
        ChatFormat(g, Tokenizer(g)).encode([{"role": "user", "content": "hi"}])
    assert e.value.status == 400


def test_text_stream_holds_back_stop_prefixes_and_split_characters():
    s = TextStream(("END", "café"))
    assert s.push(b"abc E") == ("abc ", False)  # "E" may start "END"
    assert s.push(b"N") == ("", False)
    assert s.push(b"x caf") == ("ENx ", False)
    assert s.push("é".encode()[:1]) == ("", False)  # half a character: nothing to match yet
    assert s.push("é".encode()[1:] + b" tail") == ("", True)
    tail = TextStream(())
    assert tail.push("日".encode()[:2]) == ("", False)
    assert tail.flush() == "\ufffd"


def test_scheduler_queue_limit_and_cancel(chat_model):
    model = moerun.load_model(chat_model, n_ctx=64, n_seq=1)
    sched = Scheduler(model, max_queue=1)
    running, waiting = sched.add(Job([5, 6, 7], 50)), sched.add(Job([8, 9], 50))
    with pytest.raises(QueueFull):
        sched.add(Job([1], 1))
    sched.step()
    assert sched.counts() == {"sequences": 1, "running": 1, "waiting": 1}
    sched.cancel(running)
    outputs = sched.step()  # the waiting job takes the freed sequence at once
    assert {o.job for o in outputs} == {waiting} and sched.counts()["running"] == 1
    sched.cancel(waiting)
    assert not sched.busy


def test_ignore_eos_never_samples_an_end_of_generation_token(chat_model):
    """Two jobs of one prompt in one batch, greedy, the first token they would pick made an end-of-generation token:
    the plain job ends on it ("stop", one token), the ignore_eos one takes the best other token and runs to its limit
    ("length"); its text equals the first token picked with the end-of-generation tokens left out."""
    model = moerun.load_model(chat_model, n_ctx=N_CTX, n_seq=2)
    prompt = model.tokenizer.encode(PROMPTS[0])
    logits = model.forward(torch.tensor(prompt))[-1]
    model.tokenizer.eog_ids = model.tokenizer.eog_ids | {int(logits.argmax())}
    masked = logits.clone()
    masked[sorted(model.tokenizer.eog_ids)] = -math.inf
    top = torch.topk(masked, 2)
    assert top.values[0] - top.values[1] > 1e-4, "a near-tie: pick another prompt"
    first = int(top.indices[0])
    sched = Scheduler(model)
    plain, ignoring = sched.add(Job(prompt, 6)), sched.add(Job(prompt, 6, ignore_eos=True))
    outputs: dict[int, list] = {plain: [], ignoring: []}
    while sched.busy:
        for o in sched.step():
            outputs[o.job].append(o)
    assert [(o.finish_reason, o.completion_tokens) for o in outputs[plain]] == [("stop", 1)]
    assert [o.completion_tokens for o in outputs[ignoring]] == [1, 2, 3, 4, 5, 6]
    assert outputs[ignoring][-1].finish_reason == "length"
    assert outputs[ignoring][0].text == model.tokenizer.decode([first])


def test_a_long_prompt_prefills_in_chunks_while_a_stream_keeps_decoding(chat_model, alone):
    """A job streams; a second job with a prompt of several chunks joins. Until the second job's first token, every
    step is one pass through the model holding the stream's next token and one prompt chunk, and gives the stream a
    token; both answers equal their answers alone."""
    model = moerun.load_model(chat_model, n_ctx=N_CTX, n_seq=2)
    passes: list[tuple[str, list[int]]] = []  # (method, the sequence of each token) of every pass through the model
    for name in ("forward", "forward_batch", "decode"):

        def record(*args, _name=name, _method=getattr(model, name), **kwargs):
            seqs = (
                args[2].tolist()
                if _name == "forward_batch"
                else [kwargs.get("seq", args[2] if len(args) > 2 else 0)] * (1 if _name == "decode" else len(args[0]))
            )
            passes.append((_name, seqs))
            return _method(*args, **kwargs)

        setattr(model, name, record)
    chunk = 16
    sched = Scheduler(model, prefill_chunk=chunk)
    stream_ids = alone.model.tokenizer.encode(PROMPTS[1])
    long_ids = alone.model.tokenizer.encode(" ".join(PROMPTS[2:9]))
    n_chunks = -(-len(long_ids) // chunk)
    assert n_chunks >= 3
    expected = {"stream": alone(stream_ids, 24), "long": alone(long_ids, 8)}
    assert expected["stream"][1:] == ("length", 24), "the stream must outlast the long prompt's prefill"
    jobs = {"stream": sched.add(Job(stream_ids, 24))}
    got: dict[int, list] = {}

    def step() -> set[int]:
        outputs = sched.step()
        for o in outputs:
            got.setdefault(o.job, []).append(o)
        return {o.job for o in outputs}

    assert step() == {jobs["stream"]} and step() == {jobs["stream"]}  # the stream's prompt, then a decode step
    jobs["long"] = sched.add(Job(long_ids, 8))
    passes.clear()
    during = [step() for _ in range(n_chunks)]
    assert during[:-1] == [{jobs["stream"]}] * (n_chunks - 1)  # the stream got a token at every prefill step
    assert during[-1] == {jobs["stream"], jobs["long"]}  # ... and the last chunk gives the long job its first token
    assert len(passes) == n_chunks  # one pass per step, each with the stream's token and at most one chunk
    for method, seqs in passes:
        assert method == "forward_batch" and seqs.count(0) + seqs.count(1) == len(seqs)
        assert min(seqs.count(0), seqs.count(1)) == 1 and len(seqs) <= chunk + 1, seqs
    while sched.busy:
        step()
    for name, job in jobs.items():
        outs = got[job]
        assert ("".join(o.text for o in outs), outs[-1].finish_reason, outs[-1].completion_tokens) == expected[name]


class FakeClock:
    """The scheduler's `now`: seconds that move only when a test moves them."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_prompts_of_clients_just_answered_are_gathered_into_one_step(chat_model, alone):
    """With gather_s, a prompt that arrives while the clients just answered may still send theirs is held back (no
    pass runs it) until as many wait as may come, then they start in one step; a prompt nobody joins goes when the
    hold ends; a prompt with no other client answered lately (none, or its own alone), and one beside a stream with
    many tokens to go, wait for nothing. Every answer is the prompt's answer alone."""
    model = moerun.load_model(chat_model, n_ctx=N_CTX, n_seq=4)
    clock = FakeClock()
    sched = Scheduler(model, gather_s=0.02, now=clock)
    ids = [alone.model.tokenizer.encode(p) for p in PROMPTS[:8]]
    got: dict[int, list] = {}

    def step(dt: float = 0.001) -> set[int]:
        clock.t += dt
        outputs = sched.step()
        for o in outputs:
            got.setdefault(o.job, []).append(o)
        return {o.job for o in outputs}

    def answer(job: int) -> tuple[str, str, int]:
        outs = got[job]
        return "".join(o.text for o in outs), outs[-1].finish_reason, outs[-1].completion_tokens

    first = [sched.add(Job(ids[0], 3)), sched.add(Job(ids[1], 3))]  # nothing ran before: no hold
    assert sched.held_s() == 0 and step() == set(first)
    while sched.busy:
        step()
    late = sched.add(Job(ids[2], 3))  # both clients were just answered: the first of their next prompts waits
    assert sched.held_s() == pytest.approx(0.02)
    assert step(0.005) == set() and sched.counts()["waiting"] == 1
    later = sched.add(Job(ids[3], 3))  # the second one: as many wait as may come
    assert sched.held_s() == 0 and step() == {late, later}  # both prompts in one step, each gives a token
    while sched.busy:
        step()
    lonely = sched.add(Job(ids[4], 3))  # held as before, but no second prompt comes: it goes when the hold ends
    assert step(0.01) == set() and step(0.015) == {lonely}
    while sched.busy:
        step()
    clock.t += 1  # the clients went away
    at_once = sched.add(Job(ids[5], 3))  # nobody was answered lately: it starts at once
    assert sched.held_s() == 0 and step() == {at_once}
    while sched.busy:
        step()
    again = sched.add(Job(ids[1], 3))  # its client, just answered, is the only one: its next prompt starts at once
    assert sched.held_s() == 0 and step() == {again}
    while sched.busy:
        step()
    clock.t += 1
    stream = sched.add(Job(ids[6], 40))  # a stream with many tokens to go sends nothing soon ...
    step()
    step()
    beside = sched.add(Job(ids[7], 3))  # ... so a prompt beside it starts at once
    assert sched.held_s() == 0 and step() == {stream, beside}
    while sched.busy:
        step()
    for job, prompt, limit in [
        (first[0], ids[0], 3),
        (first[1], ids[1], 3),
        (late, ids[2], 3),
        (later, ids[3], 3),
        (lonely, ids[4], 3),
        (at_once, ids[5], 3),
        (again, ids[1], 3),
        (stream, ids[6], 40),
        (beside, ids[7], 3),
    ]:
        assert answer(job) == alone(prompt, limit)


class NoPromptFits:
    """A stand-in for graphs.PromptGraphs on the CPU: the scheduler splits its passes as with prompt graphs, and
    Model.forward, finding that no chunk fits a graph, runs each pass eagerly."""

    def fits(self, chunks) -> bool:
        return False


def test_with_prompt_graphs_decode_tokens_and_each_prompt_chunk_run_in_passes_of_their_own(chat_model, alone):
    """Where prompt chunks run as CUDA graphs (moerun serve on a GPU), a step runs the decoding sequences' tokens in
    one pass and each prompt chunk in one of its own: two streams decoding while two new prompts prefill in chunks
    get every answer as alone."""
    model = moerun.load_model(chat_model, n_ctx=N_CTX, n_seq=4)
    model.prompt_graphs = NoPromptFits()
    passes: list[tuple[str, list[int]]] = []
    for name in ("forward", "forward_batch"):

        def record(*args, _name=name, _method=getattr(model, name), **kwargs):
            seqs = args[2].tolist() if _name == "forward_batch" else [args[2] if len(args) > 2 else 0] * len(args[0])
            passes.append((_name, seqs))
            return _method(*args, **kwargs)

        setattr(model, name, record)
    sched = Scheduler(model, prefill_chunk=16)
    prompts = [
        alone.model.tokenizer.encode(p)
        for p in (PROMPTS[1], PROMPTS[2], " ".join(PROMPTS[3:7]), " ".join(PROMPTS[4:9]))
    ]
    expected = [alone(ids, 10) for ids in prompts]
    jobs = [sched.add(Job(ids, 10)) for ids in prompts[:2]]
    got: dict[int, list] = {}

    def step() -> None:
        for o in sched.step():
            got.setdefault(o.job, []).append(o)

    step()
    step()
    jobs += [sched.add(Job(ids, 10)) for ids in prompts[2:]]
    passes.clear()
    step()  # both streams' tokens in one pass; the first new prompt's 16 tokens in another
    assert [(m, sorted(set(s)), len(s)) for m, s in passes] == [("forward_batch", [0, 1], 2), ("forward", [2], 16)]
    while sched.busy:
        step()
    for job, want in zip(jobs, expected):
        outs = got[job]
        assert ("".join(o.text for o in outs), outs[-1].finish_reason, outs[-1].completion_tokens) == want
