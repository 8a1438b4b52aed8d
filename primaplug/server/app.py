"""The OpenAI-compatible HTTP server in front of a primaplug.Llama: llama-cpp-python's API, many requests at once.

llama-cpp-python's own server (llama_cpp.server.app) serves one request at a time: its `get_llama_proxy` dependency
holds a lock for the whole of each request, and its stream publisher stops a stream when another request arrives
(interrupt_requests) and ends it without a word when generation raises. A ring serves `llm.n_parallel` requests at
once, so this app owns the routes that generate (completions, chat completions, embeddings) and keeps the rest of
llama-cpp-python's server as it is:

- its request and response types (llama_cpp.server.types), and the same keyword arguments to the Llama for the same
  request, so the same request gives the same answer;
- its `prepare_request_resources` (logit_bias, grammar, min_tokens), its `authenticate` dependency (the bearer API
  key of its ServerSettings) and its OpenAI-style errors (RouteErrorHandler's messages: a prompt longer than the
  context is a 400), with primaplug's given their status (a node that stopped answering: 503);
- its other routes (/v1/models, /extras/tokenize, /extras/tokenize/count, /extras/detokenize), mounted as they are,
  with its two module-level dependencies (`get_server_settings`, `get_llama_proxy`) replaced through FastAPI's
  dependency overrides: no module state is touched, so several apps (and llama-cpp-python's own) share a process.

Each request runs in a worker thread of its own from before it waits for a sequence until it ends, so a stream's
chunks all come from one thread and the event loop never waits on the ring. Needs `pip install primaplug[server]`.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from functools import partial
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import llama_cpp
import llama_cpp.server.app as llama_server
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware import Middleware
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from llama_cpp.server.errors import RouteErrorHandler
from llama_cpp.server.settings import ServerSettings
from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest, CreateEmbeddingRequest
from sse_starlette.sse import EventSourceResponse
from starlette_context.middleware import RawContextMiddleware
from starlette_context.plugins import RequestIdPlugin

from primaplug import __version__
from primaplug.core.errors import ConfigError, NodeError, NodeUnavailableError, PrimaplugError, SchemaError
from primaplug.server.metrics import Metrics, NodeFigures, RingFigures
from primaplug.server.metrics import Request as Measured
from primaplug.server.settings import ServeSettings, worker_threads

log = logging.getLogger(__name__)

_DEFAULTS = ServeSettings()
# the request fields llama-cpp-python's handlers leave out of the Llama call (llama_cpp.server.app)
COMPLETION_EXCLUDE = frozenset({"n", "best_of", "logit_bias_type", "user", "min_tokens"})
CHAT_EXCLUDE = frozenset({"n", "logit_bias_type", "user", "min_tokens"})
# llama-cpp-python's routes mounted as they are: none of them generates, so none needs a sequence
BORROWED = frozenset({"/v1/models", "/extras/tokenize", "/extras/tokenize/count", "/extras/detokenize"})
STREAM_BUFFER = 16  # chunks a stream may run ahead of its client
DISCONNECT_POLL_S = 0.1  # how often a request that is not streamed checks that its client is still there
# a problem found with the ring stands this long before the nodes are asked again: asking a silent node takes a
# second, and the requests that come meanwhile are refused at once; "ready" is never taken on trust
PROBLEM_STANDS_S = 1.0
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def create_app(llm: Any, *, alias: str, api_key: str | None = None,
               interrupt_requests: bool = _DEFAULTS.interrupt_requests) -> FastAPI:
    """A FastAPI app serving `llm` (a primaplug.Llama) under the model name `alias`.

    api_key: when given, /v1, /extras and /metrics need it as a bearer token (llama-cpp-python's `authenticate`);
        /health needs none.
    interrupt_requests: stop a stream when another request is waiting for a sequence (llama-cpp-python's setting,
        off here: see primaplug/server/settings.py).
    """
    if api_key == "":
        raise ConfigError("the API key is empty: give a key, or none to serve without one")
    # model_validate, not ServerSettings(...): a BaseSettings built by its constructor also reads the environment
    # (API_KEY, HOST, ...), which would turn an unrelated variable into this server's key
    settings = ServerSettings.model_validate({"api_key": api_key, "interrupt_requests": interrupt_requests})
    ring = RingServer(llm, alias, interrupt_requests=interrupt_requests)

    app = FastAPI(title="primaplug: llama-cpp-python's OpenAI-compatible API over a ring", version=__version__,
                  middleware=[Middleware(RawContextMiddleware, plugins=(RequestIdPlugin(),))])
    # as llama-cpp-python's create_app: browsers may call the API from any page (the API key still applies)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"],
                       allow_headers=["*"])
    app.dependency_overrides[llama_server.get_server_settings] = lambda: settings
    app.dependency_overrides[llama_server.get_llama_proxy] = lambda: ring.proxy
    app.include_router(ring.router())
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.include_router(APIRouter(routes=[r for r in llama_server.router.routes if getattr(r, "path", "") in BORROWED]))
    return app


class OneModel:
    """What llama-cpp-python's routes ask of its `get_llama_proxy` dependency: the model by name (one ring, whatever
    name a request gives, as its LlamaProxy does with one model) and the names to list."""

    def __init__(self, llm: Any, alias: str) -> None:
        self.llm, self.alias = llm, alias

    def __call__(self, model: str | None = None) -> Any:
        return self.llm

    def __iter__(self) -> Iterator[str]:
        return iter([self.alias])


class _Route(APIRoute):
    """FastAPI's route with llama-cpp-python's `openai-processing-ms` header. Not its RouteErrorHandler, which
    turns a request that does not validate into a 500 (and fails on a body that is not JSON): the handlers here
    answer their own errors, and a request that does not validate gets a 400 (`_invalid_request`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def timed(request: Request) -> Response:
            t0 = time.perf_counter()
            if request.url.path.endswith("/chat/completions"):
                await _structured_outputs(request)
            response = await handler(request)
            response.headers["openai-processing-ms"] = f"{int((time.perf_counter() - t0) * 1000)}"
            return response

        return timed


async def _structured_outputs(request: Request) -> None:
    """OpenAI's Structured Outputs, which llama-cpp-python's request type refuses: a `json_schema` response format is
    kept aside (request.state.json_schema) and the body validated with JSON mode in its place; the handler gives the
    Llama the original, which turns it into a grammar or refuses it naming the part (engine/structured.py: a 400)."""
    raw = await request.body()
    if b"json_schema" not in raw:  # most requests: parsed once, by the validation
        return
    try:
        body = json.loads(raw)
    except ValueError:
        return  # not JSON: the validation says so
    if isinstance(body, dict) and isinstance(body.get("response_format"), dict) and \
            body["response_format"].get("type") == "json_schema":
        request.state.json_schema = body["response_format"]
        request._body = json.dumps(body | {"response_format": {"type": "json_object"}}).encode()


async def _invalid_request(request: Request, exc: Exception) -> JSONResponse:
    """A request body that does not validate, in OpenAI's words (400, invalid_request_error)."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    what = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg', '')}" for e in errors)
    return JSONResponse({"error": _error(f"invalid request: {what or exc}", "invalid_request_error", None)},
                        status_code=400)


# NodeError codes that say the ring cannot serve now, not that the request was wrong: a re-forming that failed, nodes
# another head took over (head/recovery.py), a node another head holds
RING_DOWN = ("reform_failed", "taken", "held")


def openai_error(error: BaseException, body: Any = None) -> tuple[int, dict[str, Any]]:
    """The HTTP status and the OpenAI-style error object (message, type, param, code) for an exception."""
    if isinstance(error, NodeUnavailableError):
        return 503, _error(f"{error}. The ring cannot serve until every node answers; GET /health says when it can "
                           "again", "unavailable_error", "node_unavailable")
    if isinstance(error, NodeError) and error.code in RING_DOWN:
        return 503, _error(f"{error}. GET /health says when the ring serves again", "unavailable_error",
                           f"ring_{error.code}")
    if isinstance(error, NodeError):
        return 500, _error(str(error), "internal_server_error", f"node_{error.code}")
    if isinstance(error, SchemaError):
        return 400, _error(str(error), "invalid_request_error", "invalid_json_schema") | {"param": "response_format"}
    if isinstance(error, PrimaplugError):
        code = re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower()  # ConfigError: config_error
        return 500, _error(str(error), "internal_server_error", code)
    if isinstance(body, CreateCompletionRequest | CreateChatCompletionRequest):
        # llama-cpp-python's own messages for its own errors (a prompt longer than the context: a 400)
        for pattern, formatter in RouteErrorHandler.pattern_and_formatters.items():
            match = pattern.search(str(error))
            if match is not None:
                return formatter(body, match)
    log.error("request failed", exc_info=error)
    return 500, _error(str(error) or type(error).__name__, "internal_server_error", None)


def _error(message: str, kind: str, code: str | None) -> dict[str, Any]:
    return {"message": message, "type": kind, "param": None, "code": code}


def _failed(error: Exception, body: Any) -> JSONResponse:
    status, content = openai_error(error, body)
    return JSONResponse({"error": content}, status_code=status)


def _unavailable(problem: str) -> JSONResponse:
    return JSONResponse({"error": _error(f"no ring is ready: {problem}", "unavailable_error", "ring_not_ready")},
                        status_code=503)


def _outcome(error: BaseException) -> str:
    return "unavailable" if openai_error(error)[0] == 503 else "error"


class RingServer:
    """The routes that generate, /health and /metrics, over one primaplug.Llama."""

    def __init__(self, llm: Any, alias: str, *, interrupt_requests: bool) -> None:
        self.llm, self.alias = llm, alias
        self.proxy = OneModel(llm, alias)
        self.interrupt_requests = interrupt_requests
        self.metrics = Metrics()
        # requests: one thread each for their whole life; probes (ring_problem, the nodes' metrics) apart, so that
        # /health answers at once even when every request thread waits for a sequence
        self.limiter = anyio.CapacityLimiter(worker_threads(llm.n_parallel))
        self.probes = anyio.CapacityLimiter(4)
        self._problem: tuple[float, str] | None = None  # (when, what) the ring was last found not ready

    async def problem(self) -> str | None:
        """None when the ring is ready (every node asked); else what is wrong."""
        known = self._problem
        if known is not None and time.monotonic() - known[0] < PROBLEM_STANDS_S:
            return known[1]
        found = await anyio.to_thread.run_sync(self.llm.ring_problem, limiter=self.probes)
        self._problem = (time.monotonic(), found) if found is not None else None
        return found

    def failed(self, error: BaseException) -> None:
        """A request failed: a node that stopped answering is what the next requests are told at once."""
        if isinstance(error, NodeUnavailableError):
            self._problem = (time.monotonic(), str(error))

    def router(self) -> APIRouter:
        auth = [Depends(llama_server.authenticate)]
        r = APIRouter(route_class=_Route)

        async def create_completion(request: Request, body: CreateCompletionRequest) -> Any:
            if isinstance(body.prompt, list):
                if len(body.prompt) > 1:
                    return JSONResponse({"error": _error(
                        f"one prompt per request, as in llama-cpp-python's server; got {len(body.prompt)}: send "
                        "them as separate requests (they run at once)", "invalid_request_error", None)}, 400)
                body.prompt = body.prompt[0] if body.prompt else ""
            copilot = request.url.path == "/v1/engines/copilot-codex/completions"
            kwargs = body.model_dump(exclude=COMPLETION_EXCLUDE)
            return await self.generate(request, body, "copilot-codex" if copilot else body.model, kwargs,
                                       "completions", self.llm.create_completion)

        async def create_chat_completion(request: Request, body: CreateChatCompletionRequest) -> Any:
            kwargs = body.model_dump(exclude=CHAT_EXCLUDE)
            if hasattr(request.state, "json_schema"):  # Structured Outputs, as the client sent them
                kwargs["response_format"] = request.state.json_schema
            return await self.generate(request, body, body.model, kwargs, "chat_completions",
                                       self.llm.create_chat_completion)

        async def create_embedding(body: CreateEmbeddingRequest) -> Any:
            return await self.embed(body)

        async def health() -> Response:
            problem = await self.problem()
            if problem is not None:
                return JSONResponse({"status": "unavailable", "error": _error(problem, "unavailable_error",
                                                                              "ring_not_ready")}, status_code=503)
            return JSONResponse({"status": "ok", "model": self.alias, "n_parallel": self.llm.n_parallel,
                                 "requests_running": self.llm.requests_running,
                                 "requests_waiting": self.waiting()})

        async def metrics() -> Response:
            figures = await anyio.to_thread.run_sync(self.figures, self.waiting(), limiter=self.probes)
            return PlainTextResponse(self.metrics.render(figures), media_type=PROMETHEUS_TEXT)

        tag = "OpenAI V1"
        # llama-cpp-python's response models, so that an answer is serialized as its server serializes it
        completion = llama_cpp.CreateCompletionResponse | str
        chat = llama_cpp.ChatCompletion | str
        r.add_api_route("/v1/completions", create_completion, methods=["POST"], dependencies=auth,
                        response_model=completion, summary="Completion", tags=[tag])
        r.add_api_route("/v1/engines/copilot-codex/completions", create_completion, methods=["POST"],
                        dependencies=auth, response_model=completion, include_in_schema=False)
        r.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"], dependencies=auth,
                        response_model=chat, summary="Chat", tags=[tag])
        r.add_api_route("/v1/embeddings", create_embedding, methods=["POST"], dependencies=auth,
                        summary="Embedding", tags=[tag])
        # llama.cpp's server answers /health without a key, so that a load balancer can ask
        r.add_api_route("/health", health, methods=["GET"], summary="Whether the ring is ready", tags=["Extras"])
        r.add_api_route("/metrics", metrics, methods=["GET"], dependencies=auth, summary="Prometheus metrics",
                        tags=["Extras"])
        return r

    def waiting(self) -> int:
        """Requests waiting for a sequence: inside the Llama, or for a worker thread before it (in the event loop's
        thread: the limiter is not thread-safe)."""
        return int(self.llm.requests_waiting) + self.limiter.statistics().tasks_waiting

    def others_wait(self) -> bool:
        """Another request waits for a sequence (every one busy): what --interrupt_requests stops a stream for."""
        return self.waiting() > 0 and self.llm.requests_running >= self.llm.n_parallel

    def figures(self, waiting: int) -> RingFigures:
        """The ring's side of /metrics (in a worker thread: it asks every node)."""
        problem = self.llm.ring_problem()
        if problem is None:  # a node that does not answer would hold the scrape for the ring's timeout
            try:
                self.llm.cluster.metrics()
            except PrimaplugError as e:
                log.warning("the nodes' metrics: %s", e)
        view = self.llm.events.view
        nodes = tuple(NodeFigures(name, v.state, v.metrics) for name, v in view.nodes.items())
        return RingFigures(n_parallel=self.llm.n_parallel, running=self.llm.requests_running, waiting=waiting,
                           ready=problem is None, prompt_tokens=view.prompt_tokens, nodes=nodes)

    async def generate(self, request: Request, body: Any, body_model: str | None, kwargs: dict[str, Any],
                       endpoint: str, call: Callable[..., Any]) -> Any:
        stream = bool(kwargs.get("stream"))
        measured = self.metrics.start(endpoint, stream)
        try:
            problem = await self.problem()
            if problem is not None:
                self.metrics.end(measured, "unavailable")
                return _unavailable(problem)
            llama_server.prepare_request_resources(body, self.proxy, body_model, kwargs)
        except Exception as e:
            self.metrics.end(measured, _outcome(e))
            return _failed(e, body)
        if stream:
            send, receive = anyio.create_memory_object_stream[dict[str, str]](STREAM_BUFFER)
            return EventSourceResponse(receive, sep="\n", data_sender_callable=partial(
                self._publish, send, receive, partial(call, **kwargs), body, measured))
        return await self._complete(request, body, kwargs, measured, call)

    async def _complete(self, request: Request, body: Any, kwargs: dict[str, Any], measured: Measured,
                        call: Callable[..., Any]) -> Any:
        gone = threading.Event()
        # a client that leaves stops its request at the next token: chat completions take no stopping criteria,
        # but both take logits processors. llama-cpp-python drops every logits processor of a request that also has
        # a logit_bias (Llama._create_completion: `logits_processor = logits_processor.extend(...)` is None), so
        # such a request is left to run to its end rather than lose its bias.
        if kwargs.get("logit_bias") is None:
            processors = kwargs.get("logits_processor") or llama_cpp.LogitsProcessorList()
            processors.append(EndWhenSet(gone, self.llm.token_eos()))
            kwargs["logits_processor"] = processors
        failure: Exception | None = None
        result: Any = None
        async with anyio.create_task_group() as watchers:
            watchers.start_soon(_watch_disconnect, request, gone)
            try:
                result = await anyio.to_thread.run_sync(partial(call, **kwargs), limiter=self.limiter)
            except Exception as e:
                failure = e
            watchers.cancel_scope.cancel()
        if failure is not None:
            self.failed(failure)
            self.metrics.end(measured, _outcome(failure))
            return _failed(failure, body)
        usage = result.get("usage") or {}
        self.metrics.usage(measured, int(usage.get("completion_tokens") or 0))
        self.metrics.end(measured, "disconnected" if gone.is_set() else "ok")
        return result

    async def embed(self, body: CreateEmbeddingRequest) -> Any:
        measured = self.metrics.start("embeddings", False)
        try:
            problem = await self.problem()
            if problem is not None:
                self.metrics.end(measured, "unavailable")
                return _unavailable(problem)
            result = await anyio.to_thread.run_sync(
                partial(self.llm.create_embedding, **body.model_dump(exclude={"user"})), limiter=self.limiter)
        except Exception as e:
            self.failed(e)
            self.metrics.end(measured, _outcome(e))
            return _failed(e, body)
        self.metrics.end(measured, "ok")
        return result

    async def _publish(self, send: Any, receive: Any, call: Callable[[], Iterator[Any]], body: Any,
                       measured: Measured) -> None:
        """EventSourceResponse's data sender: the stream runs in a worker thread, which hands each event here. When
        the client leaves, the response cancels this; the thread, abandoned, stops at its next event (or at once
        if it waits to hand one over) and closes the generator, which frees the sequence."""
        stop = threading.Event()
        async with send:
            try:
                await anyio.to_thread.run_sync(self._pump, send, call, body, measured, stop, abandon_on_cancel=True,
                                               limiter=self.limiter)
            except anyio.get_cancelled_exc_class():
                stop.set()
                receive.close()  # wakes a handover that waits for room: no one will read it
                self.metrics.end(measured, "disconnected")
                raise
        self.metrics.end(measured)

    def _pump(self, send: Any, call: Callable[[], Iterator[Any]], body: Any, measured: Measured,
              stop: threading.Event) -> None:
        """In a worker thread: run the stream, send its chunks, then [DONE]; or an error event, never a silent end.
        The generator is closed here, in the thread that ran it, whatever ends the stream."""

        def emit(data: str) -> bool:
            if not stop.is_set():
                try:
                    anyio.from_thread.run(send.send, {"data": data})
                    return True
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):  # the client left
                    stop.set()
            self.metrics.end(measured, "disconnected")
            return False

        def last(data: str, outcome: str) -> None:
            # recorded before the last event goes: a client that has read it finds it counted
            self.metrics.end(measured, outcome)
            emit(data)

        def fail(e: BaseException) -> None:
            self.failed(e)
            last(json.dumps({"error": openai_error(e, body)[1]}), _outcome(e))

        try:
            chunks = call()
        except Exception as e:
            fail(e)
            return
        try:
            for chunk in chunks:
                if _has_text(chunk):
                    self.metrics.chunk(measured)
                if not emit(json.dumps(chunk)):
                    return
                if self.interrupt_requests and anyio.from_thread.run_sync(self.others_wait):
                    last(json.dumps({"error": _error(
                        "stopped to free a sequence for a waiting request (the server runs with --interrupt_requests); "
                        "resend it, or ask the operator for more sequences (-np) or no --interrupt_requests",
                        "server_error", "interrupted")}), "interrupted")
                    return
            last("[DONE]", "ok")
        except Exception as e:
            fail(e)
        finally:
            close = getattr(chunks, "close", None)  # llama-cpp-python's streams are generators
            if close is not None:
                close()  # a stream ends (or is cut) here: its sequence is free from now


class EndWhenSet:
    """A logits processor that leaves only end-of-generation possible once `event` is set, so that llama-cpp-python
    ends the request at its next token as it ends any other (finish_reason "stop"), freeing the sequence."""

    def __init__(self, event: threading.Event, eos: int) -> None:
        self.event, self.eos = event, eos

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if not self.event.is_set():
            return scores
        out = scores.copy()
        out[:] = -float("inf")
        out[self.eos] = 0.0
        return out


async def _watch_disconnect(request: Request, gone: threading.Event) -> None:
    while not await request.is_disconnected():
        await anyio.sleep(DISCONNECT_POLL_S)
    gone.set()


def _has_text(chunk: Any) -> bool:
    """Whether a streamed chunk carries generated text (a completion's text, a chat delta's content or call)."""
    for choice in chunk.get("choices") or ():
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("function_call"):
            return True
    return False
