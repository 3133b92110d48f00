"""The Ray Serve application end to end over HTTP, on tiny models (CPU, one local cluster)."""
import asyncio
import json
import time

import httpx
import openai
import pytest
import torch

from openai_schema import COMPLETION_CHUNK, validate
from service_checks import assert_idle, assert_idle_async, greedy_burst

pytestmark = pytest.mark.ray

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_app(deploy, ray_cluster, tiny_dir, tiny_draft_dir):
    url = deploy("tiny", {"target": str(tiny_dir), "draft": str(tiny_draft_dir), "proposer": "draft",
                          "max_model_len": 512, "dtype": "float32", "num_speculative_tokens": 3,
                          "batch_wait_timeout_s": 0.05})
    return url, tiny_dir.name


@pytest.fixture(scope="module")
def client(tiny_app):
    url, _ = tiny_app
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def post(url, path, body, **kw):
    return httpx.post(f"{url}{path}", json=body, timeout=120, **kw)


def test_models_and_health(tiny_app):
    url, model = tiny_app
    r = httpx.get(f"{url}/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == model
    validate(r.json(), "ListModelsResponse")
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    card = httpx.get(f"{url}/v1/models/{model}")  # the client's models.retrieve
    assert card.status_code == 200 and card.json() == r.json()["data"][0]
    validate(card.json(), "Model")
    missing = httpx.get(f"{url}/v1/models/org/other-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert "org/other-model" in missing.json()["error"]["message"]


def test_completion_chat_and_streaming_with_openai_client(tiny_app, client):
    url, model = tiny_app
    assert client.models.retrieve(model).id == model
    r = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=12, temperature=0)
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    assert r.usage.model_extra["speculative"]["rounds"] >= 1
    c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=8, temperature=0)
    assert c.choices[0].message.role == "assistant"
    chunks = list(client.completions.create(model=model, prompt="import os", max_tokens=10, temperature=0,
                                            stream=True))
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    full = client.completions.create(model=model, prompt="import os", max_tokens=10, temperature=0)
    assert streamed == full.choices[0].text
    chat_chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chat_chunks[-1].usage.completion_tokens == 6


