"""OpenAI request bodies: strict pydantic models, their parsing from raw bytes, the deployment's
limits, and the mapping onto the engine's `SamplingParams`.

Requests are strict, as OpenAI's are: wrong JSON types are errors (no "1" -> 1 coercion), unknown
fields are rejected ("Unrecognized request argument supplied: <name>"), and OpenAI parameters this
server does not implement (logprobs, tools, penalties, ...) are declared once each with
`NotSupported(type, accepted, *values)`: they are accepted only at values that change nothing and
otherwise rejected with a "not supported" message naming the parameter, never silently ignored.
Extensions beyond OpenAI: `top_k`, `num_speculative_tokens`, `ignore_eos`, `stop_token_ids`.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, \
    field_validator, model_validator

from serve_app.protocol.errors import APIError, _invalid, validation_error_to_api_error
from specdec.sampling import SamplingParams

_Req = TypeVar("_Req", bound=BaseModel)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_TOKEN_IDS = 256  # `stop_token_ids` entries a request may carry

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


class _RequestModel(BaseModel):
    """Base of request models: strict JSON types, unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", strict=True)


def NotSupported(tp: Any, accepted: str, *values: Any) -> Any:  # noqa: N802 - a type
    """The type of an OpenAI parameter this server does not implement, declared once: null and
    `values` (they change nothing) pass; any other value is a "not supported" error naming the
    parameter and what is `accepted`."""
    def check(value: Any, info: ValidationInfo) -> Any:
        if value is not None and value not in values:
            raise _invalid(f"The '{info.field_name}' parameter is not supported by this server (only {accepted} is "
                           "accepted).", kind="unsupported_parameter")
        return value
    return Annotated[tp, AfterValidator(check), Field(description=f"Not supported: only {accepted} is accepted.")]


class StreamOptions(_RequestModel):
    """`stream_options` (only allowed with `stream: true`)."""

    include_usage: bool | None = Field(
        None, description="Send a final chunk with `usage` and an empty `choices` list.")
    include_obfuscation: bool | None = Field(
        None, description="Accepted for compatibility; this server never adds obfuscation.")


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
    presence_penalty: NotSupported(float | None, "0", 0) = None
    frequency_penalty: NotSupported(float | None, "0", 0) = None
    logit_bias: NotSupported(dict[str, float] | None, "null or {}", {}) = None
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
        """`stop` must be null, a string or an array of strings (limits: `validate_limits`)."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise _invalid("Invalid 'stop': expected a string or an array of strings.")

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
    def max_tokens_param(self) -> str:
        """The field that carries the client's token budget: chat's `max_completion_tokens` when
        given, else `max_tokens` (for error messages too)."""
        return "max_completion_tokens" if getattr(self, "max_completion_tokens", None) is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        """The client's token budget, or None to use the deployment default."""
        return getattr(self, self.max_tokens_param)


def _is_token_ids(value: Any) -> bool:
    """A non-empty list of non-negative ints (bools excluded)."""
    return (isinstance(value, list) and len(value) > 0
            and all(type(t) is int and t >= 0 for t in value))


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions (legacy text completions)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, an array of strings, an array of token ids, or an array of "
                    "token-id arrays; each element is one prompt.")
    max_tokens: int | None = Field(
        None, description="Tokens to generate per choice; absent or null: 16 (OpenAI's default), at most the "
                          "deployment's max_tokens_limit.")
    logprobs: NotSupported(int | None, "null") = None
    echo: NotSupported(bool | None, "false", False) = False
    best_of: NotSupported(int | None, "1", 1) = None
    suffix: NotSupported(str | None, "null") = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
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

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids (`_prompt_shape`: none empty)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(type(x) is int for x in p):
            return [list(p)]
        return [x if isinstance(x, str) else list(x) for x in p]


class TextContentPart(_RequestModel):
    """A `{"type": "text", "text": ...}` message content part."""

    type: Literal["text"] = Field(description="Always \"text\" (other part types unsupported).")
    text: str = Field(description="The text of this part.")


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(_RequestModel):
    """One input message. Only text content is supported."""

    role: Role = Field(description="Author of the message; \"developer\" is treated as "
                                   "\"system\" when rendering the chat template.")
    content: str | list[TextContentPart] | None = Field(
        None, description="A string or text parts (joined with newlines); null only for "
                          "assistant messages.")
    name: str | None = Field(None, description="Optional participant name; ignored.")
    tool_call_id: str | None = Field(None, description="For tool messages; accepted, ignored.")
    refusal: str | None = Field(None, description="Echoed assistant refusal; ignored.")
    annotations: list[Any] | None = Field(None, description="Echoed annotations; ignored.")
    tool_calls: NotSupported(list[Any] | None, "null or []", []) = None
    function_call: NotSupported(Any, "null") = None
    audio: NotSupported(Any, "null") = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        """Content is null, a string or a non-empty list of text parts; other part types rejected."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise _invalid("Invalid 'content': expected a string or a non-empty array of content "
                           "parts.")
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise _invalid(f"Content parts of type '{kind}' are not supported by this server (only 'text').",
                               kind="unsupported_parameter", field=str(i))
            if not (isinstance(part, dict) and kind == "text" and isinstance(part.get("text"), str)):
                raise _invalid("Invalid content part: expected {\"type\": \"text\", \"text\": "
                               "<string>}.", field=str(i))
        return value

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
    logprobs: NotSupported(bool | None, "false", False) = False
    top_logprobs: NotSupported(int | None, "null") = None
    tools: NotSupported(list[Any] | None, "null or []", []) = None
    tool_choice: NotSupported(Any, 'null or "none"', "none") = None
    functions: NotSupported(list[Any] | None, "null or []", []) = None
    function_call: NotSupported(Any, 'null or "none"', "none") = None
    response_format: NotSupported(dict[str, Any] | None, '{"type": "text"}', {"type": "text"}) = None
    audio: NotSupported(Any, "null") = None
    modalities: NotSupported(list[str] | None, '["text"]', ["text"]) = None
    store: NotSupported(bool | None, "false", False) = None
    service_tier: NotSupported(str | None, '"auto" or "default"', "auto", "default") = None
    reasoning_effort: NotSupported(Any, "null") = None
    verbosity: NotSupported(Any, "null") = None
    prediction: NotSupported(Any, "null") = None
    web_search_options: NotSupported(Any, "null") = None

    @model_validator(mode="after")
    def _one_max_tokens(self) -> ChatCompletionRequest:
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise _invalid("'max_tokens' and 'max_completion_tokens' disagree; send only "
                           "'max_completion_tokens'.", field="max_completion_tokens")
        return self

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
    stops = req.stop_list
    if req.stop is not None and not stops:
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
    max_tokens = req.requested_max_tokens
    if max_tokens is not None and not 1 <= max_tokens <= max_tokens_limit:
        param = req.max_tokens_param
        raise APIError(f"Invalid '{param}': must be between 1 and {max_tokens_limit}, got "
                       f"{max_tokens}.", param=param)

