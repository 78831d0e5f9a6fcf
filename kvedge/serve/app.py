"""HTTP front of `kvedge serve`: a Starlette app run by uvicorn, in front of one `Scheduler`.

Routes::

    POST /v1/chat/completions   OpenAI chat completions, JSON or `stream: true` server-sent events
    GET  /v1/models[/{id}]      the one served model, with its `warm_prefixes`: [{name, messages}]
                                (or {name, text}), what a conversation starts with to reuse their KV
    GET  /health                200 {"status": "ready"} after load and warm-up, else 503 with the state
    GET  /metrics               Prometheus text (see metrics.py)
    GET  /, /ui/<file>          the chat page, when the `ui` setting is on (kvedge/serve/ui/)

With an API key configured every route but /health and the (static) chat page needs
`Authorization: Bearer <key>`. Every route answers only to a Host header naming this service
(`HostCheck`), JSON bodies must say `Content-Type: application/json`, and no CORS header is sent
unless `cors_origins` lists origins: so a web page in the device's own browser can neither post
to the API as a "simple" cross-origin request nor read it through DNS rebinding.
A json_schema response_format whose schema has parts the spec says to ignore (unknown formats), or
that `lenient_schemas` let through unenforced, gets `X-Kvedge-Schema-Ignored: format=url, ...`
on its reply and one log line (kvedge.runtime.json_schema).
Usage counts carry `prompt_tokens_details.cached_tokens`: the prompt tokens taken from the slot
or a stored prefix instead of being prefilled.
Handlers run on the event loop and never touch onnxruntime: they validate the body, render and
count the prompt (tokenizer only, in a worker thread), submit a `Job` and relay its events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import ipaddress
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvedge.configs import load_warm_prefix_config
from kvedge.errors import ContextOverflow, KvedgeError, ModelFault
from kvedge.runtime.model import Constraint, Event, Model, SamplingConfig
from kvedge.runtime.sampling import SAMPLING_BOUNDS
from kvedge.serve import protocol, tools, ui
from kvedge.serve.config import ServiceConfig
from kvedge.serve.metrics import Metrics
from kvedge.serve.protocol import ApiError, ChatRequest, CompletionRequest
from kvedge.serve.scheduler import Job, NotReady, QueueFull, Scheduler, ShuttingDown

log = logging.getLogger(__name__)
SCHEMA_IGNORED = "X-Kvedge-Schema-Ignored"  # what of a response_format schema is not enforced

Handler = Callable[[Request], Awaitable[Response]]


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class EventStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends: finished, failed or client gone.
    Its status line says 200 before the reply exists; what it came to is the `Reply`'s `status`,
    which `on_close` logs and counts."""

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


def create_app(config: ServiceConfig, scheduler: Scheduler, metrics: Metrics) -> Starlette:
    api = Api(config, scheduler, metrics)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        scheduler.start()
        yield
        await run_in_threadpool(scheduler.stop)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, str(exc.detail), code=code))

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(ApiError(500, "internal server error", type="server_error"))

    middleware = [Middleware(HostCheck, names=host_names(config))]
    if config.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            )
        )
    return Starlette(
        routes=api.routes() + (ui.routes() if config.ui else []),
        lifespan=lifespan,
        middleware=middleware,
        exception_handlers={HTTPException: http_error, Exception: internal_error},
    )


def host_names(config: ServiceConfig) -> frozenset[str]:
    """Host names (lower case) a request may name beside loopback names and IP addresses: the
    configured host, `allowed_hosts`, and for a wildcard bind (0.0.0.0, ::) this machine's name."""
    names = {config.host.lower(), *(name.lower().rstrip(".") for name in config.allowed_hosts)}
    if config.host in ("0.0.0.0", "::"):
        hostname = socket.gethostname().lower()
        names |= {hostname, f"{hostname}.local"}
    return frozenset(names)


