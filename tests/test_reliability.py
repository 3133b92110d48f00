"""Reliability and security over HTTP on a tiny app: bad input (table-driven), API keys, request
logs without prompts or keys, configurable limits, overload (bounded queue, 503 + Retry-After)."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest

from openai_schema import validate
from service_checks import assert_idle, assert_idle_async

pytestmark = pytest.mark.ray

APP = "rel"
KEY = "sk-test-7f3c9a1e55d04b2c"
KEY2 = "sk-second-0b8e61d2aa"
SECRET_PROMPT = "zanzibar quokka marmalade 4417"  # must never show up in a log file
MAX_MODEL_LEN = 128
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def app(deploy, ray_cluster, tiny_dir, tiny_draft_dir, tmp_path_factory):
    keyfile = tmp_path_factory.mktemp("keys") / "api_keys"
    keyfile.write_text(f"# keys of the reliability tests\n{KEY}\n{KEY2}\n")
    url = deploy(APP, {
        "target": str(tiny_dir), "draft": str(tiny_draft_dir), "proposer": "draft", "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN, "num_speculative_tokens": 3, "batch_wait_timeout_s": 0.01,
        # capacity: one lane of 2 rows (2 target KV slots) + 2 queued sequences, beyond that 503
        "max_batch_size": 2, "lanes_per_target": 1, "max_queued_sequences": 2,
        "api": {"require_api_key": True, "api_keys_file": str(keyfile), "max_body_bytes": 8192,
                "max_tokens_limit": 200, "max_n": 4, "max_stop": 4, "max_stop_len": 32}})
    yield url, tiny_dir.name
    from ray import serve
    serve.delete(APP)


AUTH = {"Authorization": f"Bearer {KEY}"}


def _post(url, path, body, headers=None, **kw):
    h = {**AUTH, **(headers or {})}
    if isinstance(body, (bytes, str)) or hasattr(body, "__iter__") and not isinstance(body, dict):
        return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json", **h},
                          timeout=60, **kw)
    return httpx.post(f"{url}{path}", json=body, headers=h, timeout=60, **kw)


def _check_error(r, status, param=None, code=None, contains=None):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    validate(body, "ErrorResponse")
    err = body["error"]
    assert err["type"] == ("invalid_request_error" if status < 500 and status != 429 else "server_error"), err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if contains is not None:
        assert contains.lower() in err["message"].lower(), err
    return err


C, CHAT = "/v1/completions", "/v1/chat/completions"
M = "MODEL"  # replaced by the served model id
LONG_PROMPT = " ".join(f"w{i}" for i in range(300))  # far beyond 128 tokens, within the 8 KiB body limit

# (id, path, body, status, param, code, message substring). Bodies: dict (JSON), bytes/str (raw).
BAD_INPUTS = [
    # --- malformed bodies
    ("malformed-json", C, b'{"model": "x", "prompt": ', 400, None, None, "Invalid JSON"),
    ("empty-body", C, b"", 400, None, None, "Invalid JSON"),
    ("json-array", C, b"[1, 2]", 400, None, None, "expected a JSON object"),
    ("json-nan", C, b'{"model": "MODEL", "prompt": "a", "temperature": NaN}', 400, None, None, "Invalid JSON"),
    ("deeply-nested", C, b'{"model": "MODEL", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", 400, None, None, None),
    ("invalid-utf8", C, b'{"model": "MODEL", "prompt": "\xff\xfe caf\xe9"}', 400, None, None, "UTF-8"),
    ("lone-surrogate", C, b'{"model": "MODEL", "prompt": "abc \\ud800 def"}', 400, None, None, "surrogate"),
    # --- wrong types
    ("prompt-number", C, {"model": M, "prompt": 123}, 400, "prompt", None, None),
    ("max-tokens-string", C, {"model": M, "prompt": "a", "max_tokens": "10"}, 400, "max_tokens", None, None),
    ("max-tokens-bool", C, {"model": M, "prompt": "a", "max_tokens": True}, 400, "max_tokens", None, None),
    ("temperature-string", C, {"model": M, "prompt": "a", "temperature": "0.5"}, 400, "temperature", None, None),
    ("stream-string", C, {"model": M, "prompt": "a", "stream": "yes"}, 400, "stream", None, None),
    ("model-list", C, {"model": [M], "prompt": "a"}, 400, "model", None, None),
    ("stop-number", C, {"model": M, "prompt": "a", "stop": 5}, 400, "stop", None, None),
    ("messages-string", CHAT, {"model": M, "messages": "hi"}, 400, "messages", None, None),
    ("content-number", CHAT, {"model": M, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content", None, None),
    ("token-id-out-of-vocab", C, {"model": M, "prompt": [1, 2, 10**6]}, 400, "prompt", None, None),
    ("token-id-negative", C, {"model": M, "prompt": [1, -2]}, 400, "prompt", None, None),
    ("seed-beyond-int64", C, {"model": M, "prompt": "a", "seed": 2**64}, 400, "seed", None, None),
    ("top-k-beyond-int64", C, {"model": M, "prompt": "a", "top_k": 2**63}, 400, "top_k", None, None),
    # --- missing or empty fields
    ("missing-model", C, {"prompt": "a"}, 400, "model", None, "Missing required parameter"),
    ("missing-prompt", C, {"model": M}, 400, "prompt", None, "Missing required parameter"),
    ("empty-prompt", C, {"model": M, "prompt": ""}, 400, "prompt", None, None),
    ("empty-prompt-list", C, {"model": M, "prompt": []}, 400, "prompt", None, None),
    ("missing-messages", CHAT, {"model": M}, 400, "messages", None, "Missing required parameter"),
    ("empty-messages", CHAT, {"model": M, "messages": []}, 400, "messages", None, None),
    ("missing-role", CHAT, {"model": M, "messages": [{"content": "hi"}]}, 400, "messages.0.role", None, None),
    ("bad-role", CHAT, {"model": M, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role",
     None, None),
    # --- unknown model
    ("unknown-model", C, {"model": "gpt-17", "prompt": "a"}, 404, "model", "model_not_found", "does not exist"),
    ("unknown-model-chat", CHAT, {"model": "gpt-17", "messages": [{"role": "user", "content": "a"}]}, 404,
     "model", "model_not_found", None),
    # --- context window and max_tokens
    ("prompt-too-long", C, {"model": M, "prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt",
     "context_length_exceeded", "maximum context length"),
    ("token-prompt-too-long", C, {"model": M, "prompt": [5] * MAX_MODEL_LEN}, 400, "prompt",
     "context_length_exceeded", None),
    ("chat-too-long", CHAT, {"model": M, "messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages",
     "context_length_exceeded", None),
    ("max-tokens-zero", C, {"model": M, "prompt": "a", "max_tokens": 0}, 400, "max_tokens", None, None),
    ("max-tokens-negative", C, {"model": M, "prompt": "a", "max_tokens": -5}, 400, "max_tokens", None, None),
    ("max-completion-tokens-zero", CHAT, {"model": M, "messages": [{"role": "user", "content": "a"}],
                                          "max_completion_tokens": 0}, 400, "max_completion_tokens", None, None),
    ("max-tokens-beyond-context", C, {"model": M, "prompt": "a b c", "max_tokens": 150}, 400, "max_tokens",
     "context_length_exceeded", "maximum context length"),
    ("max-tokens-over-limit", C, {"model": M, "prompt": "a", "max_tokens": 201}, 400, "max_tokens", None,
     "between 1 and 200"),
    # --- sampling parameters
    ("temperature-negative", C, {"model": M, "prompt": "a", "temperature": -0.1}, 400, "temperature", None, None),
    ("temperature-too-high", C, {"model": M, "prompt": "a", "temperature": 2.5}, 400, "temperature", None, None),
    ("top-p-zero", C, {"model": M, "prompt": "a", "top_p": 0}, 400, "top_p", None, None),
    ("top-p-above-one", C, {"model": M, "prompt": "a", "top_p": 1.01}, 400, "top_p", None, None),
    ("n-zero", C, {"model": M, "prompt": "a", "n": 0}, 400, "n", None, None),
    ("n-too-large", C, {"model": M, "prompt": "a", "n": 5}, 400, "n", None, "at most 4"),
    ("more-sequences-than-the-server-holds", C, {"model": M, "prompt": ["a"] * 3, "n": 2}, 400, None, None,
     "too many sequences"),
    ("n-huge", CHAT, {"model": M, "messages": [{"role": "user", "content": "a"}], "n": 10**9}, 400, "n", None,
     None),
    ("stop-empty-list", C, {"model": M, "prompt": "a", "stop": []}, 400, "stop", None, "must not be empty"),
    ("stop-too-many", C, {"model": M, "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None,
     "at most 4"),
    ("stop-huge-list", CHAT, {"model": M, "messages": [{"role": "user", "content": "a"}],
                              "stop": [f"s{i}" for i in range(500)]}, 400, "stop", None, None),
    ("stop-too-long", C, {"model": M, "prompt": "a", "stop": "x" * 33}, 400, "stop", None, None),
    ("stop-empty-string", C, {"model": M, "prompt": "a", "stop": [""]}, 400, "stop", None, None),
    ("stream-options-without-stream", C, {"model": M, "prompt": "a", "stream_options": {"include_usage": True}},
     400, None, None, None),
    # --- unsupported or unknown parameters: a clear message, never silently ignored
    ("unknown-field", C, {"model": M, "prompt": "a", "frobnicate": 1}, 400, "frobnicate", None,
     "Unrecognized request argument"),
    ("logprobs", C, {"model": M, "prompt": "a", "logprobs": 2}, 400, "logprobs", None, "not supported"),
    ("best-of", C, {"model": M, "prompt": "a", "best_of": 3}, 400, "best_of", None, "not supported"),
    ("echo", C, {"model": M, "prompt": "a", "echo": True}, 400, "echo", None, "not supported"),
    ("presence-penalty", C, {"model": M, "prompt": "a", "presence_penalty": 0.5}, 400, "presence_penalty", None,
     "not supported"),
    ("tools", CHAT, {"model": M, "messages": [{"role": "user", "content": "a"}],
                     "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", None, "not supported"),
    ("json-mode", CHAT, {"model": M, "messages": [{"role": "user", "content": "a"}],
                         "response_format": {"type": "json_object"}}, 400, "response_format", None, "not supported"),
    ("image-part", CHAT, {"model": M, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages.0.content.0", None,
     "not supported"),
    ("chat-logprobs", CHAT, {"model": M, "messages": [{"role": "user", "content": "a"}], "logprobs": True}, 400,
     "logprobs", None, "not supported"),
    # --- size limits (api.max_body_bytes = 8192) and routes
    ("body-too-large", C, {"model": M, "prompt": "x" * 9000}, 413, None, "body_too_large", "too large"),
    ("body-too-large-chunked", C, iter([b'{"model": "MODEL", "prompt": "', b"y" * 6000, b"y" * 6000, b'"}']),
     413, None, "body_too_large", None),
    ("unknown-route", "/v1/nope", {"model": M}, 404, None, None, None),
    ("wrong-method", "/v1/models", {"model": M}, 405, None, None, None),
]


def _fill_model(body, model):
    if isinstance(body, dict):
        return json.loads(json.dumps(body).replace('"MODEL"', json.dumps(model)))
    if isinstance(body, bytes):
        return body.replace(b"MODEL", model.encode())
    return (chunk.replace(b"MODEL", model.encode()) for chunk in body)


def test_bad_inputs_get_openai_errors_and_leave_server_healthy(app):
    url, model = app
    failures = []
    for case_id, path, body, status, param, code, contains in BAD_INPUTS:
        r = _post(url, path, _fill_model(body, model))
        try:
            _check_error(r, status, param, code, contains)
        except (AssertionError, ValueError) as e:
            failures.append(f"{case_id}: {e}")
    assert not failures, "\n".join(failures)
    # still healthy: health, a normal request, and nothing held afterwards
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    r = _post(url, C, {"model": model, "prompt": "def f(x):", "max_tokens": 8, **GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    r = _post(url, CHAT, {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **GREEDY})
    assert r.status_code == 200, r.text
    state = assert_idle(APP, url, AUTH)
    assert state["target_free_slots"] == 2


def test_api_key_auth(app):
    url, model = app
    body = {"model": model, "prompt": "x = 1", "max_tokens": 2, **GREEDY}
    for headers in [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"},
                    {"Authorization": "Bearer"}, {"Authorization": KEY}]:
        r = httpx.post(f"{url}{C}", json=body, headers=headers, timeout=30)
        _check_error(r, 401, code="invalid_api_key", contains="API key")
        for path in ("/v1/models", f"/v1/models/{model}"):
            _check_error(httpx.get(f"{url}{path}", headers=headers, timeout=30), 401, code="invalid_api_key")
    # auth comes before body parsing: an unauthenticated garbage body is 401, not 400
    r = httpx.post(f"{url}{C}", content=b"{garbage", timeout=30)
    _check_error(r, 401)
    for key in (KEY, KEY2):  # every key in the file works, case-insensitive scheme
        r = httpx.post(f"{url}{C}", json=body, headers={"Authorization": f"bearer {key}"}, timeout=30)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # probes need no key
    # the openai client sends the key as a Bearer token
    import openai
    ok = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert ok.completions.create(model=model, prompt="y", max_tokens=2, temperature=0).usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model, prompt="y", max_tokens=2)


def _log_dir() -> Path:
    import ray
    return Path(ray._private.worker._global_node.get_logs_dir_path())


def test_request_logs_hold_neither_prompts_nor_keys(app):
    url, model = app
    secret_key_attempt = "sk-attacker-guess-55e1"
    # successful, streamed, failed and unauthorized requests all carrying the secret prompt
    assert _post(url, C, {"model": model, "prompt": SECRET_PROMPT, "max_tokens": 4, **GREEDY}).status_code == 200
    assert _post(url, CHAT, {"model": model, "messages": [{"role": "user", "content": SECRET_PROMPT}],
                             "max_tokens": 4, "stream": True, **GREEDY}).status_code == 200
    assert _post(url, C, {"model": model, "prompt": SECRET_PROMPT, "temperature": -1}).status_code == 400
    assert _post(url, C, {"model": "nope", "prompt": SECRET_PROMPT}).status_code == 404
    assert _post(url, C, {"model": model, "prompt": SECRET_PROMPT, "stop": "x" * 40}).status_code == 400
    assert httpx.post(f"{url}{C}", json={"model": model, "prompt": SECRET_PROMPT},
                      headers={"Authorization": f"Bearer {secret_key_attempt}"}).status_code == 401
    logs = _log_dir()
    serve_logs = list((logs / "serve").rglob("*"))
    assert any(p.name.startswith("replica_") for p in serve_logs)
    import time
    time.sleep(1.0)  # let the replicas' log handlers write
    offenders = []
    needles = [SECRET_PROMPT.encode(), KEY.encode(), KEY2.encode(), secret_key_attempt.encode()]
    for p in logs.rglob("*"):
        if not p.is_file():
            continue
        data = p.read_bytes()
        offenders += [f"{p}: {n.decode()!r}" for n in needles if n in data]
    assert not offenders, offenders
    # ... while the request itself was logged (method, path, status, time: Serve's access log)
    router_logs = b"".join(p.read_bytes() for p in serve_logs if p.is_file() and "Router" in p.name)
    assert re.search(rb"POST /%s/v1/completions 200 \d+\.\dms" % APP.encode(), router_logs)


def test_unexpected_error_is_an_openai_500_and_the_replica_stays_up(ray_cluster):
    """The ingress's handlers (serve_app.api.app) on a route that raises: OpenAI's 500, then the
    same replica answers again."""
    from fastapi import FastAPI
    from ray import serve

    from serve_app.api import app as ingress_app

    boom = FastAPI(exception_handlers=ingress_app.exception_handlers)

    @serve.deployment(ray_actor_options={"num_cpus": 0.01})
    @serve.ingress(boom)
    class Boom:
        @boom.get("/fail")
        async def fail(self):
            raise RuntimeError("unexpected")

        @boom.get("/ok")
        async def ok(self):
            return {"ok": True}

    serve.run(Boom.bind(), name="boom", route_prefix="/boom")
    try:
        for _ in range(2):
            _check_error(httpx.get(f"{ray_cluster}/boom/fail", timeout=60), 500, code="internal_error")
            assert httpx.get(f"{ray_cluster}/boom/ok", timeout=60).json() == {"ok": True}
    finally:
        serve.delete("boom")


@pytest.mark.asyncio
async def test_overload_sheds_with_503_and_retry_after(app):
    url, model = app
    n_req = 14

    async def one(c, i):
        body = {"model": model, "prompt": f"def f{i}(x):", "max_tokens": 40, **GREEDY}
        if i % 2:
            body["stream"] = True
            async with c.stream("POST", f"{url}{C}", json=body, headers=AUTH) as r:
                raw = await r.aread()
                return r.status_code, dict(r.headers), raw
        r = await c.post(f"{url}{C}", json=body, headers=AUTH)
        return r.status_code, dict(r.headers), r.content

    async def flood():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*[one(c, i) for i in range(n_req)])

    results = await flood()
    ok = [(s, h, b) for s, h, b in results if s == 200]
    shed = [(s, h, b) for s, h, b in results if s != 200]
    assert len(ok) >= 2 and shed, [s for s, _, _ in results]
    for s, h, b in shed:
        assert s in (429, 503), (s, b)
        assert "retry-after" in h, (s, h, b)
        assert int(h["retry-after"]) >= 1
        body = json.loads(b)
        validate(body, "ErrorResponse")
        assert body["error"]["type"] == "server_error" and body["error"]["code"] == "overloaded"
    for s, h, b in ok:  # every accepted request finished completely
        if h["content-type"].startswith("text/event-stream"):
            lines = [l for l in b.decode().splitlines() if l.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(l[6:]) for l in lines[:-1]]
            assert all("error" not in c for c in chunks)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        else:
            assert json.loads(b)["usage"]["completion_tokens"] == 40
    # a request asking for more sequences than the server can ever hold is a client error
    r = _post(url, C, {"model": model, "prompt": "a", "n": 4, "max_tokens": 2})
    assert r.status_code == 200, r.text  # 4 = 2 lane rows + 2 queued: fits when idle
    state = await assert_idle_async(APP, url, AUTH)
    assert state["target_free_slots"] == 2
    r = _post(url, C, {"model": model, "prompt": "a b", "max_tokens": 4, **GREEDY})
    assert r.status_code == 200


@pytest.mark.asyncio
async def test_kv_cache_budget_is_shared_and_never_exceeded(app):
    """8 concurrent requests over a 2-slot target (capacity: 2 lane rows + 2 queued, beyond that
    503): both slots are really used at once, requests beyond the slots wait (queued, or shed and
    retried), every request still produces its unloaded greedy output, the slot accounting
    (active + free = 2) holds at every sample, and both slots are free afterwards."""
    url, model = app
    from ray import serve
    target = serve.get_deployment_handle("Target", app_name=APP)
    prompts = [f"x{i} =" for i in range(8)]
    solo = {}
    for p in prompts:  # one at a time: the reference outputs
        r = _post(url, C, {"model": model, "prompt": p, "max_tokens": 24, **GREEDY})
        assert r.status_code == 200, r.text
        solo[p] = r.json()["choices"][0]["text"]
    slots, queued, shed = [], [], []

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            async def req(p):
                for _ in range(40):  # retry politely when shed
                    r = await c.post(f"{url}{C}", json={"model": model, "prompt": p, "max_tokens": 24, **GREEDY},
                                     headers=AUTH)
                    if r.status_code == 200:
                        return r
                    assert r.status_code == 503, r.text
                    shed.append(p)
                    await asyncio.sleep(float(r.headers["retry-after"]) / 4)
                return r

            async def watch():
                while True:
                    st = await target.stats.remote()
                    slots.append((st["active_sequences"], st["free_slots"]))
                    queued.append((await c.get(f"{url}/stats", headers=AUTH)).json()["queued"])
                    await asyncio.sleep(0.02)
            w = asyncio.ensure_future(watch())
            try:
                return await asyncio.gather(*[req(p) for p in prompts])
            finally:
                w.cancel()
    rs = await run()
    assert [r.status_code for r in rs] == [200] * len(prompts), [r.text for r in rs if r.status_code != 200]
    assert {p: r.json()["choices"][0]["text"] for p, r in zip(prompts, rs)} == solo
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in rs)
    assert all(active + free == 2 for active, free in slots), slots  # no slot lost or double-counted
    assert max(active for active, _ in slots) == 2, slots  # the two slots were shared by concurrent requests
    assert shed and max(queued) >= 1, (len(shed), queued)  # beyond the slots, requests waited
    state = await assert_idle_async(APP, url, AUTH)
    assert state["target_free_slots"] == 2


def test_api_keys_from_environment(monkeypatch, tmp_path):
    from serve_app import constants
    f = tmp_path / "keys"
    f.write_text("# comment\nsk-file-1\n\n  sk-file-2  \n  # an indented comment is no key\n")
    monkeypatch.setenv(constants.API_KEYS_ENV, "sk-env-1, sk-env-2,")
    monkeypatch.setenv(constants.API_KEYS_FILE_ENV, str(f))
    assert constants.load_api_keys() == ["sk-env-1", "sk-env-2", "sk-file-1", "sk-file-2"]
