"""OpenAI-compatible wire protocol: request/response models, validation, errors and SSE framing.

The idea: everything that crosses the HTTP boundary is described here, once, as pydantic v2
models, and nothing here knows about Ray, HTTP frameworks or the engine's internals. The router
does four things with this module:

1. `parse_request(CompletionRequest | ChatCompletionRequest, body_bytes)` turns raw bytes into a
   validated request or raises `APIError` (400) whose body is exactly OpenAI's error format.
   Requests are strict, as OpenAI's are: wrong JSON types are errors (no "1" -> 1 coercion),
   unknown fields are rejected ("Unrecognized request argument supplied: <name>"), and OpenAI
   parameters this server does not implement (logprobs, tools, penalties, ...) are rejected with
   a "not supported" message naming the parameter instead of being silently ignored.
2. `validate_limits(...)` applies the deployment's limits (n, stop, max_tokens), which are
   configuration, not protocol, so they are not baked into the models.
3. `to_sampling_params(...)` maps a request onto the engine's `SamplingParams`; prompts come
   from `CompletionRequest.prompts()` or `ChatCompletionRequest.messages_as_dicts()`.
4. The response constructors (`completion_response`, `chat_response`, `completion_chunk`,
   `chat_chunk`, the two `*_usage_chunk`s, `model_list`) build objects whose `model_dump()` /
   `model_dump_json()` is OpenAI-shaped; `sse()` frames them for streaming, `SSE_DONE` ends a
   stream.

Response models serialise in OpenAI's shape whatever `exclude_none` says: fields that OpenAI
marks required-but-nullable (`logprobs`, `finish_reason`, `message.content`, `refusal`, error
`param`/`code`) are always present, possibly null; optional fields (`usage`, `delta.role`, our
extensions) are omitted when None.

Extensions beyond OpenAI: request fields `top_k`, `num_speculative_tokens`, `ignore_eos`,
`stop_token_ids`; `usage.speculative` (draft tokens proposed/accepted, verification rounds) in
non-streaming responses; `max_model_len` on model cards.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from specdec.sampling import SamplingParams

__all__ = [
    "APIError", "parse_request", "validation_error_to_api_error",
    "StreamOptions", "TextContentPart", "ChatMessage", "CompletionRequest", "ChatCompletionRequest",
    "to_sampling_params", "validate_limits",
    "SpeculativeUsage", "Usage", "CompletionChoice", "CompletionResponse",
    "ChatResponseMessage", "ChatChoice", "ChatCompletionResponse",
    "ChatDelta", "ChatChunkChoice", "ChatCompletionChunk",
    "ModelCard", "ModelList", "ErrorInfo", "ErrorResponse",
    "completion_response", "completion_chunk", "completion_usage_chunk",
    "chat_response", "chat_chunk", "chat_usage_chunk", "model_list",
    "new_completion_id", "new_chat_completion_id", "now",
    "sse", "SSE_DONE", "FinishReason",
]

FinishReason = Literal["stop", "length"]
_Req = TypeVar("_Req", bound=BaseModel)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_TOKEN_IDS = 256  # `stop_token_ids` entries a request may carry

# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def _default_error_type(status: int) -> str:
    """OpenAI's error `type` for a status: client errors are invalid requests, the rest server."""
    return "server_error" if status >= 500 or status == 429 else "invalid_request_error"


class APIError(Exception):
    """An error to return to the client as `{"error": {message, type, param, code}}`.

    `APIError(message, status=400, type=None, param=None, code=None, headers=None)`;
    `type` defaults to "invalid_request_error" for 4xx and "server_error" for 429/5xx.
    `headers` (e.g. Retry-After) are for the HTTP layer; they are not part of the body.
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str | None = None,  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or _default_error_type(status)
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: {"error": {"message", "type", "param", "code"}}."""
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def __repr__(self) -> str:
        return f"APIError(status={self.status}, param={self.param!r}, message={self.message!r})"

    @classmethod
    def model_not_found(cls, model: str, served: str | None = None) -> APIError:
        """404 for a model id this service does not serve."""
        also = f"; this server serves '{served}'" if served else ""
        return cls(f"The model '{model}' does not exist{also}.", status=404, param="model",
                   code="model_not_found")

    @classmethod
    def invalid_api_key(cls) -> APIError:
        """401 for a missing or wrong API key."""
        return cls("Incorrect or missing API key: send 'Authorization: Bearer <key>'.", status=401,
                   code="invalid_api_key")

    @classmethod
    def overloaded(cls, message: str = "The server is overloaded; retry later.", *,
                   status: int = 503, retry_after_s: float | None = None) -> APIError:
        """429/503 when the service sheds load; sets Retry-After when given."""
        headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s else None
        return cls(message, status=status, code="overloaded", headers=headers)

    @classmethod
    def internal(cls, message: str = "Internal server error.") -> APIError:
        """500 for a failure inside the service."""
        return cls(message, status=500, code="internal_error")