def host_allowed(header: str, names: frozenset[str]) -> bool:
    """Whether a Host header ("name", "name:port", "[v6]:port") names this service: a loopback
    name, an IP address (DNS rebinding always sends a domain: the attacker's), or one of `names`."""
    if "*" in names or not header:  # no Host: HTTP/1.0, never a browser
        return True
    if header.startswith("["):
        name = header[1 : header.find("]")] if "]" in header else header
    else:
        name = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    name = name.lower().rstrip(".")
    if name == "localhost" or name in names:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostCheck:
    """ASGI middleware: 400 to a request whose Host header names no address of this service. A
    page on another site that points its own name at 127.0.0.1 (DNS rebinding) is same-origin to
    the browser, which would let it read replies, /v1/models and /metrics; its Host header still
    carries its name."""

    def __init__(self, app: Any, names: frozenset[str]) -> None:
        self.app, self.names = app, names

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not host_allowed(host, self.names):
                log.info("refused a request for Host %r (allowed_hosts)", host)
                error = ApiError(
                    400,
                    f"Host {host!r} is not a name of this service; allowed: loopback names, IP "
                    "addresses and the names in the service's allowed_hosts",
                    code="invalid_host",
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Api:
    """The routes' handlers, in front of one scheduler: they validate, tokenize (in a worker
    thread), submit a `Job` and relay its events; they never touch onnxruntime."""

    def __init__(self, config: ServiceConfig, scheduler: Scheduler, metrics: Metrics) -> None:
        self.config, self.scheduler, self.metrics = config, scheduler, metrics
        self.model_card = {
            "id": config.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "kvedge",
            "warm_prefixes": warm_prefix_cards(config),
            # what a request that leaves them out samples with (the chat page shows them)
            "sampling_defaults": config.sampling_defaults,
        }

    def routes(self) -> list[Route]:
        protected, counted = self.protected, self.counted
        return [
            Route("/v1/chat/completions", protected(counted(self.chat_completions)), methods=["POST"]),
            Route("/v1/completions", protected(counted(self.completions)), methods=["POST"]),
            Route("/v1/models", protected(self.list_models), methods=["GET"]),
            Route("/v1/models/{name:path}", protected(self.get_model), methods=["GET"]),
            Route("/metrics", protected(self.metrics_text), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]

    def protected(self, handler: Handler) -> Handler:
        """`handler` behind the API key, with its ApiErrors turned into error bodies."""
        key = self.config.api_key

        async def checked(request: Request) -> Response:
            if key is not None:
                scheme, _, token = request.headers.get("authorization", "").partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(
                    token.strip().encode(), key.encode()
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

    def counted(self, handler: Handler) -> Handler:
        """`handler` with its response status counted in /metrics and refusals logged (a
        stream's, when it ends: `respond`)."""

        async def respond(request: Request) -> Response:
            try:
                response = await handler(request)
            except ApiError as error:
                response = error_response(error)
                log.info("%s %d %s: %s", request.url.path, error.status, error.code, error.message)
            if not isinstance(response, EventStream):
                self.metrics.response(response.status_code)
            return response

        return respond

    async def health(self, request: Request) -> Response:
        state = self.scheduler.state
        return JSONResponse({"status": state}, status_code=200 if state == "ready" else 503)

    async def metrics_text(self, request: Request) -> Response:
        text = self.metrics.render(self.scheduler.gauges())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card]})

    async def get_model(self, request: Request) -> Response:
        if request.path_params["name"] != self.config.model_name:
            raise ApiError(404, "no such model", param="model", code="model_not_found")
        return JSONResponse(self.model_card)

    def ready_model(self) -> Model:
        model = self.scheduler.model
        if self.scheduler.state != "ready" or model is None:
            raise _not_ready(self.scheduler.state)
        return model

    async def chat_completions(self, request: Request) -> Response:
        config = self.config
        chat = protocol.parse_chat_request(
            await read_json(request, config.max_body_bytes, config.body_timeout_s)
        )
        model = self.ready_model()
        template = model.tokenizer.template_source
        check_limits(config, chat.max_tokens, len(chat.messages))
        encode = functools.partial(model.tokenizer.encode, add_special_tokens=False)
        tool_fmt = tools.format_for(template, encode)
        ids, constraint, ignored = await self.prompt(model, chat, tool_fmt)
        try:
            max_new = model.fit_reply(
                len(ids), chat.max_tokens, config.default_max_tokens, config.reply_overflow
            )
        except KvedgeError as exc:
            raise api_error(exc) from None
        job, events = self.submit(
            ids,
            sampling_config(
                chat,
                max_new,
                constraint,
                chat.logprobs,
                config.speculate,
                config.sampling_defaults,
                config.draft is not None,
            ),
        )
        parser = tools.ReplyParser(chat.tool_choice != "none", tools.THINK_OPEN in template, tool_fmt)
        tokenizer = model.tokenizer if chat.logprobs is not None else None
        reply = ChatReply(
            protocol.completion_id(), config.model_name, len(ids), chat.include_usage, parser, tokenizer
        )
        response = await self.respond(request, job, events, reply, chat.stream)
        if ignored:
            response.headers[SCHEMA_IGNORED] = ", ".join(ignored)
        return response

    async def prompt(
        self, model: Model, chat: ChatRequest, tool_fmt: tools.ToolFormat | None
    ) -> tuple[list[int], Constraint | None, tuple[str, ...]]:
        """The conversation's token ids (tools rendered the template's way, within
        max_prompt_tokens), the reply's constraint, compiled now so that a schema llguidance
        cannot take is a 400 before the request is queued, and what of its schema is not enforced."""
        if tool_fmt is None:
            if chat.tools:
                raise ApiError(
                    400,
                    "this model's chat template writes tool calls in a format kvedge does not read yet "
                    "(it reads Hermes <tool_call> blocks: Qwen2.5, Qwen3; Llama 3.1+ JSON calls; "
                    "Mistral [TOOL_CALLS] lists; and templates without tools)",
                    param="tools",
                    code="unsupported_parameter",
                )
            tool_fmt = tools.Hermes("fallback")  # no tools: the history's calls as plain blocks
        messages, template_tools = tool_fmt.prompt(list(chat.messages), chat.tools)
        requested = self.config.default_max_tokens if chat.max_tokens is None else chat.max_tokens
        encode = functools.partial(
            model.encode_chat,
            messages,
            requested,
            template_tools,
            limit=self.config.max_prompt_tokens,
            **chat.template_kwargs,
        )
        try:
            ids = await run_in_threadpool(encode)
        except KvedgeError as exc:
            raise api_error(exc) from None
        constraint = chat.constraint or tool_fmt.constraint(
            chat.tools, chat.tool_choice, chat.parallel_tool_calls
        )
        if constraint is not None and constraint.kind == "json_schema" and self.config.lenient_schemas:
            constraint = dataclasses.replace(constraint, lenient=True)
        try:
            compiled = (
                None if constraint is None else await run_in_threadpool(model.grammars.compile, constraint)
            )
        except KvedgeError as exc:
            raise api_error(exc, "response_format" if chat.constraint else "tools") from None
        ignored = () if compiled is None else compiled.ignored
        if ignored:
            log.info("response_format schema: not enforced: %s", ", ".join(ignored))
        return ids, constraint, ignored

    async def completions(self, request: Request) -> Response:
        config = self.config
        body = protocol.parse_completion_request(
            await read_json(request, config.max_body_bytes, config.body_timeout_s)
        )
        model = self.ready_model()
        check_limits(config, body.max_tokens, 1)
        try:
            ids = await run_in_threadpool(model.encode_prompt, body.prompt, config.max_prompt_tokens)
            max_new = model.fit_reply(
                len(ids), body.max_tokens, config.default_max_tokens, config.reply_overflow
            )
        except KvedgeError as exc:
            raise api_error(exc, "prompt") from None
        job, events = self.submit(
            ids,
            sampling_config(
                body,
                max_new,
                None,
                body.logprobs,
                config.speculate,
                config.sampling_defaults,
                config.draft is not None,
            ),
        )
        tokenizer = model.tokenizer if body.logprobs is not None else None
        reply = TextReply(
            protocol.completion_id("cmpl-"), config.model_name, len(ids), body.include_usage, tokenizer
        )
        return await self.respond(request, job, events, reply, body.stream)

    def submit(self, ids: list[int], sampling: SamplingConfig) -> tuple[Job, asyncio.Queue[Event]]:
        """Queue a job; its events arrive on the returned queue (from the scheduler thread)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        model = self.scheduler.model
        disk = None if model is None else model.prefixes.disk
        waiting: set[asyncio.Task] = set()  # held until done: the loop keeps only weak references

        async def after_files(item: Event) -> None:
            # the turn's prefix files, queued as it ended, are on disk before the reply's end goes
            # out: a service killed right after a reply answers the next turn from them. The
            # writer thread writes them; this request waits, not the scheduler.
            await asyncio.to_thread(disk.wait_written)
            events.put_nowait(item)

        def deliver(item: Event) -> None:
            try:
                if disk is not None and item.finish_reason is not None:
                    loop.call_soon_threadsafe(lambda: _hold(waiting, loop.create_task(after_files(item))))
                    return
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the event loop is gone: nobody is listening any more
                pass

        job = Job(ids=ids, config=sampling, deliver=deliver)
        try:
            self.scheduler.submit(job)
        except QueueFull as full:
            raise ApiError(
                429,
                f"all {self.config.slots} slots are busy and the queue is full; "
                f"retry after {full.retry_after_s} s",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(full.retry_after_s)},
            ) from None
        except NotReady as not_ready:
            raise _not_ready(not_ready.state) from None
        return job, events

    async def respond(
        self, request: Request, job: Job, events: asyncio.Queue[Event], reply: Reply, stream: bool
    ) -> Response:
        """The reply streamed or whole; however it ends, the job is cancelled and logged."""
        if stream:

            def closed() -> None:
                self.scheduler.cancel(job)
                self.metrics.response(reply.status)
                log_request(request, reply.status, job)

            return EventStream(reply.stream(events), on_close=closed)
        status = 499
        try:
            response = await reply.collect(events, request)
            status = response.status_code
            return response
        finally:
            self.scheduler.cancel(job)
            log_request(request, status, job)


def warm_prefix_cards(config: ServiceConfig) -> list[dict[str, Any]]:
    """The warm prefixes the service loads before ready, as a client starts a conversation that
    reuses one: its chat messages (or raw text, for /v1/completions). The chat page offers them
    by name."""
    if config.warm_prefixes is None:
        return []
    cards = []
    for spec in load_warm_prefix_config(config.warm_prefixes).prefixes:
        if spec.messages is None:
            cards.append({"name": spec.name, "text": spec.text})
        else:
            messages = [{"role": m.role, "content": m.content} for m in spec.messages]
            cards.append({"name": spec.name, "messages": messages})
    return cards


def log_request(request: Request, status: int, job: Job) -> None:
    """One line per request that reached the scheduler: status, tokens, time to first token."""
    now = time.monotonic()
    ttft = "-" if job.first_token_at is None else f"{job.first_token_at - job.submitted:.3f} s"
    log.info(
        "%s %d: %d prompt + %d completion tokens, TTFT %s, %.2f s",
        request.url.path,
        status,
        len(job.ids),
        job.produced,
        ttft,
        now - job.submitted,
    )


def _not_ready(state: str) -> ApiError:
    return ApiError(
        503,
        f"the model is not ready (state: {state}); poll /health",
        type="server_error",
        code="not_ready",
        headers={"Retry-After": "1"},
    )


def check_limits(config: ServiceConfig, max_tokens: int | None, messages: int) -> None:
    """The service's bounds on one request's work, whatever the history policy (the prompt's
    token bound is checked where it is counted)."""
    if max_tokens is not None and max_tokens > config.max_reply_tokens:
        raise ApiError(
            400,
            f"max_tokens is {max_tokens}; this server allows at most {config.max_reply_tokens} "
            "(max_reply_tokens)",
            param="max_tokens",
            code="invalid_value",
        )
    if messages > config.max_messages:
        raise ApiError(
            400,
            f"the request has {messages} messages; this server allows at most {config.max_messages} "
            "(max_messages)",
            param="messages",
            code="invalid_value",
        )


async def read_body(request: Request, limit: int) -> bytearray:
    """The request body, refusing it (413) as soon as more than `limit` bytes have arrived."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body is larger than {limit} bytes", code="body_too_large")
    return body


