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
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
IM_START, IM_END = 1, 2  # the synthetic vocabulary's control tokens
BENCH_MODEL = Path(__file__).resolve().parents[2] / "bench" / "models" / "bench-qwen3moe-q4k.gguf"  # trained, Q4_K
PROMPTS = [f"Request {i}: " + "the quick brown fox jumps over the lazy dog "[: 5 + 3 * i] for i in range(16)]


def with_kv(src: Path, dest: Path, **kv: KVValue) -> Path:
    write_gguf(dest, open_gguf(src), kv_set={k.replace("__", "."): v for k, v in kv.items()})
    return dest


@pytest.fixture(scope="module")
def chat_model(synth_model, tmp_path_factory) -> Path:
    return with_kv(synth_model("qwen3moe"), tmp_path_factory.mktemp("serve") / "chat.gguf",
                   tokenizer__chat_template=KVValue(CHATML, GGUFValueType.STRING),
                   tokenizer__ggml__eot_token_id=KVValue(IM_END, GGUFValueType.UINT32))


class Server:
    def __init__(self, model: Path, log: Path, *args: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "moerun", "serve", "-m", str(model), "-c", str(N_CTX),
                                      "--device", "cpu", "-t", "1", "--port", str(self.port), *args],
                                     stdout=subprocess.DEVNULL, stderr=log.open("w"))

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

    def request(self, method: str, path: str, body: bytes | dict | None = None, key: str | None = API_KEY,
                headers: dict | None = None) -> tuple[int, dict]:
        """-> (status, JSON body) of a raw HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            hdrs = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
                    **(headers or {})}
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
    started = {"main": Server(chat_model, logs / "main.log", "-np", "4", "--api-key", API_KEY),
               "single": Server(chat_model, logs / "single.log", "-np", "1", "--max-queue", "0"),
               "bench": Server(BENCH_MODEL, logs / "bench.log", "-np", "4")}
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
    expected_ids = ([IM_START] + encode("system\nBe brief.", add_bos=False) + [IM_END] + encode("\n", add_bos=False)
                    + [IM_START] + encode("user\nWhat is a router?", add_bos=False) + [IM_END]
                    + encode("\n", add_bos=False) + [IM_START] + encode("assistant\n", add_bos=False))
    assert alone.chat.encode(messages) == expected_ids
    r = servers["main"].client().chat.completions.create(model="x", messages=messages, max_tokens=10, temperature=0)
    text, finish, n = alone(expected_ids, 10)
    choice = r.choices[0]
    assert (choice.message.content, choice.message.role, choice.finish_reason) == (text, "assistant", finish)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(expected_ids), n)


def test_streaming_gives_the_same_text_then_usage(servers, alone):
    client = servers["main"].client()
    ids = alone.model.tokenizer.encode(PROMPTS[3])
    text, finish, n = alone(ids, 14)
    chunks = list(client.completions.create(model="x", prompt=PROMPTS[3], max_tokens=14, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert not chunks[-1].choices
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), n)
    messages = [{"role": "user", "content": PROMPTS[4]}]
    chat_text, chat_finish, _ = alone(alone.chat.encode(messages), 9)
    deltas = list(client.chat.completions.create(model="x", messages=messages, max_tokens=9, temperature=0,
                                                 stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == chat_text
    assert deltas[-1].choices[0].finish_reason == chat_finish


def test_stop_strings_cut_the_text_where_they_start(servers, alone):
    client = servers["main"].client()
    ids = alone.model.tokenizer.encode(PROMPTS[5])
    full, _, _ = alone(ids, 24)
    stop = full[len(full) // 2: len(full) // 2 + 3]  # three characters from the middle, likely across tokens
    expected = full[:full.index(stop)]
    r = client.completions.create(model="x", prompt=PROMPTS[5], max_tokens=24, temperature=0, stop=[stop, "\x00never"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    assert r.usage.completion_tokens < 24
    streamed = client.completions.create(model="x", prompt=PROMPTS[5], max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_seed_reproduces_the_same_sample(servers, alone):
    client = servers["main"].client()
    ids = alone.model.tokenizer.encode(PROMPTS[6])

    def sample(seed: int) -> str:
        return client.completions.create(model="x", prompt=PROMPTS[6], max_tokens=16, temperature=1.0, top_p=0.9,
                                         seed=seed).choices[0].text

    first = sample(7)
    assert sample(7) == first == alone(ids, 16, moerun.make_sampler(1.0, 0.9, 7))[0]
    assert sample(8) != first


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
                chunks = list(client.completions.create(model="x", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
                choices = [ch.choices[0] for ch in chunks if ch.choices]
                out.append(("".join(ch.text for ch in choices), choices[-1].finish_reason,
                            chunks[-1].usage.completion_tokens))
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
        replies = list(pool.map(lambda t: client.completions.create(model="x", prompt=t, max_tokens=12, temperature=0),
                                texts))
    for text, r in zip(texts, replies):
        expected = alone_bench(alone_bench.model.tokenizer.encode(text), 12)
        assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == expected, text


def test_serve_takes_the_expert_cache_options(chat_model, alone, tmp_path):
    """The cache options every model command shares reach `moerun serve`; through the cache (a CPU standing in for
    the GPU, its kernels in Triton's interpreter, tests/conftest.py) two requests batched together get what they get
    alone without it."""
    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    assert all(o in help_text for o in ("--vram-budget", "--cache-slots", "--expert-profile", "--cache-policy",
                                        "--no-dense-bf16"))
    server = Server(chat_model, tmp_path / "cache.log", "-np", "2", "--vram-budget", "8G", "--cache-slots", "4")
    try:
        server.wait_ready()
        assert "expert cache: " in server.log.read_text()
        client = server.client()
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda p: client.completions.create(model="x", prompt=p, max_tokens=6,
                                                                        temperature=0), PROMPTS[:2]))
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
    ("POST", "/v1/completions", {"prompt": "x", "n": 2}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 5}, 400),
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
    result = CliRunner().invoke(main, ["serve", "-m", str(chat_model), "-c", "64", "--device", "cpu", "--port",
                                       str(servers["main"].port)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()  # the device line, then the error
    assert len(lines) == 2 and lines[0] == "moerun: running on cpu (--device cpu)"
    assert lines[1].startswith("moerun: error: cannot listen on 127.0.0.1:")


# ------------------------------------------------------------------------------- the pieces, in this process


def test_chat_template_runs_sandboxed_and_its_errors_are_400(chat_model, tmp_path):
    def chat_format(template: str) -> ChatFormat:
        path = with_kv(chat_model, tmp_path / f"t{len(list(tmp_path.iterdir()))}.gguf",
                       tokenizer__chat_template=KVValue(template, GGUFValueType.STRING))
        g = open_gguf(path)
        return ChatFormat(g, Tokenizer(g))

    messages = [{"role": "user", "content": "hi"}]
    escapes = ["{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ messages.append(1) }}",
               "{{ raise_exception('no system role here') }}", "{{ cycler.__init__.__globals__.os.system('true') }}"]
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
            seqs = (args[2].tolist() if _name == "forward_batch" else
                    [kwargs.get("seq", args[2] if len(args) > 2 else 0)] * (1 if _name == "decode" else len(args[0])))
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
    for job, prompt, limit in [(first[0], ids[0], 3), (first[1], ids[1], 3), (late, ids[2], 3), (later, ids[3], 3),
                               (lonely, ids[4], 3), (at_once, ids[5], 3), (again, ids[1], 3), (stream, ids[6], 40),
                               (beside, ids[7], 3)]:
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
    prompts = [alone.model.tokenizer.encode(p) for p in (PROMPTS[1], PROMPTS[2], " ".join(PROMPTS[3:7]),
                                                          " ".join(PROMPTS[4:9]))]
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