def _invalid(message: str, **ctx: Any) -> PydanticCustomError:
    """A validation error with a ready-made message (ctx `field` names a sub-parameter)."""
    return PydanticCustomError("invalid_value", "{message}", {"message": message, **ctx})


def _unsupported(name: str, accepted: str) -> PydanticCustomError:
    """A validation error for an OpenAI parameter this server does not implement."""
    message = (f"The '{name}' parameter is not supported by this server "
               f"(only {accepted} is accepted).")
    return PydanticCustomError("unsupported_parameter", "{message}", {"message": message})


# pydantic adds union-member tags ("str", "list[int]", "TextContentPart") to error locations;
# our field names are snake_case, so anything else is a tag and is dropped from `param`.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*|.*[\[\]()-].*)$")
_ERROR_PRIORITY = {"extra_forbidden": 0, "unsupported_parameter": 1}


def _error_param(error: dict[str, Any]) -> str | None:
    """Dotted parameter path of a pydantic error, e.g. "messages.0.role"."""
    parts = [str(p) for p in error["loc"] if not (isinstance(p, str) and _UNION_TAG.match(p))]
    extra = (error.get("ctx") or {}).get("field")
    if extra:
        parts.append(extra)
    return ".".join(parts) or None


def _error_message(error: dict[str, Any], param: str | None) -> str:
    """A readable, OpenAI-flavoured message for one pydantic error."""
    kind, msg = error["type"], error["msg"]
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}"
    if kind in ("unsupported_parameter", "invalid_value"):
        return msg
    if kind == "missing":
        return f"Missing required parameter: '{param}'."
    if param is None:
        return f"Invalid request: {msg}."
    if kind.endswith("_type"):
        return f"Invalid type for '{param}': {msg}."
    return f"Invalid value for '{param}': {msg}."