async def read_json(request: Request, limit: int, timeout_s: float) -> Any:
    """The request body as JSON, refusing another content type (a cross-origin page may post
    text/plain without asking the browser's CORS preflight: 415), more than `limit` bytes before
    reading them all, and a body that takes more than `timeout_s` to arrive (a slow client holds
    a connection, nothing more: 408, and the connection is closed)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(
            415,
            f"Content-Type is {media or 'missing'!r}; this endpoint takes application/json "
            "(curl: -H 'Content-Type: application/json')",
            code="unsupported_media_type",
        )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body is larger than {limit} bytes", code="body_too_large")
    try:  # wait_for, not asyncio.timeout: that exists from Python 3.11, JetPack 6 runs 3.10
        body = await asyncio.wait_for(read_body(request, limit), timeout_s)
    except asyncio.TimeoutError:  # the builtin TimeoutError from 3.11 on; a distinct class on 3.10
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout_s:g} s (body_timeout_s)",
            code="body_timeout",
            headers={"Connection": "close"},
        ) from None
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


def sampling_config(
    request: ChatRequest | CompletionRequest,
    max_new_tokens: int,
    constraint: Constraint | None,
    logprobs: int | None,
    speculate: str = "off",  # the service's default; the request's field wins
    defaults: Mapping[str, float] | None = None,  # `ServiceConfig.sampling_defaults`, likewise
    drafted: bool = False,  # the service loaded a draft model (`ServiceConfig.draft`)
) -> SamplingConfig:
    """A request's sampling: its own fields, else the service's defaults."""
    given = {name: getattr(request, name) for name in SAMPLING_BOUNDS if getattr(request, name) is not None}
    return SamplingConfig(
        max_new_tokens=max_new_tokens,
        **{**(defaults or {}), **given},
        seed=request.seed,
        stop=request.stop,
        constraint=constraint,
        logprobs=logprobs,
        speculate=speculate_mode(request.speculate, speculate, drafted),
    )


def speculate_mode(requested: str | None, service: str, drafted: bool = False) -> str:
    """The speculate mode a request runs with: its own, else the service's (`ServiceConfig`).
    "draft" is the draft model the service loaded at start (`drafted`); asking for it where none
    was loaded is refused (400)."""
    if requested is None:
        return service
    if requested != "draft" or drafted:
        return requested
    raise ApiError(
        400,
        f"speculate={requested!r} is not allowed: this service loaded no draft model; "
        "allowed: ['off', 'lookup']",
        param="speculate",
        code="invalid_value",
    )


def api_error(exc: Exception, param: str = "messages") -> ApiError:
    """The HTTP error for what went wrong in the runtime or the scheduler; `param`: the request
    field a plain KvedgeError is about."""
    if isinstance(exc, ShuttingDown):
        return ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
    if isinstance(exc, ModelFault):  # the model's fault, not the request's: the details are logged
        return ApiError(
            500,
            "the model failed while generating this reply (logged); other requests are unaffected",
            type="server_error",
            code="generation_failed",
        )
    if isinstance(exc, ContextOverflow):
        field = "max_tokens" if exc.cause == "reply" else ("prompt" if param == "prompt" else "messages")
        return ApiError(400, str(exc), param=field, code="context_length_exceeded")
    if isinstance(exc, KvedgeError):  # the chat template refuses the conversation, a bad schema...
        code = "invalid_conversation" if param == "messages" else "invalid_value"
        return ApiError(400, str(exc), param=param, code=code)
    return ApiError(500, "internal error while generating", type="server_error")


class Reply:
    """Turns a job's events into an OpenAI response: one JSON body, or SSE chunks."""

    def __init__(self, id: str, model: str, prompt_tokens: int, include_usage: bool, tokenizer: Any) -> None:
        self.id, self.model, self.prompt_tokens, self.include_usage = id, model, prompt_tokens, include_usage
        self.tokenizer = tokenizer  # set when log probabilities were asked for
        self.status = 499  # what a stream came to: 200 when whole, an error's status, 499 while unread

    def usage(self, final: Event) -> dict[str, Any]:
        return protocol.usage(self.prompt_tokens, final.completion_tokens, final.cached_tokens)

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
        seen, final = result.result()
        if final.error is not None:
            return error_response(api_error(final.error))
        return JSONResponse(self.body(seen, final))

    async def _gather(self, events: asyncio.Queue[Event]) -> tuple[list[Event], Event]:
        seen = []
        while True:
            item = await events.get()
            seen.append(item)
            if item.finish_reason is not None:
                return seen, item

    async def stream(self, events: asyncio.Queue[Event]) -> AsyncIterator[str]:
        for chunk in self.opening():
            yield sse(chunk)
        while True:
            item = await events.get()
            if item.error is not None:
                error = api_error(item.error)
                yield sse(error.body())
                self.status = error.status
                break
            for chunk in self.chunks(item):
                yield sse(chunk)
            if item.finish_reason is not None:
                if self.include_usage:
                    yield sse(self.usage_chunk(self.usage(item)))
                self.status = 200
                break
        yield sse("[DONE]")

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def opening(self) -> list[dict[str, Any]]:
        return []

    def body(self, events: list[Event], final: Event) -> dict[str, Any]:
        raise NotImplementedError

    def chunks(self, event: Event) -> list[dict[str, Any]]:
        raise NotImplementedError

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


