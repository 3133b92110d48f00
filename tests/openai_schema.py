"""Validate JSON objects against OpenAI's official OpenAPI document (test helper).

The document is `shared/openai-openapi/openapi.yaml`, a sibling of the repository root
(`<repo>/../shared/...`; `<repo>/shared/...` is also tried), or the file named by the
`OPENAI_OPENAPI_PATH` environment variable. It is OpenAPI 3.1, whose schemas are JSON Schema
2020-12, so we validate with `jsonschema` and resolve `#/components/schemas/...` references
through a `referencing` registry that holds the whole document as one resource.

The document is not pure JSON Schema, and a few things need care (all done once, at load time):

* `nullable: true` (110 places) is an OpenAPI 3.0 keyword that JSON Schema ignores, so a null
  would be rejected by the sibling `type`. Each such schema is rewritten to
  `anyOf: [<schema without nullable>, {type: "null"}]` (this also covers `$ref` + `nullable`,
  e.g. `CreateChatCompletionStreamResponse.usage`, and `enum` + `nullable`, e.g. the chunk's
  `finish_reason`).
* Vendor keys (`x-oaiMeta`, `x-stainless-const`, `x-oaiTypeLabel`, ...), `discriminator`,
  `example` and `format: unixtime` are annotations to JSON Schema: unknown keywords and formats
  are ignored (no format checker is used), so they are left alone.
* `CreateCompletionResponse` is documented as the shape of both the response and each streamed
  chunk, yet its `finish_reason` is a non-nullable enum while real streams (OpenAI's and every
  compatible server's) send `finish_reason: null` until a choice ends. The extra schema
  `COMPLETION_CHUNK` is that schema with `finish_reason` made nullable; use it for chunks.
* `CreateChatCompletionRequest` is an `allOf` of `CreateModelResponseProperties` (which
  redeclares `top_logprobs` as a plain integer) and an object where `top_logprobs` is nullable,
  so the spec rejects `top_logprobs: null`, which OpenAI's own SDK sends as a valid value. The
  `CreateModelResponseProperties` declaration is made nullable too.

Our protocol extensions (`usage.speculative`, the request fields `top_k`, ...) are removed
before validation by default (`strip_extensions=True`), so a schema that ever forbids unknown
properties still accepts our objects.
"""
from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry
from referencing.jsonschema import DRAFT202012

ENV_VAR = "OPENAI_OPENAPI_PATH"
DOC_URI = "urn:openai:openapi"
#: Local schema (not in OpenAI's document): a streamed legacy completion chunk.
COMPLETION_CHUNK = "CreateCompletionResponse.StreamChunk"

# Our extensions, as paths into an object ("*" = every item of an array).
EXTENSION_PATHS: tuple[tuple[str, ...], ...] = (
    ("usage", "speculative"),
    ("data", "*", "max_model_len"),
    ("top_k",),
    ("num_speculative_tokens",),
    ("ignore_eos",),
    ("stop_token_ids",),
)

# Keys whose values are data, not schemas: never rewrite inside them.
_DATA_KEYS = frozenset({"example", "examples", "default", "enum", "const", "x-oaiMeta"})


class SchemaMismatch(AssertionError):
    """An object does not match an OpenAI schema."""


