"""Incremental detokenization: the text of a growing token list, decoding only its last few tokens.

Re-decoding the whole output after every token costs O(n^2) for n tokens. Instead, as vLLM's
incremental detokenizer does (`detokenize_incrementally` in vllm/transformers_utils/
detokenizer_utils.py, the algorithm of tokenizers' `DecodeStream` too), keep two offsets into the
ids: ids[prefix_offset:read_offset] are already text and serve as context (a tokenizer may render a
token differently at the start of a decode, e.g. drop the space of a SentencePiece "▁word"), and
ids[read_offset:] are not yet. After each token decode ids[prefix_offset:read_offset] and
ids[prefix_offset:]; when the second is longer and does not end in "\ufffd" (an incomplete UTF-8
character), its extra characters are new text and the offsets move up to (read_offset, end).

`text` is append-only, the concatenation of what was emitted, so streaming is slicing it and can
never skip or repeat a character, whatever the tokenizer's decode does to a window. Windows are
decoded with skip_special_tokens=True and without `clean_up_tokenization_spaces` (which, applied to
a window, can rewrite characters already emitted; vLLM does not apply it when streaming either).
For byte-level BPE (the tests use a tiny one and SmolLM2's), and any decoder that renders a
window as the matching slice of the whole, `text` then equals decoding all the ids at once.

Tokens that skip_special_tokens removes never enter the window (they change no decode), so a
run of them holds nothing back. A window that stays incomplete ("\ufffd" characters, bytes that
never form one) is retried at every token up to MAX_HELD held tokens, then only when their count is
a power of two, so such a run costs O(n) decoded tokens too; `flush()` emits whatever is held at
the end.

The window starts with the last few prompt tokens as context (`context`, as vLLM's prefix_offset
does), so that a tokenizer which drops the leading space of a decode (SentencePiece's "▁word":
Llama 2, Mistral) still renders the first output word's space.
"""
from __future__ import annotations

import io
import weakref
from collections.abc import Sequence

MAX_HELD = 16  # held-back tokens retried at every token (an incomplete character spans <= 4)
CONTEXT_TOKENS = 4  # prompt tokens decoded before the output, as context

_skipped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> ids its decode drops


def skipped_ids(tokenizer) -> frozenset[int]:
    """Ids that decode(..., skip_special_tokens=True) removes: special added tokens (which are
    more than `all_special_ids`: SmolLM2 has 17, 3 of them named), checked by decoding each."""
    try:
        return _skipped[tokenizer]
    except (KeyError, TypeError):
        pass
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = frozenset(i for i, t in added.items() if getattr(t, "special", False)
                    and tokenizer.decode([i], skip_special_tokens=True) == "")
    try:
        _skipped[tokenizer] = ids
    except TypeError:  # not weak-referenceable: recomputed per detokenizer
        pass
    return ids


class IncrementalDetokenizer:
    """Output text of token ids pushed one at a time (`tokenizer` as in Hugging Face), after
    `context` (the prompt's ids: its last CONTEXT_TOKENS are decoded as context, not emitted)."""

    def __init__(self, tokenizer, context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self._skip = skipped_ids(tokenizer)
        # ids[prefix_offset:]: the only ids still needed (first: the context)
        self._window: list[int] = [t for t in context if t not in self._skip][-CONTEXT_TOKENS:]
        if self._window and self._decode(self._window).endswith("\ufffd"):  # ends inside a character
            self._window = []
        self._read = len(self._window)  # read_offset - prefix_offset: window[_read:] is not in `text` yet
        self.pending = ""  # provisional text of window[_read:] (may end in an incomplete char)
        self._text = io.StringIO(newline="")  # emitted text: amortised O(1) appends, O(k) slices
        self._len = 0

    def __len__(self) -> int:
        """Characters of `text`."""
        return self._len

    @property
    def text(self) -> str:
        return self.read(0)

    def read(self, start: int, end: int | None = None) -> str:
        """text[start:end] without building the whole text."""
        self._text.seek(start)
        return self._text.read((self._len if end is None else end) - start)

    def push(self, token_id: int) -> bool:
        """Add one token. Returns whether it was decoded (`text` and `pending` may have changed)."""
        if token_id in self._skip:
            return False  # decodes to nothing, changes nothing
        self._window.append(token_id)
        held = len(self._window) - self._read
        if held > MAX_HELD and held & (held - 1):
            return False  # a long incomplete run: retry at powers of two only
        self._advance(force=False)
        return True

    def flush(self) -> None:
        """No more tokens: emit the held-back text as it is (an incomplete char as "\ufffd")."""
        if self._read < len(self._window):
            self._advance(force=True)

    def truncate(self, size: int) -> None:
        """Cut `text` to `size` characters (a stop string); only once no more tokens come."""
        self._text.truncate(size)
        self._len = min(self._len, size)

    def _advance(self, force: bool) -> None:
        prefix = self._decode(self._window[: self._read])
        whole = self._decode(self._window)
        new = whole[len(prefix):]
        if force or (len(whole) > len(prefix) and not whole.endswith("\ufffd")):
            self._emit(new)
            self._window = self._window[self._read:]  # the new prefix: what was just read
            self._read = len(self._window)
            self.pending = ""
        else:
            self.pending = new

    def _emit(self, new: str) -> None:
        self._text.seek(0, io.SEEK_END)
        self._text.write(new)
        self._len += len(new)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
