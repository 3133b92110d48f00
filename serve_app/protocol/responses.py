"""OpenAI response bodies, built from the `openai` library's own models (`openai.types`), and
their server-sent-event framing.

What goes on the wire is `wire(obj)`: the fields that were set, nulls included (OpenAI marks
`logprobs`, `finish_reason`, `message.content`, `refusal` required-but-nullable, so they are set
to None explicitly), and nothing that was not (`usage` in ordinary chunks, `delta.role` after a
choice's first chunk). Extensions ride on the models' `extra="allow"`: `usage.speculative`
(draft tokens proposed/accepted, verification rounds; non-streaming responses only) and
`max_model_len` on model cards. A streamed text-completion chunk has `finish_reason: null`,
which the library's `CompletionChoice` type does not admit (OpenAI's own streams send it), so
those choices are constructed without validation, as the library does when it parses a stream.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from pydantic import BaseModel, Field

FinishReason = Literal["stop", "length"]


class SpeculativeUsage(BaseModel):
    """Extension under `usage.speculative`: how speculation went for this request."""

    proposed_tokens: int = Field(description="Draft tokens proposed to the target.")
    accepted_tokens: int = Field(description="Draft tokens the target accepted.")
    rounds: int = Field(description="Verification rounds (target forward passes).")


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


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def new_chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _check_lengths(texts: Sequence[str], finish_reasons: Sequence[FinishReason]) -> None:
    if len(texts) != len(finish_reasons):
        raise ValueError(f"{len(texts)} texts but {len(finish_reasons)} finish reasons")


def _completion_choice(index: int, text: str, finish_reason: FinishReason | None) -> CompletionChoice:
    fields = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
    if finish_reason is None:  # a stream chunk (see the module docstring)
        return CompletionChoice.model_construct(_fields_set=set(fields), **fields)
    return CompletionChoice(**fields)


def completion_response(*, model: str, texts: Sequence[str], finish_reasons: Sequence[FinishReason],
                        usage: CompletionUsage, request_id: str | None = None,
                        created: int | None = None) -> Completion:
    """A full /v1/completions response; `texts[i]` becomes choice i (several prompts with n
    choices each: prompt-major, index = prompt_index * n + choice_index, as OpenAI does)."""
    _check_lengths(texts, finish_reasons)
    choices = [_completion_choice(i, t, f) for i, (t, f) in enumerate(zip(texts, finish_reasons))]
    return Completion(id=request_id or new_completion_id(), object="text_completion", created=created or now(),
                      model=model, choices=choices, usage=usage)


def completion_chunk(*, request_id: str, model: str, created: int, text: str, index: int = 0,
                     finish_reason: FinishReason | None = None) -> Completion:
    """One streamed /v1/completions chunk: `text` is the delta of choice `index`."""
    return Completion(id=request_id, object="text_completion", created=created, model=model,
                      choices=[_completion_choice(index, text, finish_reason)])


def completion_usage_chunk(*, request_id: str, model: str, created: int, usage: CompletionUsage) -> Completion:
    """The final streamed /v1/completions chunk when include_usage: no choices, just usage."""
    return Completion(id=request_id, object="text_completion", created=created, model=model, choices=[],
                      usage=without_speculative(usage))


def chat_response(*, model: str, texts: Sequence[str], finish_reasons: Sequence[FinishReason],
                  usage: CompletionUsage, request_id: str | None = None,
                  created: int | None = None) -> ChatCompletion:
    """A full /v1/chat/completions response; `texts[i]` is the content of choice i."""
    _check_lengths(texts, finish_reasons)
    choices = [ChatChoice(index=i, finish_reason=f, logprobs=None,
                          message=ChatCompletionMessage(role="assistant", content=t, refusal=None))
               for i, (t, f) in enumerate(zip(texts, finish_reasons))]
    return ChatCompletion(id=request_id or new_chat_completion_id(), object="chat.completion",
                          created=created or now(), model=model, choices=choices, usage=usage)


def chat_chunk(*, request_id: str, model: str, created: int, index: int = 0,
               role: Literal["assistant"] | None = None, content: str | None = None,
               finish_reason: FinishReason | None = None) -> ChatCompletionChunk:
    """One streamed chat chunk for choice `index`.

    Usual sequence per choice: `chat_chunk(role="assistant", content="")` first, then
    `chat_chunk(content=delta)` for each piece of text, then `chat_chunk(finish_reason=...)`
    (delta `{}`); after all choices, `chat_usage_chunk(...)` if include_usage, then SSE_DONE.
    """
    delta = ChoiceDelta(**{k: v for k, v in (("role", role), ("content", content)) if v is not None})
    choice = ChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=None)
    return ChatCompletionChunk(id=request_id, object="chat.completion.chunk", created=created, model=model,
                               choices=[choice])


def chat_usage_chunk(*, request_id: str, model: str, created: int, usage: CompletionUsage) -> ChatCompletionChunk:
    """The final chat chunk when include_usage: `choices: []` and usage (no extension)."""
    return ChatCompletionChunk(id=request_id, object="chat.completion.chunk", created=created, model=model,
                               choices=[], usage=without_speculative(usage))


def model_list(model_ids: Iterable[str], *, created: int | None = None, owned_by: str = "specdec-serve",
               max_model_len: int | None = None) -> dict[str, Any]:
    """GET /v1/models body: `{"object": "list", "data": [Model, ...]}` (the library has no list
    type outside its paginator); `max_model_len` is our extension on each card."""
    created = created or now()
    extra = {"max_model_len": max_model_len} if max_model_len is not None else {}
    cards = [Model(id=m, object="model", created=created, owned_by=owned_by, **extra) for m in model_ids]
    return {"object": "list", "data": [wire(c) for c in cards]}


SSE_DONE = "data: [DONE]\n\n"


def sse(obj: BaseModel | dict[str, Any]) -> str:
    """Frame a response model (its `wire` form) or dict as one SSE event: "data: <json>\\n\\n"."""
    if isinstance(obj, BaseModel):
        return f"data: {obj.model_dump_json(exclude_unset=True)}\n\n"
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