def spec_path() -> Path | None:
    """Where the OpenAPI document is: $OPENAI_OPENAPI_PATH, else beside/inside the repo root."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[1]
    for candidate in (repo.parent / "shared", repo / "shared"):
        path = candidate / "openai-openapi" / "openapi.yaml"
        if path.is_file():
            return path
    return None


def _make_nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """Rewrite an OpenAPI-3.0 `nullable` schema into JSON Schema 2020-12."""
    nullable = schema.pop("nullable")
    if not nullable:
        return schema
    return {"anyOf": [schema, {"type": "null"}]}


def _normalize(node: Any) -> Any:
    """Return `node` with every `nullable: <bool>` rewritten (recursively, in schema positions)."""
    if isinstance(node, list):
        return [_normalize(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in _DATA_KEYS else _normalize(v)) for k, v in node.items()}
    if isinstance(out.get("nullable"), bool):
        out = _make_nullable(out)
    return out


def _add_completion_chunk_schema(schemas: dict[str, Any]) -> None:
    """Register COMPLETION_CHUNK: CreateCompletionResponse with a nullable finish_reason."""
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    props = chunk["properties"]["choices"]["items"]["properties"]
    props["finish_reason"] = {"anyOf": [props["finish_reason"], {"type": "null"}]}
    chunk["description"] = "Local: a streamed legacy completion chunk (finish_reason may be null)."
    schemas[COMPLETION_CHUNK] = chunk


def _allow_null_top_logprobs(schemas: dict[str, Any]) -> None:
    """Make CreateModelResponseProperties.top_logprobs nullable (see the module docstring)."""
    for part in schemas["CreateModelResponseProperties"]["allOf"]:
        props = part.get("properties", {})
        if "top_logprobs" in props:
            props["top_logprobs"] = {"anyOf": [props["top_logprobs"], {"type": "null"}]}


@functools.lru_cache(maxsize=1)
def load_document(path: str | None = None) -> dict[str, Any]:
    """Parse and normalise the OpenAPI document once (about 1 s with libyaml)."""
    where = Path(path) if path else spec_path()
    if where is None or not where.is_file():
        raise FileNotFoundError(
            f"OpenAI OpenAPI document not found (set {ENV_VAR} or provide ../shared/openai-openapi)"
        )
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(where, "rb") as f:
        doc = yaml.load(f, Loader=loader)
    doc = _normalize(doc)
    _add_completion_chunk_schema(doc["components"]["schemas"])
    _allow_null_top_logprobs(doc["components"]["schemas"])
    return doc


@functools.lru_cache(maxsize=1)
def _registry() -> Registry:
    """A registry holding the whole (normalised) document under DOC_URI."""
    return Registry().with_resource(DOC_URI, DRAFT202012.create_resource(load_document()))


@functools.lru_cache(maxsize=None)
def validator(schema_name: str) -> jsonschema.Draft202012Validator:
    """A cached validator for `components.schemas[schema_name]`."""
    if schema_name not in load_document()["components"]["schemas"]:
        raise KeyError(f"no schema named {schema_name!r} in the OpenAI document")
    ref = {"$ref": f"{DOC_URI}#/components/schemas/{schema_name}"}
    return jsonschema.Draft202012Validator(ref, registry=_registry())


def strip_extension_fields(obj: Any, paths=EXTENSION_PATHS) -> Any:
    """A deep copy of `obj` without our extension fields."""
    obj = copy.deepcopy(obj)
    for path in paths:
        _drop(obj, path)
    return obj


def _drop(node: Any, path: tuple[str, ...]) -> None:
    """Remove the key at `path` (in place) wherever it exists."""
    head, rest = path[0], path[1:]
    if head == "*":
        for item in node if isinstance(node, list) else ():
            _drop(item, rest)
    elif isinstance(node, dict) and head in node:
        if rest:
            _drop(node[head], rest)
        else:
            del node[head]


def _describe(error: jsonschema.ValidationError) -> str:
    """One line: where in the instance, and what went wrong."""
    where = "/".join(str(p) for p in error.absolute_path) or "<root>"
    return f"at {where}: {error.message}"


def validate(obj: dict, schema_name: str, strip_extensions: bool = True) -> None:
    """Raise SchemaMismatch unless `obj` matches OpenAI's `components.schemas[schema_name]`.

    `schema_name` is an OpenAI schema name (e.g. "CreateChatCompletionResponse") or
    COMPLETION_CHUNK. With `strip_extensions` our extension fields are removed first.
    """
    instance = strip_extension_fields(obj) if strip_extensions else obj
    errors = list(validator(schema_name).iter_errors(instance))
    if errors:
        best = jsonschema.exceptions.best_match(errors)
        details = "\n".join(_describe(e) for e in errors[:5])
        raise SchemaMismatch(
            f"object does not match {schema_name}: {_describe(best)}\nall errors:\n{details}"
        )
