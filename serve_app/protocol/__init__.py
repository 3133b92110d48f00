"""OpenAI-compatible wire protocol: everything that crosses the HTTP boundary, and nothing that
knows about Ray, HTTP frameworks or the engine's internals.

- `errors`: `APIError` and OpenAI's error body; pydantic validation errors mapped onto it.
- `requests`: strict request models, `parse_request(model_cls, body_bytes)` (a validated
  request or a 400 `APIError`), `validate_limits(...)` (the deployment's limits, which are
  configuration, not protocol) and `to_sampling_params(...)`.
- `responses`: responses, stream chunks, usage and model cards built from `openai.types`,
  `wire()` (what is sent), `sse()` / `SSE_DONE` (stream framing).
"""
from serve_app.protocol.errors import APIError, validation_error_to_api_error
from serve_app.protocol.requests import (MAX_STOP_TOKEN_IDS, AnyRequest, ChatCompletionRequest, ChatMessage,
                                         CompletionRequest, StreamOptions, TextContentPart, parse_request,
                                         to_sampling_params, validate_limits)
from serve_app.protocol.responses import (SSE_DONE, ChatResponses, CompletionResponses, FinishReason,
                                          SpeculativeUsage, model_list, now, sse, usage, wire)

__all__ = [
    "APIError", "validation_error_to_api_error",
    "MAX_STOP_TOKEN_IDS", "AnyRequest", "ChatCompletionRequest", "ChatMessage", "CompletionRequest",
    "StreamOptions", "TextContentPart", "parse_request", "to_sampling_params", "validate_limits",
    "SSE_DONE", "ChatResponses", "CompletionResponses", "FinishReason", "SpeculativeUsage", "model_list",
    "now", "sse", "usage", "wire",
]
