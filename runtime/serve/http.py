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
from typing import Any

from aiohttp import web

from moeprep.errors import MoeprepError
from moerun.generation import make_sampler
from moerun.model import Model
from moerun.serve.chat import ChatFormat
from moerun.serve.engine import Engine
from moerun.serve.protocol import (CHAT, COMPLETION, ApiError, GenerationRequest, Response, ResponseShape,
                                   model_list, parse_chat, parse_completion, usage)
from moerun.serve.scheduler import Job, Output, QueueFull, Scheduler

MAX_BODY_BYTES = 8 << 20  # far above any context's worth of prompt text; larger bodies get a 413
MAX_QUEUE = 64  # requests waiting for a free sequence before new ones get a 503
log = logging.getLogger("moerun.serve")


class Server:
    """The routes of one served model."""

    def __init__(self, model: Model, engine: Engine, api_key: str | None = None) -> None:
        self.model, self.engine, self.api_key = model, engine, api_key
        self.chat = ChatFormat(model.gguf, model.tokenizer)
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
                    raise ApiError(401, "invalid API key: send 'Authorization: Bearer <the --api-key value>'",
                                   code="invalid_api_key")
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:  # aiohttp's: no route (404), wrong method (405), body too large (413)
            if e.status < 400:
                raise
            return web.json_response(ApiError(e.status, f"{request.method} {request.path}: {e.reason}").body(),
                                     status=e.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return web.json_response(ApiError(500, "internal error; see the server's log").body(), status=500)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **self.engine.status})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(model_list(self.name, self.created))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion(await _json_body(request))
        return await self._generate(request, req, await asyncio.to_thread(self._prompt_ids, req.prompt), COMPLETION)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat(await _json_body(request))
        return await self._generate(request, req, await asyncio.to_thread(self.chat.encode, req.messages), CHAT)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's token ids. Called in a worker thread, as chat.encode is: tokenizing a long prompt
        must not stall the other requests' streams on the event loop."""
        tokenizer = self.model.tokenizer
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if not all(0 <= t < tokenizer.n_vocab for t in prompt):
            raise ApiError(400, f"'prompt': token ids must be in [0, {tokenizer.n_vocab})", param="prompt")
        return prompt

    async def _generate(self, request: web.Request, req: GenerationRequest, prompt: list[int],
                        shape: ResponseShape) -> web.StreamResponse:
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(prompt) >= self.model.n_ctx:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; the context holds {self.model.n_ctx} "
                           "(start the server with a larger -c)", param="messages" if shape is CHAT else "prompt",
                           code="context_length_exceeded")
        s = req.sampling
        job = Job(prompt, s.max_tokens, make_sampler(s.temperature, s.top_p, s.seed), s.stop, s.ignore_eos)
        outputs: asyncio.Queue[Output | Exception] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        ticket = self.engine.submit(job, lambda item: loop.call_soon_threadsafe(outputs.put_nowait, item))
        finished = False
        try:
            first = _raise_failure(await outputs.get())  # a full queue is a 503 before any byte is sent
            response = Response(shape, self.name)
            if req.stream:
                answer = await self._stream(request, first, outputs, response, req.include_usage)
            else:
                answer = await _whole(first, outputs, response)
            finished = True
            return answer
        finally:
            if not finished:
                self.engine.cancel(ticket)

    async def _stream(self, request: web.Request, out: Output, outputs: asyncio.Queue, response: Response,
                      include_usage: bool) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await stream.prepare(request)

        async def send(obj: Any) -> None:
            await stream.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        await send(response.first_chunk())
        while True:
            if out.text:
                await send(response.chunk(out.text))
            if out.finish_reason:
                break
            item = await outputs.get()
            if isinstance(item, Exception):  # the status is sent already: the error goes in the stream
                await send(_failure(item).body())
                await stream.write_eof()
                return stream
            out = item
        await send(response.chunk("", out.finish_reason))
        if include_usage:
            await send(response.usage_chunk(usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)))
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream


async def _whole(out: Output, outputs: asyncio.Queue, response: Response) -> web.Response:
    text = [out.text]
    while not out.finish_reason:
        out = _raise_failure(await outputs.get())
        text.append(out.text)
    return web.json_response(response.whole("".join(text), out.finish_reason,
                                            usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)))


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


def serve(model: Model, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          max_queue: int = MAX_QUEUE, prefill_chunk: int | None = None, gather_s: float | None = None) -> None:
    """Serve the model until interrupted; the engine thread runs batches of up to model.n_seq sequences, each step
    with at most `prefill_chunk` prompt tokens (default: scheduler.PREFILL_CHUNK for the model's device) beside the
    decoding sequences' tokens, new prompts held back up to `gather_s` for others to come (default:
    scheduler.GATHER_S for the device)."""
    scheduler = Scheduler(model, max_queue=max_queue, prefill_chunk=prefill_chunk, gather_s=gather_s)
    logging.basicConfig(format="moerun: %(message)s", level=logging.WARNING)
    start = time.perf_counter()
    captured = model.capture_decode_steps()
    if captured:
        print(f"moerun: captured {captured} decode steps as CUDA graphs (1 to {model.n_seq} sequences) in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    start = time.perf_counter()
    captured = model.capture_prompt_steps(scheduler.prefill_chunk)
    if captured:
        print(f"moerun: captured {captured} prompt steps as CUDA graphs (up to {scheduler.prefill_chunk} tokens) in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
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
