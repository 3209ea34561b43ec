"""The HTTP face: ``create_app(worker, metrics=None, on_shutdown=None, max_body=..., api_key=None,
tenants=None) -> FastAPI``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (each with ``stream: true``:
server-sent events in OpenAI's chunk format, ending ``data: [DONE]``), ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``, ``GET /openapi.json`` (``openapi``: the
request and response bodies, built from the parser's field tables). With ``api_key`` (one tenant) or
``tenants`` (``serve.tenants.Tenants``: several, each with its keys), every ``/v1`` route needs
``Authorization: Bearer <key>`` (401 ``invalid_api_key`` otherwise); ``/health`` and ``/metrics``
stay open (probes and scrapers). The key's tenant goes with the request (``Request.tenant``): the
store files and finds its cache under that tenant and the request's ``cache_salt`` only.

A request with ``n > 1`` gets its choices' events tagged ``index`` (``sequence``): the answer
waits for every choice; a stream interleaves their chunks, each with its ``index``.

Every refusal is OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for a
malformed body (not UTF-8, not JSON, NaN/Infinity, not an object) and bad fields (``protocol``),
404 for an unknown model or route, 405 for a wrong method, 413 for a body over ``max_body``
bytes, 429 (``Retry-After``) when the worker's queue is full, 500 when generation fails (the message
says ``internal error (id ...)``, nothing of the exception; the traceback is logged with that id), 504 on
the request timeout. Checks run before the request reaches the worker, so a bad request never
touches a stored cache. An error after a stream has started is sent as one ``data: {"error":
...}`` event before ``[DONE]``.

A client that disconnects cancels its job, streaming or not: a task per request watches the
connection (ASGI ``http.disconnect``), so the worker drops it at its next step (the ``n`` choices
of one request share one cancel flag and stop together) and keeps, in the store, the prompt and
the tokens generated so far.

Nothing that can wait runs on the event loop: decoding and parsing the body, the chat template,
tokenizing (a body of up to ``max_body`` bytes) and the planner's check run in a thread
(``asyncio.to_thread``), so ``/health`` and the running streams are answered meanwhile.

Shutdown (``tiercache.serve.lifecycle``): once ``app.state.lifecycle`` drains, ``/v1`` requests
and ``/health`` answer 503 with ``Retry-After``; the requests already admitted are tracked until
their answer is sent.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from tiercache.serve.errors import APIError, internal_error
from tiercache.serve.lifecycle import Lifecycle, shutting_down
from tiercache.serve.openapi import document
from tiercache.serve.protocol import check_vocabulary, parse_chat, parse_completion
from tiercache.serve.responses import Choice, Shape, fingerprint, summed_usage

MAX_BODY = 8 * 2**20


class _Pipe:
    """Worker-thread events -> an asyncio queue on the server's loop."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def emit(self, kind: str, **data) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, data))


def _no_constants(name):
    raise ValueError(f"{name} is not valid JSON")


