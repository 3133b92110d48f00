"""The OpenAI-compatible HTTP API over the batcher: the application's ingress, a FastAPI app
(`@serve.ingress`) whose class holds the `Batcher` batcher as a member.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models
and /v1/models/{id}, GET /health, GET /stats (the router's speculation statistics). Every error is
OpenAI's error body with a 4xx/5xx status; overload answers 503 with Retry-After. Bodies are read up to
`api.max_body_bytes` (413 beyond). Optional Bearer-token auth compares keys in constant time
(keys from SPECDEC_API_KEYS, SPECDEC_API_KEYS_FILE or the file `api.api_keys_file`).
Serve's access log has one line per request (method, route, status, latency); no log holds prompts
or keys (SPECDEC_DEBUG_LOG_PROMPTS=1 adds prompts for debugging).
"""
# No `from __future__ import annotations` here: FastAPI reads the routes' annotations after Serve
# rewrites their signatures, outside this module's globals, so they must be real objects.

import asyncio
import dataclasses
import hmac
import inspect
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from openai.types import CompletionUsage
from fastapi import FastAPI
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from deployments import tracing
from deployments.batcher import Overloaded, RequestFailed, Batcher
from serve_app import constants
from serve_app.args import ApiConfig
from serve_app.protocol import (SSE_DONE, APIError, ChatCompletionRequest, ChatResponses, CompletionRequest,
                                CompletionResponses, SpeculativeUsage, model_list, parse_request, sse,
                                to_sampling_params, usage, validate_limits, wire)
from specdec.loader import load_tokenizer
from specdec.prompts import encode_chat, encode_text
from specdec.sequence import Sequence

log = logging.getLogger("ray.serve")


# Module helpers come before the ingress class: `serve.ingress` copies the class with a snapshot
# of this module's globals taken when it runs, so names defined after it would not resolve.
def _finish(seq: Sequence) -> str:
    return "length" if seq.finish_reason == "length" else "stop"


class _Stream(StreamingResponse):
    """A streamed response that frees its request also when the client left before its body
    generator ever ran (Starlette then cancels the body without starting it, and a generator
    that never started runs no `finally`)."""

    def __init__(self, content, end, **kwargs):
        super().__init__(content, **kwargs)
        self._end = end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._end()


def _serve_trace_context():
    """Ray Serve's request span (with Serve's tracing on), the parent of ours; None without it."""
    try:
        return serve.get_trace_context()
    except Exception:  # noqa: BLE001 - not in a replica, or a Serve without it
        return None


def _route_path(scope) -> str:
    """The request path inside the application (its route prefix, Serve's root_path, removed)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return (path[len(root):] if root and path.startswith(root) else path).rstrip("/") or "/"


def _fastapi_telemetry() -> dict:
    """FastAPI's own HTTP spans (FastAPI >= 0.165) stay off under Ray Serve's tracing: they start
    from the headers alone, so without a client `traceparent` each request got a trace of its own
    beside Serve's request trace, which holds ours."""
    if os.environ.get("RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH") and "telemetry" in inspect.signature(FastAPI).parameters:
        return {"telemetry": {"tracing": False}}
    return {}


app = FastAPI(title="specdec-serve", description="OpenAI-compatible speculative decoding",
              docs_url=None, redoc_url=None, openapi_url=None,  # the OpenAI schema is the contract
              **_fastapi_telemetry())


def _error(e: APIError) -> JSONResponse:
    """OpenAI's error body; a 429 or 503 without a Retry-After of its own gets one of 1 s."""
    retry = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers or retry)


@app.exception_handler(APIError)
async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return _error(e)


@app.exception_handler(Overloaded)
async def _overloaded(request: Request, e: Overloaded) -> JSONResponse:
    return _error(APIError.overloaded(str(e), retry_after_s=e.retry_after))