def validation_error_to_api_error(exc: ValidationError) -> APIError:
    """Turn a pydantic ValidationError into a 400 APIError describing its most relevant error."""
    errors = sorted(exc.errors(include_url=False),
                    key=lambda e: _ERROR_PRIORITY.get(e["type"], 2))
    first = errors[0]
    param = _error_param(first)
    message = _error_message(first, param)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(message, status=400, param=param)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _load_json_object(raw: bytes | str) -> dict[str, Any]:
    """Decode a request body into a dict, raising APIError 400 on anything else."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise APIError(f"Invalid JSON body: request body is not valid UTF-8 ({e.reason} "
                           f"at byte {e.start}).") from None
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise APIError(f"Invalid JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(f"Invalid JSON body: expected a JSON object, got {_json_kind(data)}.")
    if _SURROGATE_ESCAPE.search(raw):  # valid pairs decode to one code point; lone halves stay
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError("Invalid JSON body: a string holds an unpaired UTF-16 surrogate escape "
                           "(\\ud800-\\udfff), which is not valid Unicode.") from None
    return data


def _json_kind(value: Any) -> str:
    """JSON's name for the type of a decoded value."""
    kinds = {list: "an array", str: "a string", bool: "a boolean", type(None): "null",
             int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


def parse_request(model_cls: type[_Req], raw: bytes | str) -> _Req:
    """Parse a raw request body into `model_cls`, raising APIError (400) on any problem."""
    data = _load_json_object(raw)
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_error_to_api_error(e) from None


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


class _RequestModel(BaseModel):
    """Base of request models: strict JSON types, unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", strict=True)

    #: field -> (is the value acceptable?, what is accepted) for OpenAI params we don't implement
    unsupported: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {}

    @classmethod
    def _check_supported(cls, value: Any, name: str) -> Any:
        """Raise "not supported" unless `value` is one this server can honour for `name`."""
        accepts, accepted = cls.unsupported[name]
        if not accepts(value):
            raise _unsupported(name, accepted)
        return value


def _is_none(value: Any) -> bool:
    return value is None


def _is_empty(value: Any) -> bool:
    """None, False, 0, "" or an empty collection."""
    return not value


_COMMON_UNSUPPORTED = {
    "presence_penalty": (_is_empty, "0"),
    "frequency_penalty": (_is_empty, "0"),
    "logit_bias": (_is_empty, "null or {}"),
}


class StreamOptions(_RequestModel):
    """`stream_options` (only allowed with `stream: true`)."""

    include_usage: bool | None = Field(
        None, description="Send a final chunk with `usage` and an empty `choices` list.")
    include_obfuscation: bool | None = Field(
        None, description="Accepted for compatibility; this server never adds obfuscation.")


def _check_stop(value: Any) -> Any:
    """`stop` must be null, a string or an array of strings (limits: `validate_limits`)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise _invalid("Invalid 'stop': expected a string or an array of strings.")


class _SamplingRequest(_RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str = Field(description="Model id, as listed by GET /v1/models.")
    temperature: Annotated[float, Field(ge=0, le=2)] | None = Field(
        1.0, description="Sampling temperature in [0, 2]; 0 means greedy. Null means 1.")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = Field(
        1.0, description="Nucleus sampling mass in (0, 1]. Null means 1.")
    n: Annotated[int, Field(ge=1)] | None = Field(
        1, description="Choices to generate per prompt (upper bound set by the deployment).")
    stream: bool | None = Field(False, description="Stream the result as server-sent events.")
    stream_options: StreamOptions | None = Field(
        None, description="Streaming options; only allowed when `stream` is true.")
    stop: str | list[str] | None = Field(
        None, description="Up to a deployment-set number of strings that end generation; "
                          "the stop string is not included in the output.")
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = Field(
        None, description="Seed for reproducible sampling (int64).")
    user: str | None = Field(None, description="End-user id; accepted and ignored.")
    presence_penalty: float | None = Field(
        None, description="Not supported: only 0 or null is accepted.")
    frequency_penalty: float | None = Field(
        None, description="Not supported: only 0 or null is accepted.")
    logit_bias: dict[str, float] | None = Field(
        None, description="Not supported: only null or {} is accepted.")
    # --- extensions ---
    top_k: Annotated[int, Field(ge=-1)] | None = Field(
        None, description="Extension: sample from the k most likely tokens; 0, -1 or null = off.")
    num_speculative_tokens: Annotated[int, Field(ge=0)] | None = Field(
        None, description="Extension: draft tokens per round; null = adaptive, 0 = no "
                          "speculation (the deployment may cap it).")
    ignore_eos: bool | None = Field(
        False, description="Extension: keep generating after the end-of-sequence token.")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]],
                              Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description=f"Extension: up to {MAX_STOP_TOKEN_IDS} token ids that end generation "
                          "(kept in the output token count, not in the text).")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        return _check_stop(value)

    @field_validator(*_COMMON_UNSUPPORTED, mode="after")
    @classmethod
    def _common_supported(cls, value: Any, info) -> Any:
        return cls._check_supported(value, info.field_name)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise _invalid("The 'stream_options' parameter is only allowed when 'stream' is "
                           "enabled.", field="stream_options")
        return self

    # --- derived values used by the router ---
    @property
    def include_usage(self) -> bool:
        """Whether a streamed response must end with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        """`n` with null resolved (choices per prompt)."""
        return 1 if self.n is None else self.n

    @property
    def stop_list(self) -> list[str]:
        """`stop` as a list (possibly empty)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def requested_max_tokens(self) -> int | None:
        """The client's token budget, or None to use the deployment default."""
        raise NotImplementedError

    @property
    def max_tokens_param(self) -> str:
        """Name of the field that carried `requested_max_tokens` (for error messages)."""
        return "max_tokens"


def _is_token_ids(value: Any) -> bool:
    """A non-empty list of non-negative ints (bools excluded)."""
    return (isinstance(value, list) and len(value) > 0
            and all(type(t) is int and t >= 0 for t in value))


