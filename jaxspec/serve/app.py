"""The FastAPI app: /v1/completions, /v1/chat/completions (whole or streamed as server-sent
events), /v1/models, /health and /metrics over one LLM's engine.

Every request is checked before it reaches the engine (fields, sampling values, the prompt's
length against the context): a bad one is a 400 in OpenAI's error shape and nothing running
notices. Prompts are encoded on a worker thread, off the event loop. A client that disconnects
drops its requests from the engine: a stream's task is cancelled by Starlette when the client
goes; a whole response's handler races the work against the connection's end.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import List, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxspec.serve import metrics as metrics_lib
from jaxspec.serve.async_engine import AsyncEngine, Handle
from jaxspec.serve.errors import APIError, bad_request
from jaxspec.serve.protocol import ChatCompletionRequest, CompletionRequest, sampling_params
from jaxspec.serve.responses import DONE, Responder, TokenText, sse

# What a union-typed field takes, for its validation error (pydantic names the branches).
_FORMS = {"prompt": "a string, a list of strings, a list of token ids or a list of lists of "
                    "token ids",
          "stop": "a string or a list of strings",
          "content": "a string or a list of text parts ({'type': 'text', 'text': ...})"}
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list"}


class _Service:
    """What the routes share: the LLM's tokenizer and limits, the engine thread, the metrics."""

    def __init__(self, llm, name: str, max_queue: int):
        self.llm, self.name, self.tokenizer = llm, name, llm.tokenizer
        self.metrics = metrics_lib.ServerMetrics(name)
        self.engine = AsyncEngine(llm, self.metrics, max_queue)
        self.text = TokenText(llm.tokenizer)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="jaxspec-tokenize")
        e = llm.engine
        self.max_model_len, self.vocab_size = e.max_model_len, e.vocab_size
        # one request's prompt + output: the context, and the KV rows it may hold (the engine
        # keeps 2 calls' emits of slack per request)
        self.max_tokens = min(e.max_model_len, e.kv_budget - 2 * e.emit)
        self.created = int(time.time())

    def check_model(self, model: str):
        if model != self.name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.name}`", param="model", code="model_not_found")

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def encode_prompts(self, prompts: List[Union[str, List[int]]]) -> List[List[int]]:
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(self.tokenizer.encode_batch(texts))
        out = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]
        for i, ids in enumerate(out):
            where = "prompt" if len(out) == 1 else f"prompt.{i}"
            if not ids:
                raise bad_request(f"{where}: empty prompt (it encodes to no tokens)", "prompt")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise bad_request(f"{where}: token ids out of range [0, {self.vocab_size}): "
                                  f"{bad[:5]}", "prompt")
        return out

    def encode_chat(self, conversation: List[dict]) -> List[int]:
        try:
            ids = self.tokenizer.apply_chat_template(conversation)
        except (TypeError, ValueError) as e:
            raise bad_request(f"messages: {e}", "messages") from None
        if not ids:
            raise bad_request("messages: the chat template gives no tokens", "messages")
        return ids

    async def generate(self, request: Request, body, kind: str, prompts: List[List[int]],
                       t_arrival: float) -> Response:
        sps = [sampling_params(body, len(p), self.max_tokens - len(p)) for p in prompts]
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        handle = await self.engine.submit(prompts, sps, request_id=rid, stream=body.stream,
                                          t_arrival=t_arrival)
        usage = body.stream_options is not None and body.stream_options.include_usage
        out = Responder(kind, rid, self.name, int(time.time()), [len(p) for p in prompts],
                        self.text, logprobs=body.logprobs_wanted(),
                        token_ids=body.return_token_ids, include_usage=usage)
        if body.stream:
            return _EventStream(_events(handle, out), handle)
        try:
            finished = await _unless_disconnected(request, _collect(handle, out))
        finally:
            handle.close()
        if not finished:
            return Response(status_code=499)      # nobody is listening
        return JSONResponse(out.body())


class _EventStream(StreamingResponse):
    """A server-sent event stream that closes its handle however the response ends (finished,
    the client gone, the task cancelled at shutdown), even if it never started."""

    def __init__(self, content, handle: Handle):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.handle = handle

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.close()


async def _collect(handle: Handle, out: Responder):
    try:
        async for i, d in handle.deltas():
            out.add(i, d)
    except APIError:
        raise
    except Exception as e:      # the engine failed
        raise APIError(500, f"the engine failed: {type(e).__name__}: {e}",
                       type="server_error") from None


async def _events(handle: Handle, out: Responder):
    try:
        for chunk in out.opening():
            yield sse(chunk)
        async for i, d in handle.deltas():
            chunk = out.chunk(i, d)
            if chunk is not None:
                yield sse(chunk)
        if out.include_usage:
            yield sse(out.usage_chunk())
    except Exception as e:      # the engine failed: the stream says so, then ends
        yield sse(APIError(500, f"the engine failed: {type(e).__name__}: {e}",
                           type="server_error").body())
    finally:
        handle.close()
    yield DONE


async def _disconnected(request: Request):
    """Returns when the client has gone (the body is read: what comes next is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work) -> bool:
    """Runs work until it ends (True; its exception raised) or the client disconnects first
    (False; work is cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:            # also when this handler is cancelled (shutdown): both go
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        return False
    task.result()
    return True


def validation_error(exc: RequestValidationError) -> APIError:
    """pydantic's first error as a 400 naming the field, in words a client can act on."""
    errors = exc.errors()
    err = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    if err["type"] == "json_invalid":
        return bad_request(f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
    loc = [x for x in err["loc"] if x != "body"]
    path: List[str] = []
    for x in loc:       # a union's branch shows up as its type's name: the field ends before
        if isinstance(x, str) and (x in _TYPE_TAGS or "[" in x):
            break
        path.append(str(x))
    param = ".".join(path)
    if not path:
        return bad_request("the body must be a JSON object of the request's fields")
    if err["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param,
                           "unrecognized_argument")
    if err["type"] == "missing":
        return bad_request(f"{param}: required", param)
    got = repr(err.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    form = _FORMS.get(path[-1]) if len(path) < len(loc) else None
    msg = f"{param} must be {form}" if form else f"{param}: {err['msg']}"
    return bad_request(f"{msg}, got {got}", param)


def build_app(llm, *, served_model_name: str, max_queue: int = 256) -> FastAPI:
    """The OpenAI-compatible app over llm (its engine is driven by a thread of the app's, from
    startup to shutdown; call nothing else on llm meanwhile). served_model_name: the `model`
    requests name. max_queue: requests accepted beyond the engine's slots before 503."""
    if not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 0:
        raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
    svc = _Service(llm, served_model_name, max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        svc.engine.start()
        try:
            yield
        finally:        # in-flight requests have finished or been cancelled by now
            await svc.engine.stop()
            svc.pool.shutdown(wait=False)

    app = FastAPI(title="jaxspec", lifespan=lifespan)
    app.state.service = svc

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        if 400 <= e.status < 500:
            svc.metrics.rejected("invalid")
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        return await _api_error(request, validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.get("/health")
    async def health():
        if not svc.engine.alive:
            raise APIError(503, "the engine is not running", type="server_error")
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": svc.name, "object": "model", "created": svc.created, "owned_by": "jaxspec",
             "max_model_len": svc.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(svc.metrics.exposition(), media_type=metrics_lib.CONTENT_TYPE_LATEST)

    async def answer(request: Request, body, kind: str, encode, source):
        """One request's answer: its checks, then source()'s prompts encoded off the event loop
        by encode (-> a list of token-id prompts), then generation."""
        t0 = time.perf_counter()
        svc.check_model(body.model)
        body.check_supported()
        prompts = await svc.off_loop(encode, source())
        return await svc.generate(request, body, kind, prompts, t0)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await answer(request, body, "completion", svc.encode_prompts, body.prompts)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await answer(request, body, "chat", lambda c: [svc.encode_chat(c)],
                            body.conversation)

    return app
