"""HTTP front of `kvedge serve`: a Starlette app run by uvicorn, in front of one `Engine`.

Routes::

    POST /v1/chat/completions   OpenAI chat completions, JSON or `stream: true` server-sent events
    GET  /v1/models[/{id}]      the one served model
    GET  /health                200 {"status": "ready"} after load and warm-up, else 503 with the state
    GET  /metrics               Prometheus text (see metrics.py)

With an API key configured every route but /health needs `Authorization: Bearer <key>`.
Handlers run on the event loop and never touch onnxruntime: they validate the body, render and
count the prompt (tokenizer only, in a worker thread), submit a `Job` and relay its events.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvedge.errors import ContextOverflow, KvedgeError
from kvedge.runtime.model import Event, SamplingConfig
from kvedge.serve import protocol
from kvedge.serve.config import ServiceConfig
from kvedge.serve.engine import Engine, Job, NotReady, QueueFull, ShuttingDown
from kvedge.serve.metrics import Metrics
from kvedge.serve.protocol import ApiError, ChatRequest

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class EventStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends: finished, failed or client gone."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(config: ServiceConfig, engine: Engine, metrics: Metrics) -> Starlette:
    started = int(time.time())
    model_card = {"id": config.model_name, "object": "model", "created": started, "owned_by": "kvedge"}

    def protected(handler: Handler) -> Handler:
        async def checked(request: Request) -> Response:
            if config.api_key is not None:
                sent = request.headers.get("authorization", "")
                scheme, _, token = sent.partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(
                    token.strip().encode(), config.api_key.encode()
                ):
                    return error_response(
                        ApiError(
                            401,
                            "missing or wrong API key: send Authorization: Bearer <key>",
                            code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"},
                        )
                    )
            try:
                return await handler(request)
            except ApiError as error:
                return error_response(error)

        return checked

    async def health(request: Request) -> Response:
        return JSONResponse({"status": engine.state}, status_code=200 if engine.state == "ready" else 503)

    async def metrics_text(request: Request) -> Response:
        return PlainTextResponse(
            metrics.render(engine.gauges()), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card]})

    async def get_model(request: Request) -> Response:
        if request.path_params["name"] != config.model_name:
            raise ApiError(404, "no such model", param="model", code="model_not_found")
        return JSONResponse(model_card)

    async def chat_completions(request: Request) -> Response:
        try:
            response = await _chat(request)
        except ApiError as error:
            response = error_response(error)
        metrics.response(response.status_code)
        return response

    async def _chat(request: Request) -> Response:
        chat = protocol.parse_chat_request(await read_json(request, config.max_body_bytes))
        model = engine.model
        if engine.state != "ready" or model is None:
            raise _not_ready(engine.state)
        requested = config.default_max_tokens if chat.max_tokens is None else chat.max_tokens
        try:
            ids = await run_in_threadpool(model.encode_chat, list(chat.messages), requested)
            max_new = model.fit_reply(
                len(ids), chat.max_tokens, config.default_max_tokens, config.context_policy
            )
            sampling = sampling_config(chat, max_new)
        except KvedgeError as exc:
            raise api_error(exc) from None

        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def deliver(item: Event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the event loop is gone: nobody is listening any more
                pass

        job = Job(ids=ids, config=sampling, deliver=deliver)
        try:
            engine.submit(job)
        except QueueFull as full:
            raise ApiError(
                429,
                f"all {config.slots} slots are busy and the queue is full; "
                f"retry after {full.retry_after_s} s",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(full.retry_after_s)},
            ) from None
        except NotReady as not_ready:
            raise _not_ready(not_ready.state) from None

        reply = Reply(protocol.completion_id(), config.model_name, len(ids), chat.include_usage)
        if chat.stream:
            return EventStream(reply.stream(events), on_close=lambda: engine.cancel(job))
        try:
            return await reply.collect(events, request)
        finally:
            engine.cancel(job)

    routes = [
        Route("/v1/chat/completions", protected(chat_completions), methods=["POST"]),
        Route("/v1/models", protected(list_models), methods=["GET"]),
        Route("/v1/models/{name:path}", protected(get_model), methods=["GET"]),
        Route("/metrics", protected(metrics_text), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        yield
        await run_in_threadpool(engine.stop)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, str(exc.detail), code=code))

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(ApiError(500, "internal server error", type="server_error"))

    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, Exception: internal_error},
    )


def _not_ready(state: str) -> ApiError:
    return ApiError(
        503,
        f"the model is not ready (state: {state}); poll /health",
        type="server_error",
        code="not_ready",
        headers={"Retry-After": "1"},
    )


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON, refusing more than `limit` bytes before reading them all."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body is larger than {limit} bytes", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body is larger than {limit} bytes", code="body_too_large")
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
    try:  # JSON may spell an unpaired surrogate (\ud800), which no tokenizer or reply can carry
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ApiError(
            400, "the request body has an unpaired surrogate escape", code="invalid_json"
        ) from None
    return value


def sampling_config(chat: ChatRequest, max_new_tokens: int) -> SamplingConfig:
    return SamplingConfig(
        max_new_tokens=max_new_tokens,
        temperature=chat.temperature,
        top_k=chat.top_k,
        top_p=chat.top_p,
        repetition_penalty=chat.repetition_penalty,
        seed=chat.seed,
        stop=chat.stop,
    )


def api_error(exc: Exception) -> ApiError:
    """The HTTP error for what went wrong in the runtime or the engine."""
    if isinstance(exc, ShuttingDown):
        return ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
    if isinstance(exc, ContextOverflow):
        param = "max_tokens" if exc.cause == "reply" else "messages"
        return ApiError(400, str(exc), param=param, code="context_length_exceeded")
    if isinstance(exc, KvedgeError):  # e.g. the chat template refuses the conversation
        return ApiError(400, str(exc), param="messages", code="invalid_conversation")
    return ApiError(500, "internal error while generating", type="server_error")


class Reply:
    """Turns a job's events into the OpenAI response: one JSON body, or SSE chunks."""

    def __init__(self, id: str, model: str, prompt_tokens: int, include_usage: bool) -> None:
        self.id, self.model, self.prompt_tokens, self.include_usage = id, model, prompt_tokens, include_usage

    def usage(self, final: Event) -> dict[str, int]:
        return protocol.usage(self.prompt_tokens, final.completion_tokens)

    async def collect(self, events: asyncio.Queue[Event], request: Request) -> Response:
        """Wait for the whole reply, or give up as soon as the client disconnects."""
        result = asyncio.ensure_future(self._gather(events))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            result.cancel()
        if not result.done() or result.cancelled():
            return Response(status_code=499)  # nobody reads it: the client is gone
        text, final = result.result()
        if final.error is not None:
            return error_response(api_error(final.error))
        body = protocol.completion_body(self.id, self.model, text, final.finish_reason, self.usage(final))
        return JSONResponse(body)

    async def _gather(self, events: asyncio.Queue[Event]) -> tuple[str, Event]:
        parts = []
        while True:
            item = await events.get()
            parts.append(item.text)
            if item.finish_reason is not None:
                return "".join(parts), item

    async def stream(self, events: asyncio.Queue[Event]) -> AsyncIterator[str]:
        yield sse(protocol.chunk_body(self.id, self.model, {"role": "assistant", "content": ""}))
        while True:
            item = await events.get()
            if item.error is not None:
                yield sse(api_error(item.error).body())
                break
            if item.text:
                yield sse(protocol.chunk_body(self.id, self.model, {"content": item.text}))
            if item.finish_reason is not None:
                usage = self.usage(item)
                yield sse(
                    protocol.chunk_body(
                        self.id, self.model, {}, item.finish_reason, None if self.include_usage else usage
                    )
                )
                if self.include_usage:
                    yield sse(protocol.chunk_body(self.id, self.model, {}, usage=usage, choices=False))
                break
        yield sse("[DONE]")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