def _check_prompt(value: Any) -> Any:
    """A prompt is a string, strings, token ids, or lists of token ids; none may be empty."""
    if isinstance(value, str):
        if not value:
            raise _invalid("Invalid 'prompt': the prompt must not be empty.")
        return value
    if not isinstance(value, list) or not value:
        raise _invalid("Invalid 'prompt': expected a non-empty string, array of strings, array "
                       "of token ids or array of token-id arrays.")
    if all(isinstance(p, str) for p in value):
        if not all(value):
            raise _invalid("Invalid 'prompt': prompts must not be empty strings.")
        return value
    if all(type(t) is int for t in value):
        if not _is_token_ids(value):
            raise _invalid("Invalid 'prompt': token ids must be non-negative integers.")
        return value
    if all(isinstance(p, list) for p in value):
        if not all(_is_token_ids(p) for p in value):
            raise _invalid("Invalid 'prompt': each token-id array must be non-empty and hold "
                           "non-negative integers.")
        return value
    raise _invalid("Invalid 'prompt': mixed types; expected a string, array of strings, array "
                   "of token ids or array of token-id arrays.")


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions (legacy text completions)."""

    unsupported: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        **_COMMON_UNSUPPORTED,
        "logprobs": (_is_none, "null"),
        "echo": (_is_empty, "false"),
        "best_of": (lambda v: v is None or v == 1, "1"),
        "suffix": (_is_none, "null"),
    }

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, an array of strings, an array of token ids, or an array of "
                    "token-id arrays; each element is one prompt.")
    max_tokens: int | None = Field(
        16, description="Tokens to generate per choice; null = deployment default.")
    logprobs: int | None = Field(None, description="Not supported: only null is accepted.")
    echo: bool | None = Field(False, description="Not supported: only false is accepted.")
    best_of: int | None = Field(None, description="Not supported: only 1 or null is accepted.")
    suffix: str | None = Field(None, description="Not supported: only null is accepted.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        return _check_prompt(value)

    @field_validator("logprobs", "echo", "best_of", "suffix", mode="after")
    @classmethod
    def _completion_supported(cls, value: Any, info) -> Any:
        return cls._check_supported(value, info.field_name)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids (never empty)."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = [x if isinstance(x, str) else list(x) for x in p]
        if not prompts or any(len(x) == 0 for x in prompts):
            raise APIError("Invalid 'prompt': prompts must not be empty.", param="prompt")
        return prompts


class TextContentPart(_RequestModel):
    """A `{"type": "text", "text": ...}` message content part."""

    type: Literal["text"] = Field(description="Always \"text\" (other part types unsupported).")
    text: str = Field(description="The text of this part.")


def _check_content(value: Any) -> Any:
    """Content is null, a string or a non-empty list of text parts; other part types rejected."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise _invalid("Invalid 'content': expected a string or a non-empty array of content "
                       "parts.")
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise PydanticCustomError("unsupported_parameter", "{message}", {
                "message": f"Content parts of type '{kind}' are not supported by this server "
                           "(only 'text').", "field": str(i)})
        if not (isinstance(part, dict) and kind == "text" and isinstance(part.get("text"), str)):
            raise _invalid("Invalid content part: expected {\"type\": \"text\", \"text\": "
                           "<string>}.", field=str(i))
    return value


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(_RequestModel):
    """One input message. Only text content is supported."""

    unsupported: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "tool_calls": (_is_empty, "null or []"),
        "function_call": (_is_none, "null"),
        "audio": (_is_none, "null"),
    }

    role: Role = Field(description="Author of the message; \"developer\" is treated as "
                                   "\"system\" when rendering the chat template.")
    content: str | list[TextContentPart] | None = Field(
        None, description="A string or text parts (joined with newlines); null only for "
                          "assistant messages.")
    name: str | None = Field(None, description="Optional participant name; ignored.")
    tool_call_id: str | None = Field(None, description="For tool messages; accepted, ignored.")
    refusal: str | None = Field(None, description="Echoed assistant refusal; ignored.")
    annotations: list[Any] | None = Field(None, description="Echoed annotations; ignored.")
    tool_calls: list[Any] | None = Field(None, description="Not supported: null or [] only.")
    function_call: Any = Field(None, description="Not supported: only null is accepted.")
    audio: Any = Field(None, description="Not supported: only null is accepted.")

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        return _check_content(value)

    @field_validator("tool_calls", "function_call", "audio", mode="after")
    @classmethod
    def _message_supported(cls, value: Any, info) -> Any:
        return cls._check_supported(value, info.field_name)

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise _invalid(f"Missing 'content' in a {self.role} message.", field="content")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined with newlines; null -> "")."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    unsupported: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        **_COMMON_UNSUPPORTED,
        "logprobs": (_is_empty, "false"),
        "top_logprobs": (_is_none, "null"),
        "tools": (_is_empty, "null or []"),
        "tool_choice": (lambda v: v is None or v == "none", 'null or "none"'),
        "functions": (_is_empty, "null or []"),
        "function_call": (lambda v: v is None or v == "none", 'null or "none"'),
        "response_format": (lambda v: v is None or v == {"type": "text"}, '{"type": "text"}'),
        "audio": (_is_none, "null"),
        "modalities": (lambda v: v is None or v == ["text"], '["text"]'),
        "store": (_is_empty, "false"),
        "service_tier": (lambda v: v in (None, "auto", "default"), '"auto" or "default"'),
        "reasoning_effort": (_is_none, "null"),
        "verbosity": (_is_none, "null"),
        "prediction": (_is_none, "null"),
        "web_search_options": (_is_none, "null"),
    }

    messages: list[ChatMessage] = Field(
        min_length=1, description="The conversation so far (at least one message).")
    max_tokens: int | None = Field(
        None, description="Deprecated alias of `max_completion_tokens`.")
    max_completion_tokens: int | None = Field(
        None, description="Tokens to generate per choice; null = deployment default.")
    parallel_tool_calls: bool | None = Field(None, description="Accepted and ignored (no tools).")
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored.")
    safety_identifier: str | None = Field(None, description="Accepted and ignored.")
    prompt_cache_key: str | None = Field(None, description="Accepted and ignored.")
    logprobs: bool | None = Field(False, description="Not supported: only false is accepted.")
    top_logprobs: int | None = Field(None, description="Not supported: only null is accepted.")
    tools: list[Any] | None = Field(None, description="Not supported: only null or [].")
    tool_choice: Any = Field(None, description='Not supported: only null or "none".')
    functions: list[Any] | None = Field(None, description="Not supported: only null or [].")
    function_call: Any = Field(None, description='Not supported: only null or "none".')
    response_format: dict[str, Any] | None = Field(
        None, description='Not supported beyond {"type": "text"}.')
    audio: Any = Field(None, description="Not supported: only null is accepted.")
    modalities: list[str] | None = Field(None, description='Only ["text"] is supported.')
    store: bool | None = Field(None, description="Not supported: only false or null.")
    service_tier: str | None = Field(None, description='Only "auto" or "default" accepted.')
    reasoning_effort: Any = Field(None, description="Not supported: only null is accepted.")
    verbosity: Any = Field(None, description="Not supported: only null is accepted.")
    prediction: Any = Field(None, description="Not supported: only null is accepted.")
    web_search_options: Any = Field(None, description="Not supported: only null is accepted.")

    @field_validator("logprobs", "top_logprobs", "tools", "tool_choice", "functions",
                     "function_call", "response_format", "audio", "modalities", "store",
                     "service_tier", "reasoning_effort", "verbosity", "prediction",
                     "web_search_options", mode="after")
    @classmethod
    def _chat_supported(cls, value: Any, info) -> Any:
        return cls._check_supported(value, info.field_name)

    @model_validator(mode="after")
    def _one_max_tokens(self) -> ChatCompletionRequest:
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise _invalid("'max_tokens' and 'max_completion_tokens' disagree; send only "
                           "'max_completion_tokens'.", field="max_completion_tokens")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def messages_as_dicts(self) -> list[dict[str, str]]:
        """`[{"role", "content": str}]` for `tokenizer.apply_chat_template`.

        Roles pass through except "developer", which becomes "system" (chat templates rarely
        know it); content parts are joined with newlines and null content becomes "".
        """
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


