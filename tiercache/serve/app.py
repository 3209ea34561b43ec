"""The HTTP face: ``create_app(worker, metrics=None, on_shutdown=None, max_body=..., api_key=None) -> FastAPI``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (each with ``stream: true``:
server-sent events in OpenAI's chunk format, ending ``data: [DONE]``), ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``, ``GET /openapi.json`` (``openapi``: the
request and response bodies, built from the parser's field tables). With ``api_key``, every ``/v1``
route needs ``Authorization: Bearer <api_key>`` (401 ``invalid_api_key`` otherwise);
``/health`` and ``/metrics`` stay open (probes and scrapers).

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

A client that disconnects cancels its job: the worker stops at its next token and keeps, in the
store, the prompt and the tokens generated so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tiercache.serve.errors import APIError, internal_error
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


async def read_json(request: Request, limit: int):
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise APIError(413, f"the request body has {size} bytes; the limit is {limit}", code="body_too_large")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})",
                       code="invalid_encoding") from None
    try:
        return json.loads(text, parse_constant=_no_constants)
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _key_check(api_key: str | None):
    """A FastAPI dependency: the request carries ``Authorization: Bearer <api_key>``."""
    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "no API key given: send the header 'Authorization: Bearer <key>'",
                           type="invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "incorrect API key provided", type="invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
    return check


def create_app(worker, metrics=None, on_shutdown=None, max_body: int = MAX_BODY, api_key: str | None = None) -> FastAPI:
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
    created = int(time.time())
    auth = [Depends(_key_check(api_key))]
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
        return {"status": "ok", "model": worker.model_name, "queue_length": worker.queue_length,
                "active_requests": worker.active, "store": worker.store is not None}

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

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(request: Request):
        return await _serve(request, parse_chat(await read_json(request, max_body)))

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        return await _serve(request, parse_completion(await read_json(request, max_body)))

    async def _serve(request: Request, req):
        pipe = _Pipe()
        check_vocabulary(req, worker.codec.vocab_size)
        job = worker.prepare(req, pipe.emit)
        worker.submit(job)
        rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        shape = Shape(req, rid, worker.model_name, fp)
        if req.stream:
            return StreamingResponse(_stream(pipe, job, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(request, pipe, job, shape)

    return app


async def _collect(request: Request, pipe: _Pipe, job, shape) -> JSONResponse:
    choices = {i: Choice(i) for i in range(shape.req.n)}
    done, finished = 0, False
    try:
        while True:
            try:
                kind, data = await asyncio.wait_for(pipe.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return Response(status_code=499)
                continue
            choice = choices[data.get("index", 0)]
            choice.entries += data.get("logprobs", ())
            if kind == "delta":
                choice.parts.append(data["text"])
            elif kind == "error":
                finished = True
                job.cancel()  # the other choices of n stop too
                return _error_response(data["error"])
            else:
                choice.finish_reason, choice.usage = data["finish_reason"], data["usage"]
                done += 1
                if done == len(choices):
                    finished = True
                    usage = summed_usage([choices[i].usage for i in sorted(choices)])
                    return JSONResponse(shape.full(list(choices.values()), usage))
    finally:
        if not finished:
            job.cancel()


async def _stream(pipe: _Pipe, job, shape):
    choices = {i: Choice(i) for i in range(shape.req.n)}
    done, finished = 0, False
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
                finished = True
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
                    finished = True
                    if shape.req.include_usage:
                        yield shape.sse(shape.usage_chunk(summed_usage([choices[i].usage for i in sorted(choices)])))
                    yield "data: [DONE]\n\n"
                    return
    finally:
        if not finished:
            job.cancel()