def test_raw_bodies_validate_against_openai_schema(tiny_app):
    url, model = tiny_app
    body = post(url, "/v1/completions", {"model": model, "prompt": "x = ", "max_tokens": 5, **GREEDY}).json()
    validate(body, "CreateCompletionResponse")
    body = post(url, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "a"}],
                                              "max_tokens": 5, **GREEDY}).json()
    validate(body, "CreateChatCompletionResponse")
    for path, req, schema in [
        ("/v1/completions", {"prompt": "y = "}, COMPLETION_CHUNK),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b"}]},
         "CreateChatCompletionStreamResponse")]:
        with httpx.stream("POST", f"{url}{path}", json={"model": model, "max_tokens": 5, "stream": True, **req,
                                                        **GREEDY}, timeout=60) as r:
            lines = [l for l in r.iter_lines() if l.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for l in lines[:-1]:
            chunk = json.loads(l[6:])
            validate(chunk, schema)
    err = post(url, "/v1/completions", {"model": model, "prompt": "x", "temperature": -1})
    assert err.status_code == 400
    validate(err.json(), "ErrorResponse")


def _complete(url, model, prompt, n_tokens=24, **extra):
    r = post(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n_tokens, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


PROMPTS = ["def add(a, b):", "import json\n", "class Foo:", "for i in range(", "x = [1, 2,", "# comment\n",
           "while True:", "return self."]


@pytest.mark.asyncio
async def test_greedy_speculation_equals_plain_also_under_load(tiny_app):
    url, model = tiny_app
    plain = [_complete(url, model, p, num_speculative_tokens=0)["choices"][0]["text"] for p in PROMPTS]
    spec = [_complete(url, model, p, num_speculative_tokens=3) for p in PROMPTS]
    assert [s["choices"][0]["text"] for s in spec] == plain
    assert sum(s["usage"]["speculative"]["proposed_tokens"] for s in spec) > 0

    before = httpx.get(f"{url}/stats").json()
    loaded = await greedy_burst(url, model, PROMPTS * 2, 24)
    after = httpx.get(f"{url}/stats").json()
    assert loaded == plain * 2
    rounds = after["rounds"] - before["rounds"]
    rows = after["row_rounds"] - before["row_rounds"]
    assert rows / rounds > 1.5  # concurrent requests really shared rounds
    gate = after["lookup_gate"]  # /stats: the LookupGate's measured lookup costs and its choices
    assert set(gate) == {"cost", "straggle", "rounds", "rounds_without"} and gate["rounds"] >= gate["rounds_without"] >= 0


def test_plain_requests_run_multi_step_rounds_with_one_step_output(tiny_app, tiny_dir, tiny_tok):
    """Requests without speculation run multi-step plain rounds (plain_steps 8 by default): seeded
    sampled and greedy text over HTTP equal the in-process engine's one-step rounds, and the
    router made fewer rounds than tokens."""
    from specdec.engine import EngineConfig, LLMEngine
    from specdec.loader import load_model
    from specdec.sampling import SamplingParams
    from specdec.target_worker import TargetWorker
    url, model = tiny_app
    prompt = [5, 6, 7, 8, 9]
    cases = [{"temperature": 0.8, "top_p": 0.95, "seed": 5}, {"temperature": 0}]
    eng = LLMEngine(TargetWorker(load_model(tiny_dir), 1, 512), None, tiny_tok,
                    EngineConfig(max_batch_size=1, speculate=False, plain_steps=1))
    refs = [eng.generate([prompt], SamplingParams(max_tokens=21, ignore_eos=True, **c))[0].text for c in cases]
    before = httpx.get(f"{url}/stats").json()
    texts = [post(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 21, "ignore_eos": True,
                                           "num_speculative_tokens": 0, **c}).json()["choices"][0]["text"]
             for c in cases]
    after = httpx.get(f"{url}/stats").json()
    assert texts == refs
    assert after["rounds"] - before["rounds"] < after["emitted"] - before["emitted"]  # several tokens a call


def test_n_samples_and_seeds(tiny_app):
    url, model = tiny_app
    body = {"model": model, "prompt": "def f(", "max_tokens": 6, "temperature": 1.0, "n": 64, "seed": 7}
    a = post(url, "/v1/completions", body).json()
    assert len(a["choices"]) == 64 and sorted(c["index"] for c in a["choices"]) == list(range(64))
    assert len({c["text"] for c in a["choices"]}) > 1
    b = post(url, "/v1/completions", body).json()
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    # Every finished sequence released its draft and target slots. A lane sends its last releases
    # after it has woken the request (the response does not wait for them), so they may land a few
    # ms after the response: wait for them (bounded), then assert.
    state = assert_idle("tiny", url)
    assert state["draft_active"] == 0 and state["target_active"] == 0, state


def test_client_disconnect_frees_slots(tiny_app):
    url, model = tiny_app
    from ray import serve
    target = serve.get_deployment_handle("Target", app_name="tiny")
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": model, "prompt": "def", "max_tokens": 400,
                                                             "stream": True, **GREEDY}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break  # leaving the block closes the connection mid-stream
    deadline = time.time() + 30
    while time.time() < deadline:
        stats = target.stats.remote().result()
        router = httpx.get(f"{url}/stats").json()
        if stats["active_sequences"] == 0 and router["running"] == 0:
            break
        time.sleep(0.5)
    # the loop also ends on its deadline: both conditions are asserted, and then nothing is held
    assert stats["active_sequences"] == 0, stats
    assert router["running"] == 0 and router["queued"] == 0, router
    assert_idle("tiny", url)


def test_tensor_parallel_2_matches_tp_1(deploy, ray_cluster, tiny_dir, tiny_app):
    url1, model = tiny_app
    url2 = deploy("tp2", {"target": str(tiny_dir), "proposer": "ngram", "tp": 2, "max_model_len": 512,
                          "dtype": "float32", "target_cpus": 0.25})
    for p in PROMPTS[:4]:
        assert _complete(url2, model, p)["choices"][0]["text"] == _complete(url1, model, p)["choices"][0]["text"]
    from ray import serve
    stats = serve.get_deployment_handle("Target", app_name="tp2").stats.remote().result()
    assert len(stats["tp_worker_pids"]) == 1 and stats["tp_worker_pids"][0] != stats["pid"]
    serve.delete("tp2")


def test_eagle_hybrid_over_tensor_parallel_matches_plain(deploy, ray_cluster, tiny_dir, tiny_eagle_dir, tiny_app):
    """An EAGLE draft in the hybrid proposer, target TP=2: the features of confirmed positions
    travel target rank 0 -> router -> draft, and greedy output still equals plain decoding; also
    for a prompt that enters in two rounds (max_prefill_tokens), its first chunks by SDPA on every rank."""
    url1, model = tiny_app
    url2 = deploy("eagle", {"target": str(tiny_dir), "proposer": "hybrid", "draft": str(tiny_eagle_dir), "tp": 2,
                            "max_model_len": 512, "dtype": "float32", "target_cpus": 0.25,
                            "num_speculative_tokens": 3, "adaptive": False})
    prompts = PROMPTS[:4] + [[(7 * i) % 500 + 3 for i in range(300)]]
    plain = [_complete(url1, model, p, num_speculative_tokens=0)["choices"][0]["text"] for p in prompts]
    spec = [_complete(url2, model, p) for p in prompts]
    assert [s["choices"][0]["text"] for s in spec] == plain
    assert sum(s["usage"]["speculative"]["proposed_tokens"] for s in spec) > 0
    body = {"model": model, "prompt": "def f(", "max_tokens": 8, "temperature": 1.0, "n": 4, "seed": 11}
    a, b = post(url2, "/v1/completions", body).json(), post(url2, "/v1/completions", body).json()
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert_idle("eagle", url2)  # releases trail the response (see test_n_samples_and_seeds)
    from ray import serve
    serve.delete("eagle")