AnyRequest = CompletionRequest | ChatCompletionRequest


def to_sampling_params(req: AnyRequest, default_max_tokens: int) -> SamplingParams:
    """Engine parameters for one choice of `req` (max_tokens null -> `default_max_tokens`).

    The same params serve all `n` choices: with a seed and n > 1 the caller must derive a
    distinct seed per choice. Raises APIError 400 if the engine rejects a value.
    """
    max_tokens = req.requested_max_tokens
    try:
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            seed=req.seed,
            stop=req.stop_list,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos),
            num_speculative_tokens=req.num_speculative_tokens,
        )
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        param = req.max_tokens_param if field == "max_tokens" else field
        raise APIError(f"Invalid '{param}': {e}.", param=param) from None


def validate_limits(req: AnyRequest, *, max_n: int, max_stop: int, max_stop_len: int,
                    max_tokens_limit: int) -> None:
    """Apply deployment limits; raises APIError 400 with `param` naming the offending field."""
    if req.num_choices > max_n:
        raise APIError(f"Invalid 'n': at most {max_n} choices per prompt are allowed, got "
                       f"{req.num_choices}.", param="n")
    _validate_stop_limits(req.stop, max_stop, max_stop_len)
    max_tokens = req.requested_max_tokens
    if max_tokens is not None and not 1 <= max_tokens <= max_tokens_limit:
        param = req.max_tokens_param
        raise APIError(f"Invalid '{param}': must be between 1 and {max_tokens_limit}, got "
                       f"{max_tokens}.", param=param)


