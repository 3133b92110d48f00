"""Prompt encoding shared by the engine's benchmark and the service: chat templates and plain text.

Chat content is data, never markup. Rendering the chat template to text and tokenizing that text
with special tokens parsed (what `apply_chat_template(..., tokenize=True)` does) would turn a
user's "<|im_end|>\\n<|im_start|>system\\n..." into real turn delimiters: a role injection. So
`encode_chat` finds where each message's content sits in the rendered text (by rendering the
template once more with unique placeholders in place of the contents) and keeps a special token
only where the template wrote it; special-token text inside a content is tokenized as ordinary
text (`split_special_tokens=True`).

Token ids are unchanged for content without special-token text: the rendered text is tokenized
exactly as before and those ids are returned as they are. Only when a special token lies in a
content is the text re-encoded, stretch by stretch between the template's own special tokens.
Each such stretch is what the tokenizer encodes independently anyway (a fast tokenizer first
splits its input at added tokens, then pre-tokenizes and merges each piece on its own), so no BPE
merge can cross the boundary between template text and content: the boundaries that matter lie
at the template's special tokens, not at the content's edges (with ChatML the text before a
content is "<|im_start|>{role}\\n" and the one after it "<|im_end|>"; the "{role}\\n" stays in the
same stretch as the content, so a content starting with whitespace still pre-tokenizes together
with that "\\n" as it did before). tests/test_prompts.py checks both points on the tiny and the
demo tokenizer.
"""
from __future__ import annotations

import bisect
import re
import secrets


def _special_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens (the ones `split_special_tokens` stops parsing)."""
    ids = {i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(tok, "special", True)}
    return ids | set(getattr(tokenizer, "all_special_ids", ()) or ())


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    """The chat template's text; ValueError when the template rejects the messages (many raise
    for e.g. a system message or roles that do not alternate)."""
    from jinja2 import TemplateError
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except TemplateError as e:
        raise ValueError(f"this model's chat template rejects the messages: {e}") from None


def content_spans(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                  text: str | None = None) -> list[tuple[int, int]] | None:
    """Character spans of the messages' contents in the rendered chat `text`, or None when the
    template does not copy contents verbatim (it trims or rewrites them), so they cannot be located.

    The template is rendered with a unique placeholder per non-empty string content; putting the
    real contents back in place of the placeholders must give exactly `text`.
    """
    if text is None:
        text = _render(tokenizer, messages, add_generation_prompt)
    nonce = secrets.token_hex(8)
    marked, contents = [], {}
    for i, m in enumerate(messages):
        c = m.get("content")
        if isinstance(c, str) and c:
            contents[i] = c
            m = {**m, "content": f"\ue000{nonce}:{i}\ue001"}
        marked.append(m)
    if not contents:
        return []
    try:
        rendered = _render(tokenizer, marked, add_generation_prompt)
    except Exception:  # noqa: BLE001 - a template that inspects contents and rejects the placeholder
        return None
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
    out, spans, pos = [], [], 0
    for j, part in enumerate(parts):
        if j % 2:
            c = contents[int(part)]
            spans.append((pos, pos + len(c)))
        else:
            c = part
        out.append(c)
        pos += len(c)
    return spans if "".join(out) == text else None


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template; special tokens come only
    from the template, never from message contents (see the module docstring)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
    text = _render(tokenizer, messages, add_generation_prompt)
    special = _special_ids(tokenizer)
    spans = content_spans(tokenizer, messages, add_generation_prompt, text)
    if spans is None:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        literals = [tokenizer.convert_ids_to_tokens(i) for i in special]
        found = sorted({s for s in literals if s and any(s in (m.get("content") or "") for m in messages
                                                          if isinstance(m.get("content"), str))})
        if found:
            raise ValueError(f"message content contains special-token text {found}, which this model's chat "
                             "template does not let us keep literal")
        return ids
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc.input_ids), list(enc.offset_mapping)
    injected = any(t in special and _in_content(text, off, spans) for t, off in zip(ids, offsets))
    return encode_literal_spans(tokenizer, text, spans, ids, offsets) if injected else ids


def _in_content(text: str, offset: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    """Whether a token's text (less whitespace an lstrip/rstrip token absorbs) overlaps a content."""
    s, e = offset
    piece = text[s:e]
    s, e = s + len(piece) - len(piece.lstrip()), e - (len(piece) - len(piece.rstrip()))
    i = bisect.bisect_left(spans, (e,)) - 1  # spans are ordered and disjoint: only the last one starting before e can overlap
    return i >= 0 and s < spans[i][1]


def encode_literal_spans(tokenizer, text: str, spans: list[tuple[int, int]], ids: list[int] | None = None,
                         offsets: list[tuple[int, int]] | None = None) -> list[int]:
    """`text` tokenized with the special tokens outside `spans` kept and every stretch of text
    between two of them tokenized without parsing special tokens. Equals the plain tokenization
    when no special token lies in `spans` (tested); `encode_chat` calls it only when one does."""
    if ids is None or offsets is None:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc.input_ids), list(enc.offset_mapping)
    special = _special_ids(tokenizer)
    out: list[int] = []
    cursor = 0
    for t, (s, e) in zip(ids, offsets):
        if t not in special or _in_content(text, (s, e), spans):
            continue
        if s > cursor:
            out += _plain(tokenizer, text[cursor:s])
        out.append(t)
        cursor = e
    if cursor < len(text):
        out += _plain(tokenizer, text[cursor:])
    return out


def _plain(tokenizer, text: str) -> list[int]:
    """`text` as ordinary text: special-token strings in it are not parsed."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids


def encode_text(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids
