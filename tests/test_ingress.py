"""The HTTP ingress in process (no cluster): the real `OpenAIIngress` class over a real `Batcher`
whose Target handle runs a `TargetWorker` in this process, driven through ASGI. For what a
cluster cannot time: a client gone before its stream starts, a lane that fails while a client
reads, a sequence that finishes before its stream is watched."""
# No `from __future__ import annotations`: FastAPI must see the route's `Request` annotation.
import asyncio
import json

import httpx
import pytest

from fake_handles import FakeTarget


@pytest.fixture
def ingress(tiny_dir):
    """(ASGI app of the ingress's routes, the ingress, its fake Target)."""
    import torch
    from fastapi import FastAPI
    from starlette.requests import Request

    from serve_app import api
    from specdec.loader import load_model
    from specdec.target_worker import TargetWorker

    target = FakeTarget(TargetWorker(load_model(tiny_dir, dtype=torch.float32), 4, 128))
    cls = next(c for c in api.OpenAIIngress.__mro__ if "completions" in c.__dict__)  # (not Serve's ASGI wrapper)
    ing = cls({"tokenizer": str(tiny_dir), "speculate": False, "max_model_len": 128, "batch_wait_timeout_s": 0,
               "model_name": "m", "max_batch_size": 2, "max_lanes": 1, "max_queued_sequences": 2}, {}, None, target)
    app = FastAPI()
    for exc, handler in api.app.exception_handlers.items():
        app.add_exception_handler(exc, handler)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await cls.completions(ing, request)
    return app, ing, target


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def _events(text: str) -> list:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


async def _idle(batcher) -> None:
    for _ in range(200):
        if not batcher.lanes and not batcher.events and not batcher.queue:
            return
        await asyncio.sleep(0.02)


BODY = {"model": "m", "prompt": "hello", "temperature": 0, "ignore_eos": True, "stream": True}


def _request(body: dict, spec_version: str = "2.4"):
    from starlette.requests import Request
    raw = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b"",
                    "asgi": {"spec_version": spec_version}}, receive)


async def _read(response, pause_after_first: float = 0.0, pause_before: float = 0.0) -> list:
    """A streamed body's events, read by a client that is slow to start or pauses after a chunk."""
    await asyncio.sleep(pause_before)
    events = []
    async for chunk in response.body_iterator:
        events += _events(chunk)
        if len(events) == 1:
            await asyncio.sleep(pause_after_first)
    return events


@pytest.mark.asyncio
async def test_a_client_gone_before_its_stream_starts_frees_its_sequences(ingress):
    """Starlette cancels the body of a response whose client already hung up before the body's
    generator ever ran: the request's sequences must be freed all the same."""
    app, ing, target = ingress
    request = _request({**BODY, "max_tokens": 100}, spec_version="2.3")
    response = await type(ing).completions(ing, request)
    assert len(ing.batcher.events) == 1  # submitted

    async def gone():
        return {"type": "http.disconnect"}

    async def send(message):
        await asyncio.sleep(0)
    await response(request.scope, gone, send)
    await _idle(ing.batcher)
    assert not ing.batcher.events and not ing.batcher.lanes and len(target.worker.table) == 0


@pytest.mark.asyncio
async def test_a_lane_failure_while_the_client_reads_is_an_error_not_a_stop(ingress):
    """A lane that fails while the stream is paused at a chunk (a slow client) ends the stream
    with the error, never with finish_reason "stop" over cut-off text."""
    app, ing, target = ingress
    target.fail_from = 3
    response = await type(ing).completions(ing, _request({**BODY, "max_tokens": 50}))
    events = await _read(response, pause_after_first=0.3)  # the lane fails meanwhile
    finishes = [ch["choices"][0]["finish_reason"] for ch in events if isinstance(ch, dict) and ch.get("choices")]
    assert "stop" not in finishes and "length" not in finishes, events
    assert any(isinstance(e, dict) and "error" in e for e in events), events
    assert events[-1] == "[DONE]"
    await _idle(ing.batcher)
    assert not ing.batcher.errors and not ing.batcher.events