def _validate_stop_limits(stop: str | list[str] | None, max_stop: int, max_stop_len: int) -> None:
    """Stop list non-empty and short enough; each stop string non-empty and short enough."""
    if stop is None:
        return
    stops = [stop] if isinstance(stop, str) else stop
    if not stops:
        raise APIError("Invalid 'stop': the array must not be empty.", param="stop")
    if len(stops) > max_stop:
        raise APIError(f"Invalid 'stop': at most {max_stop} stop sequences are allowed, got "
                       f"{len(stops)}.", param="stop")
    for s in stops:
        if not s:
            raise APIError("Invalid 'stop': stop sequences must not be empty.", param="stop")
        if len(s) > max_stop_len:
            raise APIError(f"Invalid 'stop': stop sequences are limited to {max_stop_len} "
                           f"characters, got {len(s)}.", param="stop")


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


class _ResponseModel(BaseModel):
    """Base of response models: serialises in OpenAI's shape regardless of `exclude_none`.

    Fields listed in `nullable_fields` are always emitted (null when None); every other field
    that is None is omitted.
    """

    model_config = ConfigDict(extra="forbid")
    nullable_fields: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _openai_shape(self, handler: SerializerFunctionWrapHandler,
                      info: SerializationInfo) -> Any:
        data = handler(self)
        if not isinstance(data, dict):
            return data
        out = {}
        for name in type(self).model_fields:
            if getattr(self, name) is not None:
                if name in data:
                    out[name] = data[name]
            elif name in self.nullable_fields and (name in data or info.exclude_none):
                out[name] = None
        return out


class SpeculativeUsage(_ResponseModel):
    """Extension: how speculation went for this request (non-streaming responses only)."""

    proposed_tokens: int = Field(description="Draft tokens proposed to the target.")
    accepted_tokens: int = Field(description="Draft tokens the target accepted.")
    rounds: int = Field(description="Verification rounds (target forward passes).")


class Usage(_ResponseModel):
    """Token counts (OpenAI `CompletionUsage`) plus our `speculative` extension."""

    prompt_tokens: int = Field(description="Tokens in the prompt(s).")
    completion_tokens: int = Field(description="Tokens generated over all choices.")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")
    speculative: SpeculativeUsage | None = Field(
        None, description="Extension: speculation statistics; omitted when not available.")

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int,
           speculative: SpeculativeUsage | None = None) -> Usage:
        """Usage with total_tokens filled in."""
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, speculative=speculative)

    def without_speculative(self) -> Usage:
        """A copy without the extension (for stream chunks)."""
        return self.model_copy(update={"speculative": None})


class CompletionChoice(_ResponseModel):
    """One choice of a text completion (or of a streamed completion chunk)."""

    nullable_fields: ClassVar[frozenset[str]] = frozenset({"finish_reason", "logprobs"})
    index: int = Field(description="Position of the choice: prompt_index * n + choice_index.")
    text: str = Field(description="Generated text (the delta, in a stream chunk).")
    finish_reason: FinishReason | None = Field(
        None, description="\"stop\" (EOS/stop sequence), \"length\" (max_tokens), or null in "
                          "a stream chunk that does not end the choice.")
    logprobs: None = Field(None, description="Always null (logprobs are not supported).")


class CompletionResponse(_ResponseModel):
    """A /v1/completions response; streamed chunks have the same shape (as at OpenAI)."""

    id: str = Field(description="Completion id, \"cmpl-...\"; shared by all chunks.")
    object: Literal["text_completion"] = Field(
        "text_completion", description="Always \"text_completion\".")
    created: int = Field(description="Unix time (s) the completion was created.")
    model: str = Field(description="Model id that produced the completion.")
    choices: list[CompletionChoice] = Field(description="Choices (empty in the usage chunk).")
    usage: Usage | None = Field(None, description="Token usage; omitted in ordinary chunks.")


