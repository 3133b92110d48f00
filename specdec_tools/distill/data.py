"""Offline distillation data: the Python standard library's source (code) and `pydoc_data.topics`
(English prose from the language reference), plus chat prompts built from both.

Everything is local and deterministic. Documents are cut into *pieces* of a few thousand
characters (code at top-level `def`/`class` boundaries) so that a batch mixes many sources. The
held-out split is by *unit*, a top-level module/package or a pydoc topic: `crc32(unit) % 100 <
heldout_pct` goes to evaluation and training never sees any piece or prompt from it.

`TextStream` packs the training pieces' tokens (EOS between pieces) into fixed-length rows and
exposes its position as a small dict so a resumed run continues where the last one stopped;
`TextMix` draws rows from a code stream and a prose stream at a fixed rate.
"""
from __future__ import annotations

import ast
import functools
import random
import sysconfig
import textwrap
import zlib
from dataclasses import dataclass
from pathlib import Path

from specdec.prompts import encode_chat

SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo"}
PIECE_CHARS = 3000  # target size of one piece
SNIPPET_CHARS = 700  # code or prose quoted inside a chat prompt


@dataclass(frozen=True)
class Piece:
    unit: str  # split key: top-level module/package, or "topic:<name>"
    kind: str  # "code" | "prose"
    text: str


@dataclass(frozen=True)
class ChatPrompt:
    unit: str
    text: str  # the user message


def is_heldout(unit: str, pct: int = 10) -> bool:
    return zlib.crc32(unit.encode()) % 100 < pct


def _stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts):
            continue
        out.append((rel.parts[0].removesuffix(".py"), f))
    return out


def _split_code(text: str) -> list[str]:
    """Top-level blocks (a def/class with its decorators, or the lines between), grouped into pieces."""
    blocks, cur = [], []
    for line in text.splitlines(keepends=True):
        if line.startswith(("def ", "class ", "async def ", "@")) and cur and not cur[-1].startswith("@"):
            blocks.append("".join(cur))
            cur = []
        cur.append(line)
    blocks.append("".join(cur))
    return _group(blocks)


def _group(blocks: list[str]) -> list[str]:
    pieces, cur = [], ""
    for b in blocks:
        while len(b) > 2 * PIECE_CHARS:  # a huge block: cut at line boundaries
            cut = b.rfind("\n", 0, PIECE_CHARS) + 1 or PIECE_CHARS
            if cur:
                pieces.append(cur)
                cur = ""
            pieces.append(b[:cut])
            b = b[cut:]
        if cur and len(cur) + len(b) > PIECE_CHARS:
            pieces.append(cur)
            cur = ""
        cur += b
    if cur.strip():
        pieces.append(cur)
    return [p for p in pieces if p.strip()]


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics
    return dict(sorted(topics.items()))


@functools.lru_cache(maxsize=1)
def load_pieces() -> tuple[Piece, ...]:
    """All pieces, code then prose, in a fixed order (read once per process)."""
    pieces = []
    for unit, f in _stdlib_files():
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        pieces += [Piece(unit, "code", p) for p in _split_code(text)]
    for name, text in _topics().items():
        paras = [p + "\n\n" for p in text.split("\n\n")]
        pieces += [Piece("topic:" + name, "prose", p) for p in _group(paras)]
    return tuple(pieces)


def _functions(unit: str, text: str):
    """(qualified name, source, docstring, header) of documented public functions and methods;
    `header` is the source up to the end of the docstring."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    lines = text.splitlines(keepends=True)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if not doc or node.end_lineno is None:
                continue
            src = textwrap.dedent("".join(lines[node.lineno - 1: node.end_lineno]))
            head = node.body[0].end_lineno - node.lineno + 1
            header = "".join(src.splitlines(keepends=True)[:head])
            if 80 < len(src) <= 3 * SNIPPET_CHARS and len(header) <= SNIPPET_CHARS:
                yield f"{unit}.{node.name}", src, doc, header


def _first_paragraph(doc: str, limit: int = 300) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())[:limit]


# User-message templates, one chosen per function / topic by a hash (deterministic).
FUNCTION_ASKS = (
    "Explain what this function does:\n\n```python\n{snippet}\n```",
    "Write a Python function `{short}` that does the following: {summary}",
    "What does `{name}` in Python's standard library do? Give a short example.",
    "Review this Python code and suggest one improvement:\n\n```python\n{snippet}\n```",
)
TOPIC_ASKS = (
    "Explain {title} in Python, with a short example.",
    "What should a beginner know about {title} in Python?",
    "Summarize this passage from the Python reference:\n\n{passage}",
)


def chat_prompts(pieces: list[Piece]) -> list[ChatPrompt]:
    """User messages about the code and topics of `pieces` (templates chosen by hash, deterministic)."""
    out = []
    for p in pieces:
        if p.kind == "code":
            for name, src, doc, _ in _functions(p.unit, p.text):
                ask = FUNCTION_ASKS[zlib.crc32(name.encode()) % len(FUNCTION_ASKS)]
                out.append(ChatPrompt(p.unit, ask.format(snippet=src[:SNIPPET_CHARS], name=name,
                                                         short=name.rsplit(".", 1)[1],
                                                         summary=_first_paragraph(doc))))
        else:
            ask = TOPIC_ASKS[zlib.crc32(p.text[:200].encode()) % len(TOPIC_ASKS)]
            out.append(ChatPrompt(p.unit, ask.format(title=p.unit.removeprefix("topic:").replace("-", " "),
                                                     passage=p.text[:SNIPPET_CHARS].strip())))
    return out


def code_prompts(pieces: list[Piece]) -> list[str]:
    """Raw code prefixes for completion: a function's header and docstring."""
    out = []
    for p in pieces:
        if p.kind == "code":
            out += [header for _, _, _, header in _functions(p.unit, p.text)]
    return out


