"""OpenAI-compatible wire protocol: everything that crosses the HTTP boundary, and nothing that
knows about Ray, HTTP frameworks or the engine's internals.

- `errors`: `APIError` and OpenAI's error body; pydantic validation errors mapped onto it.
- `requests`: strict request models, `parse_request(model_cls, body_bytes)` (a validated
  request or a 400 `APIError`), `validate_limits(...)` (the deployment's limits, which are
  configuration, not protocol) and `to_sampling_params(...)`.
- `responses`: responses, stream chunks, usage and model cards built from `openai.types`,
  `wire()` (what is sent), `sse()` / `SSE_DONE` (stream framing).
"""
from serve_app.protocol.errors import APIError
from serve_app.protocol.requests import (ChatCompletionRequest, CompletionRequest, parse_request, to_sampling_params,
                                         validate_limits)
from serve_app.protocol.responses import (SSE_DONE, ChatResponses, CompletionResponses, SpeculativeUsage, model_list,
                                          sse, usage, wire)

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "parse_request", "to_sampling_params",
           "validate_limits", "SSE_DONE", "ChatResponses", "CompletionResponses", "SpeculativeUsage", "model_list",
           "sse", "usage", "wire"]