class ChatResponseMessage(_ResponseModel):
    """The assistant message of a non-streaming chat choice."""

    nullable_fields: ClassVar[frozenset[str]] = frozenset({"content", "refusal"})
    role: Literal["assistant"] = Field("assistant", description="Always \"assistant\".")
    content: str | None = Field(None, description="Generated text.")
    refusal: None = Field(None, description="Always null.")


class ChatChoice(_ResponseModel):
    """One choice of a non-streaming chat completion."""

    nullable_fields: ClassVar[frozenset[str]] = frozenset({"finish_reason", "logprobs"})
    index: int = Field(description="Position of the choice (0..n-1).")
    message: ChatResponseMessage = Field(description="The generated message.")
    finish_reason: FinishReason | None = Field(
        None, description="\"stop\" (EOS/stop sequence) or \"length\" (max tokens).")
    logprobs: None = Field(None, description="Always null (logprobs are not supported).")


class ChatCompletionResponse(_ResponseModel):
    """A non-streaming /v1/chat/completions response."""

    id: str = Field(description="Chat completion id, \"chatcmpl-...\".")
    object: Literal["chat.completion"] = Field(
        "chat.completion", description="Always \"chat.completion\".")
    created: int = Field(description="Unix time (s) the completion was created.")
    model: str = Field(description="Model id that produced the completion.")
    choices: list[ChatChoice] = Field(description="One entry per choice.")
    usage: Usage | None = Field(None, description="Token usage (with `speculative`).")


class ChatDelta(_ResponseModel):
    """The increment carried by a chat stream chunk; `{}` in a chunk that only finishes."""

    role: Literal["assistant"] | None = Field(None, description="Set in a choice's first chunk.")
    content: str | None = Field(None, description="New text, if any.")


class ChatChunkChoice(_ResponseModel):
    """One choice of a chat stream chunk."""

    nullable_fields: ClassVar[frozenset[str]] = frozenset({"finish_reason", "logprobs"})
    index: int = Field(description="Position of the choice (0..n-1).")
    delta: ChatDelta = Field(description="What this chunk adds to the choice.")
    finish_reason: FinishReason | None = Field(
        None, description="Null until the choice's last chunk.")
    logprobs: None = Field(None, description="Always null (logprobs are not supported).")


class ChatCompletionChunk(_ResponseModel):
    """A streamed /v1/chat/completions chunk."""

    id: str = Field(description="Chat completion id, the same in every chunk.")
    object: Literal["chat.completion.chunk"] = Field(
        "chat.completion.chunk", description="Always \"chat.completion.chunk\".")
    created: int = Field(description="Unix time (s), the same in every chunk.")
    model: str = Field(description="Model id.")
    choices: list[ChatChunkChoice] = Field(description="Choices (empty in the usage chunk).")
    usage: Usage | None = Field(
        None, description="Only in the final chunk when stream_options.include_usage.")


class ModelCard(_ResponseModel):
    """An entry of GET /v1/models."""

    id: str = Field(description="Model id to pass as `model`.")
    object: Literal["model"] = Field("model", description="Always \"model\".")
    created: int = Field(description="Unix time (s) the model was loaded.")
    owned_by: str = Field("specdec-serve", description="Owner shown to clients.")
    max_model_len: int | None = Field(
        None, description="Extension: context length in tokens (prompt + completion).")


class ModelList(_ResponseModel):
    """GET /v1/models."""

    object: Literal["list"] = Field("list", description="Always \"list\".")
    data: list[ModelCard] = Field(description="The served models.")


class ErrorInfo(_ResponseModel):
    """OpenAI's error object."""

    nullable_fields: ClassVar[frozenset[str]] = frozenset({"param", "code"})
    message: str = Field(description="Human-readable description.")
    type: str = Field(description="\"invalid_request_error\" or \"server_error\".")
    param: str | None = Field(
        None, description="The offending parameter, e.g. \"messages.0.role\".")
    code: str | None = Field(None, description="Machine-readable code, e.g. \"model_not_found\".")


class ErrorResponse(_ResponseModel):
    """An error body."""

    error: ErrorInfo = Field(description="The error.")


# --------------------------------------------------------------------------------------------
# Constructors used by the router
# --------------------------------------------------------------------------------------------


def now() -> int:
    """Current Unix time in whole seconds (OpenAI's `created`)."""
    return int(time.time())


