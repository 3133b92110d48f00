"""Whether a target, its draft and a lookup corpus fit together, checked from their configs and
tokenizers before any weights load (as vLLM's SpeculativeConfig checks a pair when the engine
is configured): the architecture is one the runner implements, the tensor-parallel degree
divides the heads, every token the tokenizer can produce has an embedding, an EAGLE-style draft
was trained for this target's shape and layers, a standalone draft embeds the same tokens, and
the corpus's token ids exist in the target. Each failure is a ValueError that says what to change.
"""
from __future__ import annotations

from dataclasses import dataclass

from specdec.model import ModelArgs

DRAFT_PROPOSERS = frozenset({"draft", "eagle", "hybrid"})  # proposers that read a draft checkpoint


@dataclass
class ModelFit:
    """What the pair's caches need, for sizing them."""

    target: ModelArgs
    draft_kv_bytes: int = 0  # KV-cache bytes per position of one draft sequence (0: a draft without a cache)
    draft_positions: int | None = None  # a standalone draft's own position limit


def check_models(target: str, draft: str | None = None, proposer: str = "none", *, tp: int = 1,
                 dtype: str = "float32", self_draft_layers: int = 4, lookup_corpus: str | None = None) -> ModelFit:
    """Check the target (a checkpoint name or path), the draft that `proposer` reads and the
    lookup corpus against each other; converts a GGUF target once, here."""
    from transformers import AutoConfig

    from specdec.loader import ModelLoadError, check_same_vocab, load_tokenizer, materialize, parse_dtype, resolve
    from specdec.tp import check_tp

    src = materialize(resolve(target))
    try:
        margs = ModelArgs.from_hf_config(AutoConfig.from_pretrained(src.path))
    except ValueError as e:
        raise ValueError(f"target {target}: {e}") from None
    try:
        check_tp(margs, tp)
    except ValueError as e:
        raise ValueError(f"tp={tp} cannot shard target {target}: {e}") from None
    tokenizer = load_tokenizer(src.path)  # a checkpoint without one fails here, not in a replica
    if len(tokenizer) > margs.vocab_size:
        raise ValueError(f"target {target}'s tokenizer has {len(tokenizer)} tokens, more than its "
                         f"{margs.vocab_size} embeddings: a prompt with one of the others would fail every request "
                         "batched with it (resize the embeddings, or use the checkpoint's own tokenizer)")
    fit, item = ModelFit(margs), parse_dtype(dtype).itemsize
    if proposer == "self":
        if self_draft_layers >= margs.num_layers:
            raise ValueError(f"self_draft_layers={self_draft_layers} must be below the target's "
                             f"{margs.num_layers} layers")
        fit.draft_kv_bytes = margs.kv_bytes_per_token(item) // margs.num_layers * self_draft_layers
    if proposer in DRAFT_PROPOSERS:
        path = _check_draft(fit, draft, proposer, target, tokenizer, item)
        try:
            check_same_vocab(tokenizer, load_tokenizer(path), target, draft)
        except ModelLoadError as e:
            raise ValueError(str(e)) from None
    if lookup_corpus:
        _check_corpus(lookup_corpus, target, margs)
    return fit


def _check_draft(fit: ModelFit, draft: str | None, proposer: str, target: str, tokenizer, item: int):
    """The draft's checks; returns its (materialized) checkpoint directory."""
    from transformers import AutoConfig

    from specdec.eagle_draft import check_eagle_fits, is_eagle
    from specdec.loader import materialize, resolve

    if not draft:
        raise ValueError(f"proposer={proposer!r} needs draft=PATH (a checkpoint with the target's tokenizer)")
    if proposer == "eagle" and not is_eagle(draft):
        raise ValueError(f"proposer='eagle' needs an EAGLE-style draft; {draft} is not one "
                         "(use proposer='draft' for a standalone draft model)")
    path, margs = materialize(resolve(draft)).path, fit.target
    if is_eagle(draft):
        try:
            c = check_eagle_fits(path, margs)
        except ValueError as e:
            raise ValueError(f"draft {draft} does not fit target {target}: {e}") from None
        fit.draft_kv_bytes = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * item
        return path
    try:
        dargs = ModelArgs.from_hf_config(AutoConfig.from_pretrained(path))
    except ValueError as e:
        raise ValueError(f"draft {draft}: {e}") from None
    fit.draft_kv_bytes, fit.draft_positions = dargs.kv_bytes_per_token(item), dargs.max_position_embeddings
    if not len(tokenizer) <= dargs.vocab_size <= margs.vocab_size:
        raise ValueError(f"draft {draft} has {dargs.vocab_size} embeddings: it must embed every "
                         f"token of the tokenizer ({len(tokenizer)}) and propose none the target cannot "
                         f"embed ({margs.vocab_size})")
    return path


def _check_corpus(corpus: str, target: str, margs: ModelArgs) -> None:
    from specdec.corpus import corpus_vocab_size
    from specdec.loader import ModelLoadError, resolve_corpus

    try:
        vocab = corpus_vocab_size(resolve_corpus(corpus))
    except ModelLoadError as e:
        raise ValueError(str(e)) from None
    if vocab > margs.vocab_size:
        raise ValueError(f"lookup_corpus {corpus} was made for a vocabulary of {vocab} tokens; "
                         f"target {target} has {margs.vocab_size}")
