"""Tests of serve_app/protocol/: request validation, error format, engine mapping, and the
shapes of every response against OpenAI's official OpenAPI schemas (tests/openai_schema.py)."""
from __future__ import annotations

import copy
import json

import pytest
from pydantic import BaseModel

from serve_app import protocol as P
from serve_app.protocol import APIError, ChatCompletionRequest, CompletionRequest, SpeculativeUsage
from serve_app.protocol import requests as protocol_requests
from serve_app.protocol import responses as protocol_responses

try:
    from tests import openai_schema
    from tests.shared_files import missing_resource
except ImportError:  # tests/ itself is on sys.path (pytest's default rootdir handling)
    import openai_schema
    from shared_files import missing_resource

USER = [{"role": "user", "content": "Hello"}]


def body(obj) -> bytes:
    """A request body as the HTTP layer receives it."""
    return json.dumps(obj).encode()


@pytest.fixture(scope="session")
def spec():
    """The normalised OpenAI document (absent shared/openai-openapi: skip locally, fail in CI)."""
    try:
        return openai_schema.load_document()
    except FileNotFoundError as e:
        missing_resource(str(e))


# --------------------------------------------------------------------------------------------
# valid requests
# --------------------------------------------------------------------------------------------

VALID_COMPLETIONS = [
    {"model": "m", "prompt": "Once upon a time"},
    {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 5},
    {"model": "m", "prompt": [1, 2, 3]},
    {"model": "m", "prompt": [[1, 2], [3]], "stop": ["\n", "END"]},
    {"model": "m", "prompt": "x", "temperature": 0, "top_p": 0.9, "seed": 7, "stop": "\n",
     "stream": True, "stream_options": {"include_usage": True}, "user": "u1"},
    {"model": "m", "prompt": "x", "max_tokens": None, "temperature": None, "top_p": None,
     "n": None, "stream": None, "stop": None, "seed": None},
    {"model": "m", "prompt": "x", "logprobs": None, "echo": False, "best_of": 1, "suffix": None,
     "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}},
    {"model": "m", "prompt": "x", "top_k": 40, "num_speculative_tokens": 4, "ignore_eos": True,
     "stop_token_ids": [2, 3]},
    {"model": "m", "prompt": "x", "top_k": -1, "num_speculative_tokens": 0},
]

VALID_CHATS = [
    {"model": "m", "messages": USER},
    {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "Really."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                     {"type": "text", "text": "there"}], "name": "bob"},
        {"role": "assistant", "content": None, "refusal": None},
        {"role": "assistant", "content": "Hello!", "tool_calls": []},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "user", "content": "Thanks"},
    ]},
    {"model": "m", "messages": USER, "max_completion_tokens": 8, "temperature": 0.5,
     "top_p": 0.5, "n": 3, "stop": ["a", "b"], "seed": -5, "user": "u"},
    {"model": "m", "messages": USER, "max_tokens": 8},
    {"model": "m", "messages": USER, "max_tokens": 8, "max_completion_tokens": 8},
    {"model": "m", "messages": USER, "stream": True, "stream_options": {"include_usage": False}},
    {"model": "m", "messages": USER, "logprobs": False, "top_logprobs": None, "tools": [],
     "tool_choice": "none", "response_format": {"type": "text"}, "modalities": ["text"],
     "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "audio": None,
     "parallel_tool_calls": False, "store": False, "service_tier": "auto",
     "metadata": {"k": "v"}, "safety_identifier": "s", "prompt_cache_key": "p"},
    {"model": "m", "messages": USER, "top_k": 5, "num_speculative_tokens": 2,
     "ignore_eos": False, "stop_token_ids": []},
]


@pytest.mark.parametrize("req", VALID_COMPLETIONS)
def test_valid_completion_requests_parse(req):
    parsed = P.parse_request(CompletionRequest, body(req))
    assert parsed.model == "m"
    assert parsed.prompts() and all(len(p) > 0 for p in parsed.prompts())


@pytest.mark.parametrize("req", VALID_CHATS)
def test_valid_chat_requests_parse(req):
    parsed = P.parse_request(ChatCompletionRequest, body(req))
    dicts = parsed.messages_as_dicts()
    assert len(dicts) == len(req["messages"])
    assert all(set(d) == {"role", "content"} and isinstance(d["content"], str) for d in dicts)