async def read_body(request: Request, limit: int) -> bytes:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise APIError(413, f"the request body has {size} bytes; the limit is {limit}", code="body_too_large")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes):
    """The body as JSON (in a thread; the UTF-8 decoding a slice at a time, so that a large body
    never holds the GIL long: the event loop runs meanwhile)."""
    decoder, parts = codecs.getincrementaldecoder("utf-8")(), []
    try:
        for at in range(0, len(raw), 1 << 18):
            parts.append(decoder.decode(raw[at:at + (1 << 18)]))
        parts.append(decoder.decode(b"", final=True))
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {at + e.start})",
                       code="invalid_encoding") from None
    text = "".join(parts)
    try:
        return json.loads(text, parse_constant=_no_constants)
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _key_check(tenants):
    """A FastAPI dependency: the request carries ``Authorization: Bearer <key>`` of one of
    ``tenants``; it answers that tenant's name (None when the server asks for no key)."""
    async def check(request: Request) -> str | None:
        if tenants is None:
            return None
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "no API key given: send the header 'Authorization: Bearer <key>'",
                           type="invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        tenant = tenants.find(token.strip())
        if tenant is None:
            raise APIError(401, "incorrect API key provided", type="invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return tenant
    return check


class _Flight:
    """One admitted request until its answer is sent: tracked for the drain, cancelled if left unfinished."""

    def __init__(self, life: Lifecycle, pipe: _Pipe, job):
        self.life, self.pipe, self.job, self.finished = life, pipe, job, False
        life.track(pipe, job)

    def close(self) -> None:
        """Idempotent: the stream's end and the response's background task both call it."""
        if not self.finished:
            self.job.cancel()  # the client went away, or the response failed: the worker drops it
        self.finished = True
        self.life.untrack(self.pipe)


async def _watch(request: Request, pipe: _Pipe, job) -> None:
    """Until the client disconnects (the body is read: the next ASGI message is ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            pipe.queue.put_nowait(("disconnected", {}))
            return


def create_app(worker, metrics=None, on_shutdown=None, max_body: int = MAX_BODY, api_key: str | None = None,
               tenants=None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)
            if on_shutdown is not None:
                await asyncio.to_thread(on_shutdown)

    app = FastAPI(title="tiercache serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    life = app.state.lifecycle = Lifecycle()
    created = int(time.time())
    if tenants is None and api_key is not None:
        from tiercache.serve.tenants import Tenants

        tenants = Tenants.single(api_key)
    check_key = _key_check(tenants)
    auth = [Depends(check_key)]
    fp = fingerprint(worker.model_name, getattr(worker.policy, "name", "") or "")

    def model_card() -> dict:
        return {"id": worker.model_name, "object": "model", "created": created, "owned_by": "tiercache"}

    @app.exception_handler(APIError)
    async def _api_error(request, err: APIError):
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=kind))

    @app.exception_handler(Exception)
    async def _crash(request, exc):
        return _error_response(internal_error(exc))  # the id only: the traceback goes to the log

    schema = document(worker.model_name)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json():
        return schema

    @app.get("/health")
    async def health():
        body = {"status": "draining" if life.draining else "ok", "model": worker.model_name,
                "queue_length": worker.queue_length, "active_requests": worker.active, "store": worker.store is not None}
        if life.draining:  # a load balancer's probe takes this replica out
            return JSONResponse(body, status_code=503, headers=shutting_down().headers)
        return body

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str):
        if model_id != worker.model_name:
            raise APIError(404, f"model {model_id!r} not found; this server serves {worker.model_name!r}",
                           param="model", code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise APIError(404, "metrics are not enabled", code="not_found")
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, tenant: str | None = Depends(check_key)):
        return await _serve(request, parse_chat, tenant)

    @app.post("/v1/completions")
    async def completions(request: Request, tenant: str | None = Depends(check_key)):
        return await _serve(request, parse_completion, tenant)

    def _prepare(raw: bytes, parse, emit, tenant):
        """Body bytes -> a job (in a thread: JSON, fields, chat template, tokenizer, planner)."""
        req = parse(parse_json(raw))
        req.tenant = tenant  # the store looks only in this tenant's (and cache_salt's) entries
        check_vocabulary(req, worker.codec.vocab_size)
        return req, worker.prepare(req, emit)

    async def _serve(request: Request, parse, tenant: str | None = None):
        life.admit()
        raw = await read_body(request, max_body)
        pipe = _Pipe()
        req, job = await asyncio.to_thread(_prepare, raw, parse, pipe.emit, tenant)
        life.admit()  # a drain that began meanwhile
        worker.submit(job)
        flight = _Flight(life, pipe, job)
        rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        shape = Shape(req, rid, worker.model_name, fp)
        if req.stream:  # starlette cancels the stream on a disconnect; close() runs either way
            return StreamingResponse(_stream(pipe, flight, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"}, background=BackgroundTask(flight.close))
        watcher = asyncio.create_task(_watch(request, pipe, job))
        try:
            return await _collect(pipe, flight, shape)
        finally:
            watcher.cancel()
            flight.close()

    return app


async def _collect(pipe: _Pipe, flight: _Flight, shape) -> JSONResponse:
    choices = {i: Choice(i) for i in range(shape.req.n)}
    done, job = 0, flight.job
    while True:
        kind, data = await pipe.queue.get()
        if kind == "disconnected":
            return Response(status_code=499)  # nobody reads it
        choice = choices[data.get("index", 0)]
        choice.entries += data.get("logprobs", ())
        if kind == "delta":
            choice.parts.append(data["text"])
        elif kind == "error":
            job.cancel()  # the other choices of n stop too
            return _error_response(data["error"])
        else:
            choice.finish_reason, choice.usage = data["finish_reason"], data["usage"]
            done += 1
            if done == len(choices):
                flight.finished = True
                usage = summed_usage([choices[i].usage for i in sorted(choices)])
                return JSONResponse(shape.full(list(choices.values()), usage))


async def _stream(pipe: _Pipe, flight: _Flight, shape):
    choices = {i: Choice(i) for i in range(shape.req.n)}
    done, job = 0, flight.job
    try:
        if shape.chat:
            for i in choices:
                yield shape.sse(shape.chunk(i, {"role": "assistant", "content": ""}))
        while True:
            kind, data = await pipe.queue.get()
            choice = choices[data.get("index", 0)]
            logprobs = shape.logprobs(data.get("logprobs", []), choice)
            if kind == "delta":
                text = data["text"]
                yield shape.sse(shape.chunk(choice.index, {"content": text} if shape.chat else text, None, logprobs))
            elif kind == "error":
                job.cancel()  # the other choices of n stop too
                yield shape.sse(data["error"].body())
                yield "data: [DONE]\n\n"
                return
            else:
                choice.usage = data["usage"]
                done += 1
                yield shape.sse(shape.chunk(choice.index, {} if shape.chat else "", data["finish_reason"],
                                            logprobs if data.get("logprobs") else None))
                if done == len(choices):
                    flight.finished = True
                    if shape.req.include_usage:
                        yield shape.sse(shape.usage_chunk(summed_usage([choices[i].usage for i in sorted(choices)])))
                    yield "data: [DONE]\n\n"
                    return
    finally:
        flight.close()