class ChatReply(Reply):
    """A chat completion: content, reasoning and tool calls as `tools.ReplyParser` reads them."""

    def __init__(self, id, model, prompt_tokens, include_usage, parser: tools.ReplyParser, tokenizer) -> None:
        super().__init__(id, model, prompt_tokens, include_usage, tokenizer)
        self.parser = parser

    def logprobs(self, event: Event) -> list[dict[str, Any]] | None:
        if self.tokenizer is None:
            return None
        if event.logprob is None or event.token is None:
            return []
        top = [(self.token_text(t), p) for t, p in event.top_logprobs]
        return [protocol.token_logprob(self.token_text(event.token), event.logprob, top)]

    def finish(self, event: Event) -> tuple[list[dict[str, Any]], str]:
        """The last deltas and the finish reason ("tool_calls" when the reply is calls)."""
        deltas, calls = self.parser.finish(cut=event.finish_reason == "length")
        return deltas, "tool_calls" if calls and event.finish_reason == "stop" else event.finish_reason

    def opening(self) -> list[dict[str, Any]]:
        return [protocol.chunk_body(self.id, self.model, {"role": "assistant", "content": ""})]

    def chunks(self, event: Event) -> list[dict[str, Any]]:
        deltas = self.parser.push(event.text)
        logprobs = self.logprobs(event)
        finish = None
        if event.finish_reason is not None:
            last, finish = self.finish(event)
            deltas += last
        chunks = [protocol.chunk_body(self.id, self.model, d) for d in deltas]
        if logprobs:  # on the event's first chunk, or a chunk of its own when the text is held back
            if not chunks:
                chunks.append(protocol.chunk_body(self.id, self.model, {}))
            chunks[0]["choices"][0]["logprobs"] = {"content": logprobs}
        if finish is not None:
            usage = None if self.include_usage else self.usage(event)
            chunks.append(protocol.chunk_body(self.id, self.model, {}, finish, usage))
        return chunks

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return protocol.chunk_body(self.id, self.model, {}, usage=usage, choices=False)

    def body(self, events: list[Event], final: Event) -> dict[str, Any]:
        deltas = [d for e in events for d in self.parser.push(e.text)]
        last, finish = self.finish(final)
        message = merge_deltas(deltas + last)
        logprobs = None if self.tokenizer is None else [x for e in events for x in self.logprobs(e) or []]
        return protocol.completion_body(self.id, self.model, message, finish, self.usage(final), logprobs)


def merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The message that streamed `deltas` add up to (what an OpenAI client reassembles)."""
    message: dict[str, Any] = {"content": None}
    for delta in deltas:
        for key in ("content", "reasoning_content"):
            if key in delta:
                message[key] = (message.get(key) or "") + delta[key]
        if "tool_calls" in delta:
            message.setdefault("tool_calls", []).extend(
                {k: v for k, v in call.items() if k != "index"} for call in delta["tool_calls"]
            )
    if message["content"] is None and "tool_calls" not in message:
        message["content"] = ""
    return message


class TextReply(Reply):
    """A `/v1/completions` text completion."""

    def logprobs(self, events: list[Event]) -> dict[str, Any] | None:
        if self.tokenizer is None:
            return None
        entries = [e for e in events if e.logprob is not None and e.token is not None]
        tokens = [self.token_text(e.token) for e in entries]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.token_text(t): p for t, p in e.top_logprobs} for e in entries],
            "text_offset": offsets,
        }

    def chunks(self, event: Event) -> list[dict[str, Any]]:
        usage = None
        if event.finish_reason is not None and not self.include_usage:
            usage = self.usage(event)
        body = protocol.text_completion_body(
            self.id, self.model, event.text, event.finish_reason, usage, self.logprobs([event])
        )
        return (
            [body] if event.text or event.finish_reason is not None or body["choices"][0]["logprobs"] else []
        )

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        body = protocol.text_completion_body(self.id, self.model, "", None, usage)
        body["choices"] = []
        return body

    def body(self, events: list[Event], final: Event) -> dict[str, Any]:
        text = "".join(e.text for e in events)
        return protocol.text_completion_body(
            self.id, self.model, text, final.finish_reason, self.usage(final), self.logprobs(events)
        )


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _hold(tasks: set[asyncio.Task], task: asyncio.Task) -> None:
    """Keep `task` referenced until it is done."""
    tasks.add(task)
    task.add_done_callback(tasks.discard)