@pytest.mark.parametrize("req", VALID_COMPLETIONS)
def test_completion_requests_match_openai_schema(spec, req):
    openai_schema.validate(req, "CreateCompletionRequest")
    dumped = CompletionRequest.model_validate(req).model_dump(exclude_none=True)
    openai_schema.validate(dumped, "CreateCompletionRequest")


@pytest.mark.parametrize("req", VALID_CHATS)
def test_chat_requests_match_openai_schema(spec, req):
    openai_schema.validate(req, "CreateChatCompletionRequest")
    dumped = ChatCompletionRequest.model_validate(req).model_dump(exclude_none=True)
    openai_schema.validate(dumped, "CreateChatCompletionRequest")


@pytest.mark.parametrize("prompt, expected", [
    ("abc", ["abc"]),
    (["a", "b"], ["a", "b"]),
    ([5, 6], [[5, 6]]),
    ([[5], [6, 7]], [[5], [6, 7]]),
])
def test_prompts_normalisation(prompt, expected):
    assert CompletionRequest(model="m", prompt=prompt).prompts() == expected


def test_messages_as_dicts():
    req = ChatCompletionRequest(model="m", messages=[
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ])
    assert req.messages_as_dicts() == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]


# --------------------------------------------------------------------------------------------
# invalid requests: (request, expected param, substring of the message)
# --------------------------------------------------------------------------------------------

C = {"model": "m", "prompt": "x"}
CH = {"model": "m", "messages": USER}
UNRECOGNIZED = "Unrecognized request argument supplied"
NOT_SUPPORTED = "not supported"