def new_completion_id() -> str:
    """A fresh "cmpl-..." id."""
    return f"cmpl-{uuid.uuid4().hex}"


def new_chat_completion_id() -> str:
    """A fresh "chatcmpl-..." id."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def _check_lengths(texts: Sequence[str], finish_reasons: Sequence[FinishReason]) -> None:
    if len(texts) != len(finish_reasons):
        raise ValueError(f"{len(texts)} texts but {len(finish_reasons)} finish reasons")


def completion_response(*, model: str, texts: Sequence[str],
                        finish_reasons: Sequence[FinishReason], usage: Usage,
                        request_id: str | None = None,
                        created: int | None = None) -> CompletionResponse:
    """A full /v1/completions response; `texts[i]` becomes choice i.

    For several prompts and n choices each, order the texts prompt-major
    (index = prompt_index * n + choice_index), as OpenAI does.
    """
    _check_lengths(texts, finish_reasons)
    choices = [CompletionChoice(index=i, text=t, finish_reason=f)
               for i, (t, f) in enumerate(zip(texts, finish_reasons))]
    return CompletionResponse(id=request_id or new_completion_id(), created=created or now(),
                              model=model, choices=choices, usage=usage)


def completion_chunk(*, request_id: str, model: str, created: int, text: str, index: int = 0,
                     finish_reason: FinishReason | None = None) -> CompletionResponse:
    """One streamed /v1/completions chunk: `text` is the delta of choice `index`."""
    choice = CompletionChoice(index=index, text=text, finish_reason=finish_reason)
    return CompletionResponse(id=request_id, created=created, model=model, choices=[choice])


def completion_usage_chunk(*, request_id: str, model: str, created: int,
                           usage: Usage) -> CompletionResponse:
    """The final streamed /v1/completions chunk when include_usage: no choices, just usage."""
    return CompletionResponse(id=request_id, created=created, model=model, choices=[],
                              usage=usage.without_speculative())


def chat_response(*, model: str, texts: Sequence[str], finish_reasons: Sequence[FinishReason],
                  usage: Usage, request_id: str | None = None,
                  created: int | None = None) -> ChatCompletionResponse:
    """A full /v1/chat/completions response; `texts[i]` is the content of choice i."""
    _check_lengths(texts, finish_reasons)
    choices = [ChatChoice(index=i, message=ChatResponseMessage(content=t), finish_reason=f)
               for i, (t, f) in enumerate(zip(texts, finish_reasons))]
    return ChatCompletionResponse(id=request_id or new_chat_completion_id(),
                                  created=created or now(), model=model, choices=choices,
                                  usage=usage)


def chat_chunk(*, request_id: str, model: str, created: int, index: int = 0,
               role: Literal["assistant"] | None = None, content: str | None = None,
               finish_reason: FinishReason | None = None) -> ChatCompletionChunk:
    """One streamed chat chunk for choice `index`.

    Usual sequence per choice: `chat_chunk(role="assistant", content="")` first, then
    `chat_chunk(content=delta)` for each piece of text, then `chat_chunk(finish_reason=...)`
    (delta `{}`); after all choices, `chat_usage_chunk(...)` if include_usage, then SSE_DONE.
    """
    choice = ChatChunkChoice(index=index, delta=ChatDelta(role=role, content=content),
                             finish_reason=finish_reason)
    return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])


def chat_usage_chunk(*, request_id: str, model: str, created: int,
                     usage: Usage) -> ChatCompletionChunk:
    """The final chat chunk when include_usage: `choices: []` and usage (no extension)."""
    return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                               usage=usage.without_speculative())


def model_list(model_ids: Iterable[str], *, created: int | None = None,
               owned_by: str = "specdec-serve", max_model_len: int | None = None) -> ModelList:
    """GET /v1/models body for the given model ids."""
    created = created or now()
    return ModelList(data=[ModelCard(id=m, created=created, owned_by=owned_by,
                                     max_model_len=max_model_len) for m in model_ids])


# --------------------------------------------------------------------------------------------
# Server-sent events
# --------------------------------------------------------------------------------------------

SSE_DONE = "data: [DONE]\n\n"


def sse(obj: BaseModel | dict[str, Any]) -> str:
    """Frame a response model or dict as one SSE event: "data: <json>\\n\\n"."""
    if isinstance(obj, BaseModel):
        payload = obj.model_dump_json()
    else:
        payload = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"