@pytest.mark.asyncio
async def test_a_sequence_finished_before_its_stream_is_watched_is_streamed(ingress):
    """A short answer can finish before a slow client starts reading: its text and finish chunk
    are still sent."""
    app, ing, target = ingress
    async with _client(app) as c:
        ref = (await c.post("/v1/completions", json={**BODY, "stream": False, "max_tokens": 3})).json()
    response = await type(ing).completions(ing, _request({**BODY, "max_tokens": 3}))
    events = await _read(response, pause_before=0.5)  # the answer is done before the stream is read
    chunks = [e for e in events if isinstance(e, dict)]
    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
    assert text == ref["choices"][0]["text"]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "length"
    await _idle(ing.batcher)
    assert len(target.worker.table) == 0


@pytest.mark.asyncio
async def test_a_request_larger_than_the_server_is_a_400_not_a_503(ingress):
    """prompts x n beyond lanes x batch + queue can never be admitted: a retry cannot help."""
    app, ing, target = ingress
    async with _client(app) as c:
        r = await c.post("/v1/completions", json={**BODY, "stream": False, "prompt": ["a"] * 5, "max_tokens": 2})
        ok = await c.post("/v1/completions", json={**BODY, "stream": False, "prompt": ["a"] * 2, "n": 2,
                                                   "max_tokens": 2})
    assert r.status_code == 400 and "too many sequences" in r.json()["error"]["message"], r.text
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


@pytest.mark.asyncio
async def test_the_default_max_tokens_respects_the_limit(ingress):
    """A request without max_tokens gets the default, at most api.max_tokens_limit (which an
    explicit value above it is refused for)."""
    from serve_app.args import ApiConfig
    app, ing, target = ingress
    body = {"model": "m", "prompt": "hello", "ignore_eos": True}
    async with _client(app) as c:
        default = await c.post("/v1/completions", json=body)
        ing.api = ApiConfig(max_tokens_limit=5)
        capped = await c.post("/v1/completions", json=body)
    assert default.status_code == 200 and default.json()["usage"]["completion_tokens"] == 16  # OpenAI's default
    assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] == 5, capped.text


@pytest.mark.asyncio
async def test_prompts_are_tokenized_off_the_event_loop_and_only_when_they_can_be_served(ingress, monkeypatch):
    """A long prompt takes a second to tokenize: on the event loop that would stall every lane's
    rounds and every stream. And a request refused anyway (too many sequences, bad limits) is
    refused before it costs any tokenizing."""
    import threading
    import time

    app, ing, target = ingress
    calls = []

    def slow_encode(tokenizer, text):
        calls.append(threading.current_thread().name)
        time.sleep(0.5)
        return tokenizer(text).input_ids
    monkeypatch.setitem(type(ing)._encode_prompt.__globals__, "encode_text", slow_encode)  # (Serve copied the module)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1
    tick = asyncio.get_running_loop().create_task(ticker())
    async with _client(app) as c:
        ok = await c.post("/v1/completions", json={**BODY, "stream": False, "max_tokens": 2})
        too_many = await c.post("/v1/completions", json={**BODY, "stream": False, "prompt": ["a"] * 5})
        bad_stop = await c.post("/v1/completions", json={**BODY, "stream": False, "stop": [""]})
    tick.cancel()
    assert ok.status_code == 200 and too_many.status_code == 400 and bad_stop.status_code == 400
    assert len(calls) == 1 and calls[0].startswith("tokenize")
    assert ticks > 1  # the loop ran on while the prompt was tokenized (on it: at most 1 tick in those 0.5 s)


@pytest.mark.asyncio
async def test_a_wrong_method_gets_the_allow_header(ingress):
    app, ing, target = ingress
    async with _client(app) as c:
        r = await c.get("/v1/completions")
    assert r.status_code == 405 and r.headers.get("allow") == "POST" and "error" in r.json()


@pytest.mark.asyncio
async def test_a_failed_request_is_an_error_in_its_trace(ingress):
    """A request whose lane fails ends its `router.request` span with ERROR status and the
    exception (a stream's HTTP status is 200, so the trace is where an operator sees it), and so
    does the round that failed."""
    from opentelemetry.trace import StatusCode

    from deployments import tracing
    from serve_app import telemetry as T
    app, ing, target = ingress
    target.fail_from = 1
    T.setup_tracing(T.TracingConfig(exporter="memory"))
    try:
        async with _client(app) as c:
            plain = await c.post("/v1/completions", json={**BODY, "stream": False, "max_tokens": 4})
            streamed = await c.post("/v1/completions", json={**BODY, "max_tokens": 4})
        assert plain.status_code == 500 and "error" in streamed.text
        await _idle(ing.batcher)
        spans = T._memory_exporter.get_finished_spans()
        requests = [s for s in spans if s.name == "router.request"]
        rounds = [s for s in spans if s.name == "router.round"]
        assert len(requests) == 2 and rounds
        assert all(s.status.status_code == StatusCode.ERROR for s in requests + rounds)
    finally:
        if getattr(T._provider, "_specdec_owned", False):
            T._provider.shutdown()
        T._config, T._provider, T._memory_exporter = None, None, None
        tracing.use_tracer(None)