INVALID_COMPLETIONS = [
    # unknown fields, like OpenAI
    ({**C, "foo": 1}, "foo", f"{UNRECOGNIZED}: foo"),
    ({**C, "max_completion_tokens": 5}, "max_completion_tokens", UNRECOGNIZED),
    ({**C, "stream": True, "stream_options": {"bogus": True}}, "stream_options.bogus",
     UNRECOGNIZED),
    # unsupported OpenAI parameters
    ({**C, "logprobs": 0}, "logprobs", NOT_SUPPORTED),
    ({**C, "logprobs": 5}, "logprobs", NOT_SUPPORTED),
    ({**C, "echo": True}, "echo", NOT_SUPPORTED),
    ({**C, "best_of": 2}, "best_of", NOT_SUPPORTED),
    ({**C, "suffix": "end"}, "suffix", NOT_SUPPORTED),
    ({**C, "logit_bias": {"50256": -100}}, "logit_bias", NOT_SUPPORTED),
    ({**C, "presence_penalty": 0.5}, "presence_penalty", NOT_SUPPORTED),
    ({**C, "frequency_penalty": -1}, "frequency_penalty", NOT_SUPPORTED),
    # missing / wrongly typed / out of range
    ({"prompt": "x"}, "model", "Missing required parameter"),
    ({"model": "m"}, "prompt", "Missing required parameter"),
    ({**C, "model": 3}, "model", "Invalid type"),
    ({**C, "prompt": ""}, "prompt", "empty"),
    ({**C, "prompt": []}, "prompt", "prompt"),
    ({**C, "prompt": ["a", ""]}, "prompt", "empty"),
    ({**C, "prompt": [[1], []]}, "prompt", "non-empty"),
    ({**C, "prompt": [1, -2]}, "prompt", "non-negative"),
    ({**C, "prompt": [1, "a"]}, "prompt", "mixed"),
    ({**C, "prompt": [True, False]}, "prompt", "prompt"),
    ({**C, "prompt": {"text": "x"}}, "prompt", "prompt"),
    ({**C, "temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({**C, "temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({**C, "temperature": "1"}, "temperature", "Invalid type"),
    ({**C, "top_p": 0}, "top_p", "greater than 0"),
    ({**C, "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({**C, "n": 0}, "n", "greater than or equal to 1"),
    ({**C, "n": 1.5}, "n", "Invalid type"),
    ({**C, "n": True}, "n", "Invalid type"),
    ({**C, "max_tokens": "16"}, "max_tokens", "Invalid type"),
    ({**C, "stream": "yes"}, "stream", "Invalid type"),
    ({**C, "stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
    ({**C, "stream": True, "stream_options": 1}, "stream_options", "Invalid"),
    ({**C, "stop": 5}, "stop", "stop"),
    ({**C, "stop": ["a", 1]}, "stop", "stop"),
    ({**C, "seed": 2**64}, "seed", "less than or equal"),
    ({**C, "user": 5}, "user", "Invalid type"),
    ({**C, "top_k": -2}, "top_k", "greater than or equal to -1"),
    ({**C, "num_speculative_tokens": -1}, "num_speculative_tokens", "greater than or equal to 0"),
    ({**C, "ignore_eos": 1}, "ignore_eos", "Invalid type"),
    ({**C, "stop_token_ids": [1, -1]}, "stop_token_ids.1", "greater than or equal to 0"),
    ({**C, "stop_token_ids": 3}, "stop_token_ids", "Invalid type"),
]

INVALID_CHATS = [
    ({**CH, "foo": 1}, "foo", f"{UNRECOGNIZED}: foo"),
    ({**CH, "prompt": "x"}, "prompt", UNRECOGNIZED),
    ({**CH, "messages": [{"role": "user", "content": "a", "extra": 1}]}, "messages.0.extra",
     UNRECOGNIZED),
    ({**CH, "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
     "messages.0.content.0.x", UNRECOGNIZED),
    # unsupported OpenAI parameters
    ({**CH, "logprobs": True}, "logprobs", NOT_SUPPORTED),
    ({**CH, "top_logprobs": 2}, "top_logprobs", NOT_SUPPORTED),
    ({**CH, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", NOT_SUPPORTED),
    ({**CH, "tool_choice": "auto"}, "tool_choice", NOT_SUPPORTED),
    ({**CH, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     NOT_SUPPORTED),
    ({**CH, "functions": [{"name": "f"}]}, "functions", NOT_SUPPORTED),
    ({**CH, "function_call": "auto"}, "function_call", NOT_SUPPORTED),
    ({**CH, "response_format": {"type": "json_object"}}, "response_format", NOT_SUPPORTED),
    ({**CH, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", NOT_SUPPORTED),
    ({**CH, "logit_bias": {"1": 5}}, "logit_bias", NOT_SUPPORTED),
    ({**CH, "presence_penalty": 1}, "presence_penalty", NOT_SUPPORTED),
    ({**CH, "frequency_penalty": 0.1}, "frequency_penalty", NOT_SUPPORTED),
    ({**CH, "audio": {"voice": "alloy", "format": "wav"}}, "audio", NOT_SUPPORTED),
    ({**CH, "modalities": ["text", "audio"]}, "modalities", NOT_SUPPORTED),
    ({**CH, "store": True}, "store", NOT_SUPPORTED),
    ({**CH, "service_tier": "flex"}, "service_tier", NOT_SUPPORTED),
    ({**CH, "reasoning_effort": "high"}, "reasoning_effort", NOT_SUPPORTED),
    ({**CH, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content.1", NOT_SUPPORTED),
    ({**CH, "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls", NOT_SUPPORTED),
    # missing / wrongly typed / out of range
    ({"model": "m"}, "messages", "Missing required parameter"),
    ({"messages": USER}, "model", "Missing required parameter"),
    ({**CH, "messages": []}, "messages", "at least 1"),
    ({**CH, "messages": "hi"}, "messages", "Invalid type"),
    ({**CH, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'user'"),
    ({**CH, "messages": [{"content": "x"}]}, "messages.0.role", "Missing required parameter"),
    ({**CH, "messages": [{"role": "user"}]}, "messages.0.content", "content"),
    ({**CH, "messages": [{"role": "user", "content": None}]}, "messages.0.content", "content"),
    ({**CH, "messages": [{"role": "user", "content": []}]}, "messages.0.content", "content"),
    ({**CH, "messages": [{"role": "user", "content": 5}]}, "messages.0.content", "content"),
    ({**CH, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0", "content part"),
    ({**CH, "messages": [{"role": "user", "content": ["hi"]}]}, "messages.0.content.0",
     "content part"),
    ({**CH, "messages": [USER[0], {"role": "user", "content": "x", "name": 3}]},
     "messages.1.name", "Invalid type"),
    ({**CH, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "disagree"),
    ({**CH, "max_completion_tokens": "5"}, "max_completion_tokens", "Invalid type"),
    ({**CH, "temperature": 3}, "temperature", "less than or equal to 2"),
    ({**CH, "top_p": -1}, "top_p", "greater than 0"),
    ({**CH, "n": 0}, "n", "greater than or equal to 1"),
    ({**CH, "stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
    ({**CH, "stop": {"a": 1}}, "stop", "stop"),
    ({**CH, "top_k": "5"}, "top_k", "Invalid type"),
]


def _expect_400(cls, raw: bytes, param: str | None, fragment: str) -> APIError:
    with pytest.raises(APIError) as info:
        P.parse_request(cls, raw)
    err = info.value
    assert err.status == 400
    assert err.type == "invalid_request_error"
    assert err.param == param, err.message
    assert fragment in err.message, err.message
    return err


@pytest.mark.parametrize("req, param, fragment", INVALID_COMPLETIONS)
def test_invalid_completion_requests(req, param, fragment):
    _expect_400(CompletionRequest, body(req), param, fragment)


@pytest.mark.parametrize("req, param, fragment", INVALID_CHATS)
def test_invalid_chat_requests(req, param, fragment):
    _expect_400(ChatCompletionRequest, body(req), param, fragment)


def test_unknown_field_is_reported_before_other_errors():
    err = _expect_400(ChatCompletionRequest, body({**CH, "temperature": 9, "zzz": 1}), "zzz",
                      UNRECOGNIZED)
    assert "1 more error" in err.message


@pytest.mark.parametrize("raw, fragment", [
    (b"{not json", "Invalid JSON body"),
    (b"", "Invalid JSON body"),
    (b'{"model": "m", "prompt": "x",}', "Invalid JSON body"),
    (b'{"model": "m", "prompt": "x", "temperature": NaN}', "NaN"),
    (b'{"model": "m", "prompt": "x", "temperature": Infinity}', "Infinity"),
    (b"[1, 2]", "expected a JSON object"),
    (b'"a string"', "expected a JSON object"),
    (b"null", "expected a JSON object"),
    (b"42", "expected a JSON object"),
    (b'{"model": "m", "prompt": "\xff\xfe"}', "UTF-8"),
    (b"\xef\xbb", "UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "Invalid JSON body"),
])
def test_malformed_bodies(raw, fragment):
    err = _expect_400(CompletionRequest, raw, None, fragment)
    assert err.body()["error"]["param"] is None


def test_parse_request_accepts_str_and_non_ascii():
    req = P.parse_request(ChatCompletionRequest,
                          json.dumps({**CH, "messages": [{"role": "user", "content": "héllo ✓"}]}))
    assert req.messages_as_dicts()[0]["content"] == "héllo ✓"


# --------------------------------------------------------------------------------------------
# engine mapping and deployment limits
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls, req, expected", [
    # absent max_tokens: the caller's default (the API passes OpenAI's 16, capped by max_tokens_limit)
    (CompletionRequest, C, dict(max_tokens=100, temperature=1.0, top_p=1.0, top_k=0, seed=None,
                                stop=[], stop_token_ids=[], ignore_eos=False,
                                num_speculative_tokens=None)),
    (CompletionRequest, {**C, "max_tokens": None}, dict(max_tokens=100)),
    (CompletionRequest, {**C, "stop": "\n", "top_k": -1, "temperature": 0},
     dict(stop=["\n"], top_k=0, temperature=0.0)),
    (CompletionRequest, {**C, "stop": ["a", "b"], "top_k": 7, "seed": 3, "top_p": 0.5,
                         "ignore_eos": True, "stop_token_ids": [9], "num_speculative_tokens": 0},
     dict(stop=["a", "b"], top_k=7, seed=3, top_p=0.5, ignore_eos=True, stop_token_ids=[9],
          num_speculative_tokens=0)),
    (CompletionRequest, {**C, "temperature": None, "top_p": None, "top_k": None,
                         "ignore_eos": None}, dict(temperature=1.0, top_p=1.0, top_k=0,
                                                   ignore_eos=False)),
    (ChatCompletionRequest, CH, dict(max_tokens=100, temperature=1.0, stop=[])),
    (ChatCompletionRequest, {**CH, "max_tokens": 7}, dict(max_tokens=7)),
    (ChatCompletionRequest, {**CH, "max_completion_tokens": 9}, dict(max_tokens=9)),
    (ChatCompletionRequest, {**CH, "num_speculative_tokens": 3, "top_k": 0},
     dict(num_speculative_tokens=3, top_k=0)),
])
def test_to_sampling_params(cls, req, expected):
    params = P.to_sampling_params(cls.model_validate(req), default_max_tokens=100)
    for name, value in expected.items():
        assert getattr(params, name) == value, name


def test_to_sampling_params_reports_engine_rejection_as_400():
    req = ChatCompletionRequest.model_validate({**CH, "max_completion_tokens": 0})
    with pytest.raises(APIError) as info:
        P.to_sampling_params(req, default_max_tokens=10)
    assert info.value.status == 400 and info.value.param == "max_completion_tokens"


LIMITS = dict(max_n=4, max_stop=2, max_stop_len=5, max_tokens_limit=100)


@pytest.mark.parametrize("cls, req, param", [
    (CompletionRequest, C, None),
    (CompletionRequest, {**C, "n": 4, "stop": ["ab", "cdefg"], "max_tokens": 100}, None),
    (ChatCompletionRequest, {**CH, "max_completion_tokens": 1, "stop": "x"}, None),
    (CompletionRequest, {**C, "n": 5}, "n"),
    (ChatCompletionRequest, {**CH, "n": 5}, "n"),
    (CompletionRequest, {**C, "stop": []}, "stop"),
    (CompletionRequest, {**C, "stop": ["a", "b", "c"]}, "stop"),
    (CompletionRequest, {**C, "stop": ["a", ""]}, "stop"),
    (CompletionRequest, {**C, "stop": ""}, "stop"),
    (ChatCompletionRequest, {**CH, "stop": "toolong"}, "stop"),
    (ChatCompletionRequest, {**CH, "stop": ["ok", "toolong"]}, "stop"),
    (CompletionRequest, {**C, "max_tokens": 101}, "max_tokens"),
    (CompletionRequest, {**C, "max_tokens": 0}, "max_tokens"),
    (CompletionRequest, {**C, "max_tokens": -3}, "max_tokens"),
    (ChatCompletionRequest, {**CH, "max_tokens": 101}, "max_tokens"),
    (ChatCompletionRequest, {**CH, "max_completion_tokens": 101}, "max_completion_tokens"),
    (ChatCompletionRequest, {**CH, "max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_validate_limits(cls, req, param):
    parsed = cls.model_validate(req)
    if param is None:
        P.validate_limits(parsed, **LIMITS)
        return
    with pytest.raises(APIError) as info:
        P.validate_limits(parsed, **LIMITS)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_request_properties():
    req = ChatCompletionRequest.model_validate(
        {**CH, "stream": True, "stream_options": {"include_usage": True}, "n": None})
    assert req.include_usage and req.num_choices == 1
    assert not ChatCompletionRequest.model_validate(CH).include_usage
    assert CompletionRequest.model_validate({**C, "stop": "s"}).stop_list == ["s"]


# --------------------------------------------------------------------------------------------
# responses against OpenAI's schemas
# --------------------------------------------------------------------------------------------

SPEC = SpeculativeUsage(proposed_tokens=12, accepted_tokens=9, rounds=4)
USAGE = P.usage(5, 13, speculative=SPEC)
IDS = dict(request_id="cmpl-test", model="m", created=1_700_000_000)


def _dumps(model: BaseModel | dict) -> list[dict]:
    """Every way the router may send a response (JSON body, SSE event); all the same OpenAI shape."""
    if isinstance(model, dict):
        return [model]
    forms = [P.wire(model), json.loads(P.sse(model)[len("data: "):])]
    assert all(f == forms[0] for f in forms), forms
    return forms[:1]


def _check(model: BaseModel | dict, schema_name: str) -> dict:
    for obj in _dumps(model):
        openai_schema.validate(obj, schema_name)
    return _dumps(model)[0]


def test_usage_total():
    assert USAGE.total_tokens == 18
    assert P.wire(P.usage(1, 2)) == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


def test_completion_response(spec):
    resp = P.CompletionResponses(model="m").response(["a", "bc"], ["stop", "length"], USAGE)
    obj = _check(resp, "CreateCompletionResponse")
    assert obj["id"].startswith("cmpl-") and obj["object"] == "text_completion"
    assert [c["index"] for c in obj["choices"]] == [0, 1]
    assert obj["choices"][1] == {"index": 1, "text": "bc", "finish_reason": "length",
                                 "logprobs": None}
    assert obj["usage"]["speculative"] == {"proposed_tokens": 12, "accepted_tokens": 9,
                                           "rounds": 4}
    with pytest.raises(ValueError):
        P.CompletionResponses(model="m").response(["a"], [], USAGE)


def test_completion_chunks(spec):
    out = P.CompletionResponses(**IDS)
    assert out.opening(2) == []
    mid = out.chunk(1, "Hel")
    obj = _check(mid, openai_schema.COMPLETION_CHUNK)
    assert obj["choices"] == [{"index": 1, "text": "Hel", "finish_reason": None, "logprobs": None}]
    assert "usage" not in obj
    last = out.finish(0, "stop")
    _check(last, "CreateCompletionResponse")
    usage_chunk = out.usage_chunk(USAGE)
    obj = _check(usage_chunk, "CreateCompletionResponse")
    assert obj["choices"] == [] and "speculative" not in obj["usage"]
    assert obj["usage"]["total_tokens"] == 18


def test_chat_response(spec):
    resp = P.ChatResponses(model="m", created=123).response(["Paris.", ""], ["stop", "length"], USAGE)
    obj = _check(resp, "CreateChatCompletionResponse")
    assert obj["id"].startswith("chatcmpl-") and obj["object"] == "chat.completion"
    assert obj["created"] == 123
    assert obj["choices"][0] == {
        "index": 0, "finish_reason": "stop", "logprobs": None,
        "message": {"role": "assistant", "content": "Paris.", "refusal": None}}
    assert obj["usage"]["speculative"]["rounds"] == 4


def test_chat_chunks(spec):
    out = P.ChatResponses(**{**IDS, "request_id": "chatcmpl-test"})
    openings = out.opening(2)
    assert [o.choices[0].index for o in openings] == [0, 1]
    first = _check(openings[0], "CreateChatCompletionStreamResponse")
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None and "usage" not in first
    middle = _check(out.chunk(2, "lo"),
                    "CreateChatCompletionStreamResponse")
    assert middle["choices"][0]["delta"] == {"content": "lo"} and middle["choices"][0]["index"] == 2
    final = _check(out.finish(0, "length"),
                   "CreateChatCompletionStreamResponse")
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] == "length"
    usage = _check(out.usage_chunk(USAGE), "CreateChatCompletionStreamResponse")
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 13, "total_tokens": 18}


def test_model_list(spec):
    obj = _check(P.model_list(["target", "other"], created=1), "ListModelsResponse")
    assert obj == {"object": "list", "data": [
        {"id": "target", "object": "model", "created": 1, "owned_by": "specdec-serve"},
        {"id": "other", "object": "model", "created": 1, "owned_by": "specdec-serve"}]}
    with_len = P.model_list(["t"], max_model_len=2048)
    assert with_len["data"][0]["max_model_len"] == 2048
    openai_schema.validate(with_len, "ListModelsResponse")


def _parse_error() -> APIError:
    try:
        P.parse_request(ChatCompletionRequest, body({**CH, "messages": [{"role": "x"}]}))
    except APIError as e:
        return e
    raise AssertionError("no error")


@pytest.mark.parametrize("make, status, type_, code, param", [
    (lambda: APIError("bad"), 400, "invalid_request_error", None, None),
    (_parse_error, 400, "invalid_request_error", None, "messages.0.role"),
    (lambda: APIError.model_not_found("nope"), 404, "invalid_request_error", "model_not_found",
     "model"),
    (APIError.invalid_api_key, 401, "invalid_request_error", "invalid_api_key", None),
    (lambda: APIError.overloaded(retry_after_s=2), 503, "server_error", "overloaded", None),
    (lambda: APIError.overloaded(status=429), 429, "server_error", "overloaded", None),
    (APIError.internal, 500, "server_error", "internal_error", None),
    (lambda: APIError("x", status=422, type="custom", param="p", code="c"), 422, "custom", "c",
     "p"),
])
def test_error_bodies(spec, make, status, type_, code, param):
    err = make()
    out = err.body()
    openai_schema.validate(out, "ErrorResponse")
    assert err.status == status
    assert out == {"error": {"message": err.message, "type": type_, "param": param, "code": code}}


def test_overloaded_retry_after_header():
    assert APIError.overloaded(retry_after_s=2.4).headers == {"Retry-After": "2"}
    assert APIError.overloaded().headers == {}


def test_sse_framing():
    """One event is one line of JSON for every line reader: also for those that split where
    str.splitlines does (U+2028, U+2029, U+0085 inside generated text; httpx's aiter_lines)."""
    text = "a\nb ✓ \u2028c\u2029d\x85e\r"
    chunk = P.ChatResponses(request_id="x", model="m", created=1).chunk(0, text)
    for framed, payload in [(P.sse(chunk), chunk),
                            (P.sse({"error": {"message": text}}), {"error": {"message": text}})]:
        assert framed.startswith("data: ") and framed.endswith("\n\n")
        assert framed.count("\n") == 2 and len(framed.splitlines()) == 2  # one line of JSON (and a blank one)
        assert json.loads(framed[len("data: "):]) == (P.wire(payload) if isinstance(payload, BaseModel) else payload)
    assert P.SSE_DONE == "data: [DONE]\n\n"


# --------------------------------------------------------------------------------------------
# the schema helper itself, and documentation of the models
# --------------------------------------------------------------------------------------------

def test_schema_helper_handles_openapi_nullable(spec):
    chunk = P.wire(P.ChatResponses(request_id="x", model="m", created=1).chunk(0, "a"))
    chunk["usage"] = None  # `$ref` + `nullable: true` in the document
    openai_schema.validate(chunk, "CreateChatCompletionStreamResponse")
    bad = copy.deepcopy(chunk)
    bad["choices"][0]["finish_reason"] = "bogus"
    with pytest.raises(openai_schema.SchemaMismatch):
        openai_schema.validate(bad, "CreateChatCompletionStreamResponse")
    legacy_chunk = P.wire(P.CompletionResponses(request_id="x", model="m", created=1).chunk(0, "a"))
    with pytest.raises(openai_schema.SchemaMismatch, match="finish_reason"):
        openai_schema.validate(legacy_chunk, "CreateCompletionResponse")  # the spec's quirk


def test_schema_helper_strips_extensions(spec):
    resp = P.ChatResponses(model="m").response(["x"], ["stop"], USAGE)
    obj = P.wire(resp)
    stripped = openai_schema.strip_extension_fields(obj)
    assert "speculative" not in stripped["usage"] and "speculative" in obj["usage"]
    openai_schema.validate(obj, "CreateChatCompletionResponse", strip_extensions=False)
    with pytest.raises(openai_schema.SchemaMismatch):
        openai_schema.validate({"object": "list"}, "ListModelsResponse")
    with pytest.raises(KeyError):
        openai_schema.validate({}, "NoSuchSchema")


def _all_models() -> list[type[BaseModel]]:
    """The models this project defines (responses otherwise come from openai.types)."""
    found = [v for mod in (protocol_requests, protocol_responses) for v in vars(mod).values()
             if isinstance(v, type) and issubclass(v, BaseModel) and v.__module__ == mod.__name__
             and not v.__name__.startswith("_")]
    assert {m.__name__ for m in found} >= {"CompletionRequest", "ChatCompletionRequest", "SpeculativeUsage"}
    return found


@pytest.mark.parametrize("model", _all_models(), ids=lambda m: m.__name__)
def test_every_field_is_described(model):
    missing = [name for name, f in model.model_fields.items() if not f.description]
    assert not missing, f"{model.__name__}: no description for {missing}"
    model.model_json_schema()  # documentation can be generated


def test_openai_sdk_parses_responses():
    types = pytest.importorskip("openai.types")
    chat = pytest.importorskip("openai.types.chat")
    usage = USAGE
    c = types.Completion.model_validate(
        P.wire(P.CompletionResponses(model="m").response(["a"], ["stop"], usage)))
    assert c.choices[0].text == "a" and c.usage.total_tokens == 18
    r = chat.ChatCompletion.model_validate(
        P.wire(P.ChatResponses(model="m").response(["b"], ["length"], usage)))
    assert r.choices[0].message.content == "b"
    k = chat.ChatCompletionChunk.model_validate(
        P.wire(P.ChatResponses(request_id="x", model="m", created=1).chunk(0, "c")))
    assert k.choices[0].delta.content == "c"


@pytest.mark.parametrize("cls, base", [(CompletionRequest, {"model": "m", "prompt": "x"}),
                                       (ChatCompletionRequest, {"model": "m", "messages": USER})])
def test_stop_token_ids_are_capped(cls, base):
    """256 stop token ids are accepted; 257 are a 400 naming `stop_token_ids` (a 1 MiB body
    could otherwise carry ~140k of them)."""
    ids = list(range(256))
    assert P.parse_request(cls, body({**base, "stop_token_ids": ids})).stop_token_ids == ids
    _expect_400(cls, body({**base, "stop_token_ids": ids + [256]}), "stop_token_ids", "at most 256")