@app.exception_handler(RequestFailed)
async def _failed(request: Request, e: RequestFailed) -> JSONResponse:
    return _error(APIError(str(e), status=e.status))


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own 404 (no such route) and 405 (wrong method), in OpenAI's format."""
    path = _route_path(request.scope)
    if e.status_code == 405:  # with the route's Allow header (RFC 9110 requires one)
        return _error(APIError(f"Method {request.method} not allowed for {path}.", status=405, headers=e.headers))
    if e.status_code == 404:
        return _error(APIError(f"Unknown route {request.method} {path}.", status=404, code="not_found"))
    return _error(APIError(str(e.detail), status=e.status_code))


@app.exception_handler(Exception)
async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    """Anything unexpected: a 500 in OpenAI's format (Starlette's ServerErrorMiddleware sends it,
    then re-raises, so Serve logs the traceback and counts the error; the replica stays up)."""
    return _error(APIError.internal())


def _direct(handle):
    """A handle for the per-round calls: requests and responses travel over Serve's
    inter-deployment gRPC instead of Ray object references (measured here: the hop of a round's
    call 6.5 -> 3.5 ms, bench/round_profile.py)."""
    return None if handle is None else handle.options(_by_reference=False)


@serve.ingress(app)
class OpenAIIngress:
    """The application's ingress: OpenAI routes over the batcher (`Batcher`, a member in the
    same process, so a round costs no extra hop); the builder adds Serve options."""

    def __init__(self, router_config: dict, api_config: dict, draft_handle, target_handle):
        self.batcher = Batcher(router_config, _direct(draft_handle), _direct(target_handle))
        self.api = ApiConfig(**api_config)
        self.api_keys = [k.encode() for k in constants.load_api_keys(self.api.api_keys_file)]
        if self.api.require_api_key and not self.api_keys:
            raise ValueError(f"require_api_key is set but no keys in ${constants.API_KEYS_ENV}, "
                             f"${constants.API_KEYS_FILE_ENV} or api.api_keys_file")
        # Prompts are tokenized on a thread of their own, with a tokenizer of their own: a long one
        # (up to max_body_bytes) takes a second, which on the event loop would stall every lane's
        # rounds and streams; fast tokenizers release the GIL, and one not shared with the loop's
        # detokenizers is never borrowed by two threads.
        self.encoder = load_tokenizer(self.cfg.tokenizer)
        self.vocab_size = len(self.encoder)
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.created = int(time.time())
        self.configured, self.config_error = False, None  # (see reconfigure)

    def __del__(self) -> None:
        tracing.flush()  # Serve stops the replica (ray.kill skips atexit): export the spans it still buffers

    @property
    def cfg(self):
        """The batcher's configuration (runtime knobs change it through `reconfigure`)."""
        return self.batcher.cfg

    # ---- what Serve calls on the deployment ---------------------------------------------------
    async def reconfigure(self, user_config: dict) -> None:
        """On the lanes' event loop (a plain method would run on Serve's thread pool while rounds
        read the config and the lanes list changes). An invalid user_config fails a starting replica
        (the deploy fails, loudly); a running replica keeps its configuration, logs the error and
        shows it in /stats (`config_error`): Ray stops a replica whose reconfigure raises, and the
        replicas that replace it fail alike, so one typo took the whole API down."""
        try:
            self.batcher.reconfigure(user_config)
        except ValueError as e:
            if not self.configured:
                raise
            log.error("user_config rejected; this replica keeps its configuration: %s", e)
            self.config_error = str(e)
            return
        self.configured, self.config_error = True, None

    async def record_autoscaling_stats(self) -> dict:
        """On the lanes' event loop (a plain method would run in Serve's thread pool, racing the
        rounds that update the same windows)."""
        return self.batcher.record_autoscaling_stats()

    # ---- routes -------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        req = await self._parse(request, CompletionRequest)
        prompts = req.prompts()
        self._check_size(req, len(prompts))
        return await self._run(request, req, await self._off_loop(lambda: [self._encode_prompt(p) for p in prompts]))

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        req = await self._parse(request, ChatCompletionRequest)
        self._check_size(req, 1)
        try:
            ids = await self._off_loop(encode_chat, self.encoder, req.messages_as_dicts())
        except ValueError as e:
            raise APIError(str(e), param="messages") from None
        return await self._run(request, req, [ids])

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(self._models([self.cfg.model_name]))

    @app.get("/v1/models/{model_id:path}")
    async def model(self, request: Request, model_id: str) -> Response:
        """One model card (`client.models.retrieve`); 404 for a model this replica does not serve."""
        self._authorize(request)
        if model_id != self.cfg.model_name:
            raise APIError.model_not_found(model_id, served=self.cfg.model_name)
        return JSONResponse(self._models([model_id])["data"][0])

    @app.get("/health")
    async def health(self) -> Response:
        """200 when a Target replica of this app's build answers, else 503 with the reason."""
        why = await self.batcher.unready()
        body = {"status": "unavailable" if why else "ok", "lanes": len(self.batcher.lanes), "queued": len(self.batcher.queue)}
        return JSONResponse({**body, "reason": why} if why else body, status_code=503 if why else 200)

    @app.get("/stats")
    async def stats(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({**self.batcher.engine_stats(), "config_error": self.config_error})

    # ---- request plumbing ---------------------------------------------------------------------
    def _models(self, ids: list[str]) -> dict:
        """Model cards, `created` when this replica started (the same in every answer)."""
        return model_list(ids, created=self.created, max_model_len=self.cfg.max_model_len)

    def _authorize(self, request: Request) -> None:
        if not self.api.require_api_key:
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip().encode() if auth.lower().startswith("bearer ") else b""
        ok = False
        for key in self.api_keys:  # compare with every key, in constant time each
            ok |= hmac.compare_digest(token, key)
        if not ok:
            raise APIError.invalid_api_key()

    async def _parse(self, request: Request, request_cls):
        """An authorized request's body as `request_cls`, for the model this replica serves."""
        self._authorize(request)
        req = parse_request(request_cls, await self._body(request))
        if req.model != self.cfg.model_name:
            raise APIError.model_not_found(req.model, served=self.cfg.model_name)
        return req

    async def _body(self, request: Request) -> bytes:
        limit = self.api.max_body_bytes
        too_large = APIError(f"Request body too large: limit is {limit} bytes.", status=413, code="body_too_large")
        declared = request.headers.get("content-length")
        if declared and declared.isascii() and declared.isdigit() and int(declared) > limit:  # ("²".isdigit())
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    # ---- generation ------------------------------------------------------------------------------
    def _check_size(self, req, num_prompts: int) -> None:
        """The checks that need no tokens, before tokenizing: a request refused anyway costs nothing."""
        validate_limits(req, max_n=self.api.max_n, max_stop=self.api.max_stop,
                        max_stop_len=self.api.max_stop_len, max_tokens_limit=self.api.max_tokens_limit)
        self.batcher.check_size(num_prompts, req.num_choices)

    async def _off_loop(self, fn, *args):
        """`fn(*args)` on the tokenize thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, fn, *args)

    def _prepare(self, req, prompts: list[list[int]]):
        """Sampling params per choice, after the context-window checks."""
        completion = isinstance(req, CompletionRequest)
        longest = max(len(p) for p in prompts)
        room = self.cfg.max_model_len - longest
        if room < 1:
            raise APIError(f"This model's maximum context length is {self.cfg.max_model_len} tokens; the prompt "
                           f"has {longest}.", param="prompt" if completion else "messages",
                           code="context_length_exceeded")
        default = min(16 if completion else self.api.default_max_tokens, self.api.max_tokens_limit)
        base = to_sampling_params(req, default_max_tokens=min(default, room))
        if base.max_tokens > room:
            raise APIError(f"This model's maximum context length is {self.cfg.max_model_len} tokens; you "
                           f"requested {longest + base.max_tokens} ({longest} in the prompt, {base.max_tokens} "
                           f"in the completion).", param=req.max_tokens_param, code="context_length_exceeded")
        # distinct, reproducible samples per choice: seed + choice index
        return [dataclasses.replace(base, seed=None if base.seed is None else base.seed + i)
                for i in range(req.num_choices)]

    def _encode_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = encode_text(self.encoder, prompt)
        else:
            ids = list(prompt)
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise APIError(f"Invalid 'prompt': token ids must be in [0, {self.vocab_size}).", param="prompt")
        if not ids:
            raise APIError("Invalid 'prompt': it encodes to no tokens.", param="prompt")
        return ids

    async def _run(self, request: Request, req, prompts: list[list[int]]) -> Response:
        params = self._prepare(req, prompts)
        out = (CompletionResponses if isinstance(req, CompletionRequest) else ChatResponses)(model=self.cfg.model_name)
        rid = out.request_id
        span, ctx = tracing.start_span("router.request", dict(request.headers), _serve_trace_context(),
                                       request_id=rid, stream=bool(req.stream), n=req.num_choices, prompts=len(prompts))
        if constants.DEBUG_LOG_PROMPTS:
            log.info("request %s prompts=%r", rid, prompts)
        # choices are prompt-major: index = prompt * n + choice
        try:
            seqs = self.batcher.submit(prompts, params, group=rid)  # all or none
        except BaseException as e:  # (refused: overloaded, or too large for any lane)
            tracing.mark_error(span, e)
            span.end()
            raise
        for s in seqs:
            s.meta.update(trace_ctx=ctx, request_id=rid)
        end = self._ender(seqs, span)
        if req.stream:  # (ended by the generator, or by the response if the client left before it ran)
            return _Stream(self._stream(req, out, seqs, prompts, end), end, media_type="text/event-stream")
        try:
            try:
                async for _ in self._watch(seqs):
                    pass
            except RequestFailed as e:
                end(e)
                raise
            usage = self._usage(seqs, prompts)
            return JSONResponse(wire(out.response([s.text for s in seqs], [_finish(s) for s in seqs], usage)))
        finally:
            end()

    def _ender(self, seqs: list[Sequence], span):
        """A call that frees a request's sequences (finished, failed or disconnected) and ends its
        span, once however often it is called."""
        ended = False

        def end(error: BaseException | None = None) -> None:
            nonlocal ended
            if not ended:
                ended = True
                for s in seqs:
                    self.batcher.finish(s)
                span.set_attribute("completion_tokens", sum(s.num_output for s in seqs))  # (streamed or not)
                if error is not None:
                    tracing.mark_error(span, error)
                span.end()
        return end

    async def _stream(self, req, out, seqs, prompts, end) -> AsyncIterator[str]:
        try:
            for chunk in out.opening(len(seqs)):
                yield sse(chunk)
            try:
                async for i, s in self._watch(seqs):
                    delta = s.take_delta()
                    if delta:
                        yield sse(out.chunk(i, delta))
                    if s.finished:
                        await self.batcher.wait(s)  # a failure that came while the client read: raised here
                        yield sse(out.finish(i, _finish(s)))
            except RequestFailed as e:
                end(e)
                yield sse(APIError(str(e), status=e.status).body())
                yield SSE_DONE
                return
            if req.include_usage:
                yield sse(out.usage_chunk(self._usage(seqs, prompts)))  # (the chunk drops the extension)
            yield SSE_DONE
        finally:  # also on client disconnect (the generator is cancelled)
            end()

    async def _watch(self, seqs: list[Sequence]) -> AsyncIterator[tuple[int, Sequence]]:
        """Yield (index, seq) each time a sequence changes, until all are finished (each at least
        once, so one that finished before the watch began is reported too)."""
        def arm(i):
            return asyncio.ensure_future(self.batcher.wait(seqs[i]))
        pending = {arm(i): i for i in range(len(seqs))}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    i = pending.pop(t)
                    t.result()  # raises RequestFailed
                    yield i, seqs[i]
                    if not seqs[i].finished:
                        pending[arm(i)] = i
        finally:
            for t in pending:
                t.cancel()

    def _usage(self, seqs: list[Sequence], prompts: list[list[int]]) -> CompletionUsage:
        spec = SpeculativeUsage(proposed_tokens=sum(s.proposed for s in seqs),
                                accepted_tokens=sum(s.accepted for s in seqs), rounds=sum(s.rounds for s in seqs))
        return usage(sum(len(p) for p in prompts), sum(s.num_output for s in seqs), speculative=spec)