def _memory_tracing():
    """A memory exporter for this test, and a function that removes it again."""
    from deployments import tracing
    from serve_app import telemetry as T
    T.setup_tracing(T.TracingConfig(exporter="memory"))

    def reset():
        if getattr(T._provider, "_specdec_owned", False):
            T._provider.shutdown()
        T._config, T._provider, T._memory_exporter = None, None, None
        tracing.use_tracer(None)
    return T._memory_exporter, reset


@pytest.mark.asyncio
async def test_a_refused_request_is_an_error_in_its_trace_and_every_request_counts_its_tokens(ingress):
    """A request refused for overload (503) ends `router.request` with ERROR and the exception, as
    a failed one does (it ended UNSET); a served one, streamed or not, carries `completion_tokens`."""
    from opentelemetry.trace import StatusCode
    app, ing, target = ingress
    spans, reset = _memory_tracing()
    try:
        async with _client(app) as c:  # 2 rows + 2 queued: of 6 long requests, some are refused
            rs = await asyncio.gather(*(c.post("/v1/completions", json={**BODY, "stream": i % 2 == 0, "max_tokens": 24})
                                        for i in range(6)))
        codes = [r.status_code for r in rs]
        assert 503 in codes and 200 in codes, codes
        await _idle(ing.batcher)
        requests = [s for s in spans.get_finished_spans() if s.name == "router.request"]
        assert len(requests) == 6
        refused = [s for s in requests if s.status.status_code == StatusCode.ERROR]
        assert len(refused) == codes.count(503) and all(s.events[0].name == "exception" for s in refused)
        served = sorted(s.attributes.get("completion_tokens", -1) for s in requests if s not in refused)
        assert served == [24] * codes.count(200)
    finally:
        reset()


@pytest.mark.asyncio
async def test_a_sampled_request_keeps_the_rounds_it_shares_with_an_unsampled_one(ingress):
    """A round serving several requests is a child of the first *sampled* one: as a child of the
    batch's first row, an unsampled request, it was dropped with that request, and a sampled
    request's trace lost every round it shared."""
    app, ing, target = ingress
    spans, reset = _memory_tracing()
    ids = {False: "0af7651916cd43dd8448eb211c80319c", True: "1af7651916cd43dd8448eb211c80319c"}
    try:
        async with _client(app) as c:
            async def send(sampled: bool):
                headers = {"traceparent": f"00-{ids[sampled]}-b7ad6b7169203331-0{int(sampled)}"}
                return await c.post("/v1/completions", headers=headers, json={**BODY, "stream": False, "max_tokens": 24})
            unsampled = asyncio.ensure_future(send(False))  # the lane's first row
            await asyncio.sleep(0)
            rs = [await send(True), await unsampled]
        assert [r.status_code for r in rs] == [200, 200]
        await _idle(ing.batcher)
        finished = spans.get_finished_spans()
        assert {format(s.context.trace_id, "032x") for s in finished} == {ids[True]}
        (req,) = [s for s in finished if s.name == "router.request"]
        rounds = [s for s in finished if s.name == "router.round"]
        shared = [s for s in rounds if "," in s.attributes["request_ids"]]
        assert shared and all(s.parent.span_id == req.context.span_id and len(s.links) == 1 for s in shared)
    finally:
        reset()


