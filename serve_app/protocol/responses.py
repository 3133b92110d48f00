"""OpenAI response bodies, built from the `openai` library's own models (`openai.types`), and
their server-sent-event framing.

What goes on the wire is `wire(obj)`: the fields that were set, nulls included (OpenAI marks
`logprobs`, `finish_reason`, `message.content`, `refusal` required-but-nullable, so they are set
to None explicitly), and nothing that was not (`usage` in ordinary chunks, `delta.role` after a
choice's first chunk). Extensions ride on the models' `extra="allow"`: `usage.speculative`
(draft tokens proposed/accepted, verification rounds; non-streaming responses only) and
`max_model_len` on model cards.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from pydantic import BaseModel, Field

FinishReason = Literal["stop", "length"]


class SpeculativeUsage(BaseModel):
    """Extension under `usage.speculative`: how speculation went for this request."""

    proposed_tokens: int = Field(description="Draft tokens the proposer proposed to the target (tokens verified inside multi-step plain rounds, found by prompt lookup or by the Target replica's own copy of the draft, are not counted).")
    accepted_tokens: int = Field(description="Draft tokens the target accepted, among those returned.")
    rounds: int = Field(description="Target forward passes that generated this request's tokens, summed over its choices (each counts its own).")


def usage(prompt_tokens: int, completion_tokens: int,
          speculative: SpeculativeUsage | None = None) -> CompletionUsage:
    """Token counts with total_tokens filled in, and the speculation extension when given."""
    extra = {"speculative": speculative.model_dump()} if speculative is not None else {}
    return CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens, **extra)


def without_speculative(u: CompletionUsage) -> CompletionUsage:
    """The counts alone (stream chunks carry no extension)."""
    return CompletionUsage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                           total_tokens=u.total_tokens)


def wire(obj: BaseModel) -> dict[str, Any]:
    """The JSON object sent to the client: the fields that were set (explicit nulls included)."""
    return obj.model_dump(mode="json", exclude_unset=True)


def now() -> int:
    """Current Unix time in whole seconds (OpenAI's `created`)."""
    return int(time.time())


@dataclass
class _Responses:
    """The response objects of one request (one id, model and `created` for all of them):
    `response(...)` for a whole answer, then for streams `opening(n)` (chunks before any text),
    `chunk(i, text)` (a delta of choice i), `finish(i, reason)` and `usage_chunk(usage)` (no
    choices, the counts without the extension), then SSE_DONE. Several prompts with n choices
    each are prompt-major: index = prompt_index * n + choice_index, as OpenAI does."""

    model: str
    request_id: str = ""
    created: int = field(default_factory=now)
    prefix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.request_id = self.request_id or f"{self.prefix}-{uuid.uuid4().hex}"

    def opening(self, n: int) -> list[BaseModel]:
        return []


class CompletionResponses(_Responses):
    """POST /v1/completions. A streamed choice has `finish_reason: null`, which the library's
    `CompletionChoice` does not admit (OpenAI's own streams send it), so stream choices are
    constructed without validation, as the library does when it parses a stream."""

    prefix = "cmpl"

    def _make(self, choices: list[CompletionChoice], usage: CompletionUsage | None = None) -> Completion:
        return Completion(id=self.request_id, object="text_completion", created=self.created, model=self.model,
                          choices=choices, **({"usage": usage} if usage is not None else {}))

    @staticmethod
    def _choice(index: int, text: str, finish_reason: FinishReason | None) -> CompletionChoice:
        fields = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
        if finish_reason is None:
            return CompletionChoice.model_construct(_fields_set=set(fields), **fields)
        return CompletionChoice(**fields)

    def response(self, texts: Sequence[str], finish_reasons: Sequence[FinishReason],
                 usage: CompletionUsage) -> Completion:
        return self._make([self._choice(i, t, f) for i, (t, f) in enumerate(zip(texts, finish_reasons, strict=True))], usage)

    def chunk(self, index: int, text: str) -> Completion:
        return self._make([self._choice(index, text, None)])

    def finish(self, index: int, reason: FinishReason) -> Completion:
        return self._make([self._choice(index, "", reason)])

    def usage_chunk(self, usage: CompletionUsage) -> Completion:
        return self._make([], without_speculative(usage))


class ChatResponses(_Responses):
    """POST /v1/chat/completions; a stream opens each choice with `{"role": "assistant",
    "content": ""}` and ends it with an empty delta and its finish_reason."""

    prefix = "chatcmpl"

    def response(self, texts: Sequence[str], finish_reasons: Sequence[FinishReason],
                 usage: CompletionUsage) -> ChatCompletion:
        choices = [ChatChoice(index=i, finish_reason=f, logprobs=None,
                              message=ChatCompletionMessage(role="assistant", content=t, refusal=None))
                   for i, (t, f) in enumerate(zip(texts, finish_reasons, strict=True))]
        return ChatCompletion(id=self.request_id, object="chat.completion", created=self.created, model=self.model,
                              choices=choices, usage=usage)

    def _chunk(self, choices: list[ChunkChoice], usage: CompletionUsage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, object="chat.completion.chunk", created=self.created,
                                   model=self.model, choices=choices, **({"usage": usage} if usage is not None else {}))

    def _delta(self, index: int, finish_reason: FinishReason | None = None, **delta: str) -> ChatCompletionChunk:
        return self._chunk([ChunkChoice(index=index, delta=ChoiceDelta(**delta), finish_reason=finish_reason,
                                        logprobs=None)])

    def opening(self, n: int) -> list[ChatCompletionChunk]:
        return [self._delta(i, role="assistant", content="") for i in range(n)]

    def chunk(self, index: int, text: str) -> ChatCompletionChunk:
        return self._delta(index, content=text)

    def finish(self, index: int, reason: FinishReason) -> ChatCompletionChunk:
        return self._delta(index, reason)

    def usage_chunk(self, usage: CompletionUsage) -> ChatCompletionChunk:
        return self._chunk([], without_speculative(usage))


def model_list(model_ids: Iterable[str], *, created: int | None = None,
               max_model_len: int | None = None) -> dict[str, Any]:
    """GET /v1/models body: `{"object": "list", "data": [Model, ...]}` (the library has no list
    type outside its paginator); `max_model_len` is our extension on each card."""
    created = created or now()
    extra = {"max_model_len": max_model_len} if max_model_len is not None else {}
    cards = [Model(id=m, object="model", created=created, owned_by="specdec-serve", **extra) for m in model_ids]
    return {"object": "list", "data": [wire(c) for c in cards]}


SSE_DONE = "data: [DONE]\n\n"


# Characters that str.splitlines (and line readers built on it, e.g. httpx's aiter_lines) break lines
# at, which JSON leaves raw inside strings: escaped, so that an event stays one line for every reader.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: BaseModel | dict[str, Any]) -> str:
    """Frame a response model (its `wire` form) or dict as one SSE event: "data: <json>\\n\\n"."""
    data = (obj.model_dump_json(exclude_unset=True) if isinstance(obj, BaseModel)
            else json.dumps(obj, ensure_ascii=False, separators=(",", ":")))
    return f"data: {data.translate(_LINE_BREAKS)}\n\n"