@dataclass
class Corpus:
    train: list[Piece]
    heldout: list[Piece]

    @classmethod
    def build(cls, heldout_pct: int = 10, limit: int = 0, seed: int = 0) -> "Corpus":
        """Split by unit; shuffle each split with `seed`; `limit` > 0 keeps that many pieces per split."""
        pieces = load_pieces()
        train = [p for p in pieces if not is_heldout(p.unit, heldout_pct)]
        held = [p for p in pieces if is_heldout(p.unit, heldout_pct)]
        random.Random(seed).shuffle(train)
        random.Random(seed + 1).shuffle(held)
        if limit:
            train, held = train[:limit], held[:limit]
        return cls(train, held)


def chat_ids(tokenizer, prompts: list[ChatPrompt]) -> list[list[int]]:
    return [encode_chat(tokenizer, [{"role": "user", "content": p.text}]) for p in prompts]


class TextStream:
    """Training pieces tokenized lazily and packed into rows of `seq_len` tokens, EOS-separated.

    state = {"epoch", "piece", "offset"}: the next row starts at token `offset` of piece `piece`
    in the order of epoch `epoch` (each epoch reshuffles the pieces with seed + epoch).
    """

    def __init__(self, pieces: list[Piece], tokenizer, seq_len: int, eos_id: int, seed: int = 0,
                 state: dict | None = None):
        if not pieces:
            raise ValueError("no training text")
        self.pieces, self.tok, self.seq_len, self.eos, self.seed = pieces, tokenizer, seq_len, eos_id, seed
        self.state = dict(state or {"epoch": 0, "piece": 0, "offset": 0})
        self._order: list[int] = []
        self._order_epoch = -1
        self._cache: dict[int, list[int]] = {}

    def _order_for(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            self._order = list(range(len(self.pieces)))
            if epoch:
                random.Random(self.seed * 1000 + epoch).shuffle(self._order)
            self._order_epoch = epoch
        return self._order

    def _tokens(self, i: int) -> list[int]:
        if i not in self._cache:
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[i] = self.tok(self.pieces[i].text, add_special_tokens=False).input_ids + [self.eos]
        return self._cache[i]

    def next_row(self) -> list[int]:
        row: list[int] = []
        st = self.state
        while len(row) < self.seq_len:
            order = self._order_for(st["epoch"])
            toks = self._tokens(order[st["piece"]])
            take = toks[st["offset"]: st["offset"] + self.seq_len - len(row)]
            row += take
            st["offset"] += len(take)
            if st["offset"] >= len(toks):
                st["piece"], st["offset"] = st["piece"] + 1, 0
                if st["piece"] >= len(order):
                    st["epoch"], st["piece"] = st["epoch"] + 1, 0
        return row


class TextMix:
    """Rows from a code stream and a prose stream (fraction `prose_frac`, chosen by the caller's rng).

    The standard library is ~96% code by volume, while chat answers are mostly English: drawing
    prose rows at a fixed rate keeps the draft (and the vocabulary choice) from ignoring prose.
    """

    def __init__(self, pieces: list[Piece], tokenizer, seq_len: int, eos_id: int, prose_frac: float = 0.3,
                 seed: int = 0, state: dict | None = None):
        state = state or {}
        code = [p for p in pieces if p.kind == "code"]
        prose = [p for p in pieces if p.kind == "prose"]
        self.streams = {name: TextStream(ps, tokenizer, seq_len, eos_id, seed, state.get(name))
                        for name, ps in (("code", code), ("prose", prose)) if ps}
        both = len(self.streams) == 2
        self.prose_frac = prose_frac if both else float("prose" in self.streams)

    @property
    def state(self) -> dict:
        return {name: dict(s.state) for name, s in self.streams.items()}

    def next_row(self, rng: random.Random) -> list[int]:
        name = "prose" if rng.random() < self.prose_frac else "code"
        return self.streams[name].next_row()