@pytest.mark.asyncio
async def test_an_invalid_user_config_fails_a_starting_replica_but_not_a_running_one(ingress):
    """Ray stops a replica whose reconfigure raises, and its replacements raise alike: a typo in a
    config update took the whole API down. A running replica keeps its configuration and shows
    the error in /stats; a starting one still fails (the deploy fails where the operator looks)."""
    from serve_app import api
    app, ing, target = ingress
    cls = type(ing)
    with pytest.raises(ValueError, match="unknown user_config"):
        await cls.reconfigure(ing, {"no_such_knob": 1})
    await cls.reconfigure(ing, {"max_batch_size": 1})
    for bad in ({"max_batch_size": 8}, {"no_such_knob": 1}, {"plain_steps": 0}):
        await cls.reconfigure(ing, bad)  # (raised)
        assert ing.batcher.cfg.max_batch_size == 1 and ing.config_error
        stats = json.loads((await cls.stats(ing, _request({}))).body)
        assert stats["config_error"] == ing.config_error
    async with _client(app) as c:
        r = await c.post("/v1/completions", json={**BODY, "stream": False, "max_tokens": 4})
    assert r.status_code == 200
    await cls.reconfigure(ing, {})
    assert ing.config_error is None and ing.batcher.cfg == ing.batcher.built


@pytest.mark.asyncio
async def test_health_is_503_while_no_target_replica_answers(ingress, monkeypatch):
    """/health answered ok whatever the Target did: probes and load balancers kept sending
    requests to a router that could serve none."""
    from deployments import batcher as batcher_mod
    app, ing, target = ingress
    cls = type(ing)
    monkeypatch.setattr(batcher_mod, "HEALTH_TIMEOUT_S", 0.2)

    async def health():
        r = await cls.health(ing)
        return r.status_code, json.loads(r.body)

    assert (await health())[0] == 200
    target.down = True
    assert (await health())[0] == 200  # the last answer serves for HEALTH_CACHE_S
    monkeypatch.setattr(batcher_mod, "HEALTH_CACHE_S", 0.0)
    code, body = await health()
    assert code == 503 and body["status"] == "unavailable" and "no replica" in body["reason"]
    target.down, target.hang = False, True
    code, body = await health()
    assert code == 503 and "answered within" in body["reason"]
    target.hang = False
    assert (await health())[0] == 200



@pytest.mark.asyncio
async def test_usage_counts_the_tokens_of_every_choice(ingress):
    app, ing, target = ingress
    async with _client(app) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "hello", "temperature": 0,
                                                 "ignore_eos": True, "n": 2, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6


@pytest.mark.asyncio
async def test_the_default_max_tokens_shrinks_to_the_room_left_in_the_context(ingress):
    """A long prompt without max_tokens gets the answer that fits (finish_reason "length"), not a
    400 for a budget it never asked for."""
    app, ing, target = ingress  # max_model_len 128
    async with _client(app) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": [5] * 120, "temperature": 0,
                                                 "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["finish_reason"] == "length"



@pytest.mark.asyncio
async def test_token_ids_are_checked_against_the_vocabulary_and_the_body_limit_is_inclusive(ingress):
    """The last id of the vocabulary is a prompt, the next one a 400 (it would fail the target's
    embedding, with the whole lane); a body of exactly max_body_bytes is read, one byte more is 413."""
    import json as _json
    app, ing, target = ingress
    V, limit = ing.vocab_size, ing.api.max_body_bytes
    body = {"model": "m", "temperature": 0, "max_tokens": 1}
    async with _client(app) as c:
        ok = await c.post("/v1/completions", json={**body, "prompt": [V - 1]})
        bad = await c.post("/v1/completions", json={**body, "prompt": [V]})
        pad = limit - len(_json.dumps({**body, "prompt": "hi", "user": ""}).encode())
        exact = _json.dumps({**body, "prompt": "hi", "user": "x" * pad}).encode()
        assert len(exact) == limit
        at_limit = await c.post("/v1/completions", content=exact, headers={"content-type": "application/json"})
        over = await c.post("/v1/completions", content=exact[:-1] + b" }", headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert at_limit.status_code == 200, at_limit.text
    assert over.status_code == 413


@pytest.mark.asyncio
async def test_a_response_closed_early_leaves_no_waiting_tasks(ingress):
    """A client that hangs up closes the watch over its choices: the waits still armed for the other
    choices are cancelled, not left on the event loop until their sequences change."""
    from specdec.sampling import SamplingParams
    app, ing, target = ingress
    seqs = ing.batcher.submit([[5, 6, 7]], [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * 2)
    watch = type(ing)._watch(ing, seqs)
    await watch.__anext__()
    await watch.aclose()
    await asyncio.sleep(0)
    waiting = [t for t in asyncio.all_tasks() if "Batcher.wait" in repr(t.get_coro()) and not t.done()]
    for s in seqs:
        ing.batcher.finish(s)
    assert not waiting
    await _idle(ing.batcher)
