"""The HTTP side of `moerun serve`: aiohttp routes that check a request, turn it into a Job for the engine thread and
answer whole or as server-sent events.

Every refusal is the API's JSON error object with its status (ApiError; aiohttp's own 404/405/413 are rewritten
into that shape by the middleware) and anything unexpected is a logged 500, so no traceback reaches a client and
the server keeps going. aiohttp cancels a handler whose client disconnects, and its `finally` cancels the job, so
the sequence is free at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from moeprep.errors import MoeprepError
from moerun.generation import Sampler, make_sampler
from moerun.model import Model
from moerun.serve.answers import HARMONY_MARKERS, ChatAnswer, HarmonyAnswer, TextAnswer
from moerun.serve.chat import ChatFormat
from moerun.serve.engine import Engine
from moerun.serve.grammar import Constraint, Grammars
from moerun.serve.protocol import (
    CHAT,
    COMPLETION,
    ApiError,
    GenerationRequest,
    LoggedToken,
    Response,
    ResponseShape,
    model_list,
    parse_chat,
    parse_completion,
    usage,
)
from moerun.serve.scheduler import Job, Output, QueueFull, Scheduler
from moerun.serve.tool_grammar import Thinking

MAX_BODY_BYTES = 8 << 20  # far above any context's worth of prompt text; larger bodies get a 413
MAX_QUEUE = 64  # requests waiting for a free sequence before new ones get a 503
log = logging.getLogger("moerun.serve")


class Server:
    """The routes of one served model."""

    def __init__(self, model: Model, engine: Engine, api_key: str | None = None) -> None:
        self.model, self.engine, self.api_key = model, engine, api_key
        self.chat = ChatFormat(model.gguf, model.tokenizer)
        self.grammars = Grammars(model.tokenizer, self.chat.control_names())
        self.name = Path(model.gguf.path).name
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            if self.api_key is not None and request.path != "/health":
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                    raise ApiError(
                        401,
                        "invalid API key: send 'Authorization: Bearer <the --api-key value>'",
                        code="invalid_api_key",
                    )
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:  # aiohttp's: no route (404), wrong method (405), body too large (413)
            if e.status < 400:
                raise
            return web.json_response(
                ApiError(e.status, f"{request.method} {request.path}: {e.reason}").body(), status=e.status
            )
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return web.json_response(ApiError(500, "internal error; see the server's log").body(), status=500)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **self.engine.status})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(model_list(self.name, self.created, self.model.n_ctx))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion(await _json_body(request))
        prompt = await asyncio.to_thread(self._prompt_ids, req.prompt)
        return await self._generate(request, req, prompt, COMPLETION, TextAnswer)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat(await _json_body(request))
        if "reasoning_effort" in req.template_kwargs and "reasoning_effort" not in self.chat.template.variables:
            raise ApiError(
                400,
                "'reasoning_effort': this model's chat template takes none",
                param="reasoning_effort",
                code="unsupported_parameter",
            )
        parse_calls = bool(req.tools) and req.tool_choice != "none"
        calls = self.chat.tool_format if parse_calls else None
        if parse_calls and calls is None and not self.chat.harmony:
            raise ApiError(
                400,
                "'tools': this model's chat template writes tool calls in no format this server "
                "parses (docs/runtime.md lists them)",
                param="tools",
                code="unsupported_value",
            )
        text, prompt = await asyncio.to_thread(self.chat.prompt, req.messages, req.tools, req.template_kwargs)
        tags = self.chat.reasoning if req.split_reasoning else None
        in_reasoning = tags is not None and text.rstrip().endswith(tags.start)
        written = self.chat.tool_format  # its way of marking the answer's parts holds with or without calls
        opening = written.prompt_end if written and written.prompt_end and text.endswith(written.prompt_end) else ""
        content_marker = written.content_marker if opening else ""
        dropped = written.dropped if written else ()
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in req.tools or ()}
        markers = (tags.start, tags.end) if tags else ()
        # (a format whose sections' tags are dropped from the content needs its markers to find them, calls or not)
        kept = calls.markers if calls else written.markers if dropped else ()
        control_text = self.chat.control_texts(markers + kept + (HARMONY_MARKERS if self.chat.harmony else ()))
        # a thinking model may think before a constrained answer, unconstrained, unless the prompt closed its
        # reasoning (thinking turned off) or the reasoning is not split out of the answer (reasoning_format none)
        thinking = None
        if self.chat.harmony and req.split_reasoning:
            thinking = Thinking("<|channel|>", "<|end|>", harmony=True)
        elif tags is not None and not text.rstrip().endswith(tags.end):
            thinking = Thinking(tags.start, tags.end, in_reasoning)
        grammar = None
        if req.tool_choice == "required" or isinstance(req.tool_choice, dict):
            chosen = [
                t
                for t in req.tools
                if not isinstance(req.tool_choice, dict) or t["function"]["name"] == req.tool_choice["function"]["name"]
            ]
            grammar = await asyncio.to_thread(
                self.grammars.tool_call,
                "harmony" if calls is None else calls.name,
                chosen,
                self.chat.control_ids(),
                "tool_choice",
                thinking,
            )
        elif req.json_schema is not None:
            grammar = await asyncio.to_thread(
                self.grammars.json_schema, req.json_schema, "response_format", self.chat.control_ids(), thinking
            )
        if self.chat.harmony:

            def answer() -> Answer:
                return HarmonyAnswer(req.split_reasoning, req.parallel_tool_calls, parse_calls)
        else:

            def answer() -> Answer:
                return ChatAnswer(
                    tags, in_reasoning, calls, schemas, req.parallel_tool_calls, opening, content_marker, dropped
                )

        return await self._generate(request, req, prompt, CHAT, answer, control_text, grammar)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's token ids. Called in a worker thread, as chat.encode is: tokenizing a long prompt
        must not stall the other requests' streams on the event loop."""
        tokenizer = self.model.tokenizer
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if not all(0 <= t < tokenizer.n_vocab for t in prompt):
            raise ApiError(400, f"'prompt': token ids must be in [0, {tokenizer.n_vocab})", param="prompt")
        return prompt

    def _jobs(
        self,
        req: GenerationRequest,
        prompt: list[int],
        control_text: dict[int, bytes],
        grammar: str | None,
    ) -> list[Job]:
        """One job per choice, each with a sampler of its own (choice i seeded with seed + i)."""
        s = req.sampling
        n_vocab = self.model.tokenizer.n_vocab
        if any(not 0 <= t < n_vocab for t in s.logit_bias):
            raise ApiError(400, f"'logit_bias': token ids must be in [0, {n_vocab})", param="logit_bias")

        def sampler(i: int) -> Sampler:
            return make_sampler(
                s.temperature,
                s.top_p,
                None if s.seed is None else s.seed + i,
                top_k=s.top_k,
                min_p=s.min_p,
                presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty,
                repeat_penalty=s.repeat_penalty,
                repeat_last_n=s.repeat_last_n,
                logit_bias=s.logit_bias,
                prompt=prompt,
            )

        return [
            Job(
                prompt,
                s.max_tokens,
                sampler(i),
                s.stop,
                s.ignore_eos,
                req.logprobs,
                control_text,
                None if grammar is None else Constraint(self.grammars, grammar),
            )
            for i in range(req.n)
        ]

    async def _generate(
        self,
        request: web.Request,
        req: GenerationRequest,
        prompt: list[int],
        shape: ResponseShape,
        answer: Callable[[], Answer],
        control_text: dict[int, bytes] | None = None,
        grammar: str | None = None,
    ) -> web.StreamResponse:
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(prompt) >= self.model.n_ctx:
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens; the context holds {self.model.n_ctx} "
                "(start the server with a larger -c)",
                param="messages" if shape is CHAT else "prompt",
                code="context_length_exceeded",
            )
        # (a matcher compiles its grammar: in a worker thread, as the prompt was tokenized)
        jobs = await asyncio.to_thread(self._jobs, req, prompt, control_text or {}, grammar)
        outputs: asyncio.Queue[tuple[int, Output | Exception]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def submit(i: int, job: Job) -> int:
            return self.engine.submit(job, lambda item: loop.call_soon_threadsafe(outputs.put_nowait, (i, item)))

        tickets = [submit(i, job) for i, job in enumerate(jobs)]
        choices = [_Choice(answer(), req.logprobs is not None) for _ in jobs]
        finished = False
        try:
            first = await outputs.get()
            _raise_failure(first[1])  # a full queue is a 503 before any byte is sent
            response = Response(shape, self.name)
            if req.stream:
                result = await self._stream(request, first, outputs, response, choices, req.include_usage)
            else:
                result = await self._whole(first, outputs, response, choices)
            finished = True
            return result
        finally:
            if not finished:
                for ticket in tickets:
                    self.engine.cancel(ticket)

    def _logged(self, out: Output) -> LoggedToken | None:
        if out.logprobs is None:
            return None
        token_bytes = self.model.tokenizer.token_bytes

        def text(token: int) -> tuple[str, bytes]:
            raw = token_bytes(token)
            return raw.decode("utf-8", errors="replace"), raw

        return LoggedToken(*text(out.token), out.logprobs.logprob, tuple((*text(t), lp) for t, lp in out.logprobs.top))

    async def _whole(
        self, first: tuple[int, Output | Exception], outputs: asyncio.Queue, response: Response, choices: list[_Choice]
    ) -> web.Response:
        item = first
        while True:
            i, out = item[0], _raise_failure(item[1])
            choices[i].take(out, self._logged(out))
            choices[i].answer.push(out.text)
            if all(c.done for c in choices):
                break
            item = await outputs.get()
        for c in choices:
            c.answer.end()
        body = [
            response.choice(
                i, c.answer.fields(), c.answer.finish_reason(c.last.finish_reason), delta=False, logprobs=c.logged
            )
            for i, c in enumerate(choices)
        ]
        return web.json_response(response.whole(body, _usage(choices)))

    async def _stream(
        self,
        request: web.Request,
        first: tuple[int, Output | Exception],
        outputs: asyncio.Queue,
        response: Response,
        choices: list[_Choice],
        include_usage: bool,
    ) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await stream.prepare(request)

        async def send(obj: Any) -> None:
            await stream.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        await send(
            response.chunk(
                [
                    response.choice(i, dict(c.answer.first_delta), None, delta=True, **c.unsent())
                    for i, c in enumerate(choices)
                ]
            )
        )
        item = first
        while True:
            i, out = item
            if isinstance(out, Exception):  # the status is sent already: the error goes in the stream
                await send(_failure(out).body())
                await stream.write_eof()
                return stream
            c = choices[i]
            c.take(out, self._logged(out))
            fields = c.answer.push(out.text)
            if fields:
                await send(response.chunk([response.choice(i, fields, None, delta=True, **c.unsent())]))
            if out.finish_reason:
                await send(
                    response.chunk(
                        [
                            response.choice(
                                i, c.answer.end(), c.answer.finish_reason(out.finish_reason), delta=True, **c.unsent()
                            )
                        ]
                    )
                )
                if all(c.done for c in choices):
                    break
            item = await outputs.get()
        if include_usage:
            await send(response.usage_chunk(_usage(choices)))
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream


class Answer(Protocol):
    first_delta: dict[str, Any]

    def push(self, text: str) -> dict[str, Any] | None: ...
    def end(self) -> dict[str, Any]: ...
    def finish_reason(self, reason: str) -> str: ...
    def fields(self) -> dict[str, Any]: ...


class _Choice:
    """One choice of a request: its answer, the last output of its job, and its tokens' log-probabilities (None:
    not asked for), of which the first `sent` went out in chunks already, covering `offset` characters."""

    def __init__(self, answer: Answer, logprobs: bool) -> None:
        self.answer = answer
        self.last: Output | None = None
        self.logged: list[LoggedToken] | None = [] if logprobs else None
        self.sent = self.offset = 0

    @property
    def done(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None

    def take(self, out: Output, logged: LoggedToken | None) -> None:
        self.last = out
        if self.logged is not None:
            self.logged.append(logged)

    def unsent(self) -> dict[str, Any]:
        """The `Response.choice` arguments for the log-probabilities not sent yet; none when not asked for."""
        if self.logged is None:
            return {}
        tokens, offset = self.logged[self.sent :], self.offset
        self.sent, self.offset = len(self.logged), offset + sum(len(t.text) for t in tokens)
        return {"logprobs": tokens, "text_offset": offset}


def _usage(choices: list[_Choice]) -> dict[str, Any]:
    """The prompt counted once, the choices' tokens added up; cached: the prompt tokens every choice reused."""
    outs = [c.last for c in choices]
    return usage(outs[0].prompt_tokens, sum(o.completion_tokens for o in outs), min(o.cached_tokens for o in outs))


def _failure(e: Exception) -> ApiError:
    if isinstance(e, QueueFull):
        return ApiError(503, f"the server is busy ({e}); retry later", code="queue_full")
    return ApiError(500, "the engine failed on this batch; see the server's log")


def _raise_failure(item: Output | Exception) -> Output:
    if isinstance(item, Exception):
        raise _failure(item)
    return item


async def _json_body(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())  # read() raises aiohttp's 413 past client_max_size
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, a number past int's digit limit, deep nesting
        raise ApiError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from e


def serve(
    model: Model,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    max_queue: int = MAX_QUEUE,
    prefill_chunk: int | None = None,
    gather_s: float | None = None,
) -> None:
    """Serve the model until interrupted; the engine thread runs batches of up to model.n_seq sequences, each step
    with at most `prefill_chunk` prompt tokens (default: scheduler.PREFILL_CHUNK for the model's device) beside the
    decoding sequences' tokens, new prompts held back up to `gather_s` for others to come (default:
    scheduler.GATHER_S for the device)."""
    scheduler = Scheduler(model, max_queue=max_queue, prefill_chunk=prefill_chunk, gather_s=gather_s)
    logging.basicConfig(format="moerun: %(message)s", level=logging.WARNING)
    start = time.perf_counter()
    captured = model.capture_decode_steps()
    if captured:
        print(
            f"moerun: captured {captured} decode steps as CUDA graphs (1 to {model.n_seq} sequences) in "
            f"{time.perf_counter() - start:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    start = time.perf_counter()
    captured = model.capture_prompt_steps(scheduler.prefill_chunk)
    if captured:
        print(
            f"moerun: captured {captured} prompt steps as CUDA graphs (up to {scheduler.prefill_chunk} tokens) in "
            f"{time.perf_counter() - start:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    model.warm_up()
    engine = Engine(scheduler)
    server = Server(model, engine, api_key)
    engine.start()
    try:
        asyncio.run(_run(server.app(), host, port, f"{model.n_seq} sequences of {model.n_ctx} positions"))
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()


async def _run(app: web.Application, host: str, port: int, capacity: str) -> None:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:
            raise MoeprepError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --host/--port") from e
        print(f"moerun: serving on http://{host}:{port}/v1 ({capacity})", file=sys.stderr, flush=True)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