@pytest.mark.asyncio
async def test_draft_in_target_is_plain_decoding_through_http(deploy, ray_cluster, tiny_dir, tiny_eagle_dir, tiny_app):
    """The default app's shape (hybrid EAGLE, tp=1, adaptive): the Target replica's copy of the draft
    drafts in multi-step plain rounds; greedy output still equals plain decoding, alone and 8 at a
    time, seeded samples repeat, and finished sequences leave nothing in its draft."""
    url1, model = tiny_app
    url = deploy("intarget", {"target": str(tiny_dir), "proposer": "hybrid", "draft": str(tiny_eagle_dir),
                              "max_model_len": 512, "dtype": "float32", "target_cpus": 0.25})
    plain = [_complete(url1, model, p, n_tokens=32, num_speculative_tokens=0)["choices"][0]["text"] for p in PROMPTS]
    assert [_complete(url, model, p, n_tokens=32)["choices"][0]["text"] for p in PROMPTS] == plain
    assert await greedy_burst(url, model, PROMPTS, 32) == plain
    stats = httpx.get(f"{url}/stats").json()
    assert stats["target_drafted"] > 0 and stats["target_drafted"] <= stats["lookup_proposed"]
    body = {"model": model, "prompt": "def f(", "max_tokens": 16, "temperature": 1.0, "n": 3, "seed": 7}
    a, b = post(url, "/v1/completions", body).json(), post(url, "/v1/completions", body).json()
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    unseeded = post(url, "/v1/completions", {**body, "seed": None, "ignore_eos": True}).json()  # raced chains
    assert unseeded["usage"]["completion_tokens"] == 3 * 16
    await assert_idle_async("intarget", url)
    from ray import serve
    assert (await serve.get_deployment_handle("Target", app_name="intarget").stats.remote())["draft_in_target_active"] == 0
    await asyncio.to_thread(serve.delete, "intarget")


def test_builder_refuses_bad_args(tiny_dir, tiny_draft_dir, tmp_path):
    from serve_app import build_app
    with pytest.raises(ValueError, match="does not divide"):
        build_app({"target": str(tiny_dir), "tp": 3, "max_model_len": 512})
    with pytest.raises(ValueError, match="needs draft"):
        build_app({"target": str(tiny_dir), "proposer": "draft", "max_model_len": 512})
    with pytest.raises(Exception, match="does not exist"):
        build_app({"target": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="max_model_len"):
        build_app({"target": str(tiny_dir), "max_model_len": 100000})
    with pytest.raises(ValueError, match="needs an EAGLE-style draft"):
        build_app({"target": str(tiny_dir), "proposer": "eagle", "draft": str(tiny_draft_dir), "max_model_len": 512})


def test_lanes_spread_over_replicas_and_keep_affinity(deploy, ray_cluster, tiny_dir):
    """Two target replicas, one sequence per lane: the second lane goes to the other replica, and
    every round of a lane reaches the replica that holds its KV cache (no re-prefill)."""
    url = deploy("affine", {"target": str(tiny_dir), "proposer": "ngram", "max_model_len": 512, "target_replicas": 2,
                            "lanes_per_target": 1, "max_batch_size": 1, "target_cpus": 0.25})
    model = tiny_dir.name
    long_solo = _complete(url, model, PROMPTS[0], n_tokens=160)["choices"][0]["text"]
    short_solo = _complete(url, model, PROMPTS[1], n_tokens=24)["choices"][0]["text"]
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 160, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        text = []
        for line in lines:  # the long request's lane is running and pinned once a token arrived
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
                break
        before = httpx.get(f"{url}/stats").json()
        pin1 = next(p for p in before["lane_targets"] if p)
        short = _complete(url, model, PROMPTS[1], n_tokens=24)["choices"][0]["text"]  # a second lane meanwhile
        mid = httpx.get(f"{url}/stats").json()
        for line in lines:
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(text) == long_solo and short == short_solo
    stats = httpx.get(f"{url}/stats").json()
    assert stats["target_resyncs"] == 0 and stats["draft_resyncs"] == 0  # affinity held every round
    other = {rid: n - before["rounds_by_target"].get(rid, 0) for rid, n in mid["rounds_by_target"].items()
             if rid != pin1}
    # the second lane's rounds (its prefill and 23 tokens, up to plain_steps per round) ran on the other replica
    assert sum(other.values()) >= 3
    from ray import serve
    serve.delete("affine")
