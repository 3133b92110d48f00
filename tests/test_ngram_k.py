"""Longer prompt-lookup drafts in speculative rounds of one row (`ngram_k`): the hybrid proposer's
n-gram rows of greedy sequences propose up to ngram_k tokens instead of k (they cost no draft
forward). The output stays plain greedy decoding's, token for token; sampled rows, pinned
requests, budgets and rounds of several rows keep their k."""
import pytest
import torch

from specdec.engine import EngineConfig, LLMEngine
from specdec.loader import load_model
from specdec.proposers import DraftModelProposer, HybridProposer, NgramProposer
from specdec.sampling import SamplingParams
from specdec.target_worker import TargetWorker

# repetitive text: the hybrid's 3-gram lookups find long continuations
PROMPTS = ["a b c d e f g h a b c d e f g h a b c", "x = 1\ny = 2\nz = 3\nx = 1\ny = 2\nz = 3\nx = 1\n",
           "one two three four five one two three four five one two", "The weather today is"]
K = 2


def engine(target, tok, ngram_k=0, batch=4, lookup_max_batch=8):
    proposer = HybridProposer(NgramProposer(min_n=3, max_n=5), DraftModelProposer(target.first_layers(1), batch, 256))
    return LLMEngine(TargetWorker(target, num_slots=batch, max_model_len=256), proposer, tok,
                     EngineConfig(max_batch_size=batch, num_speculative_tokens=K, adaptive=False,
                                  ngram_k=ngram_k, lookup_max_batch=lookup_max_batch))


def record_drafts(eng) -> list[list[int]]:
    """num_draft of every proposal the engine's proposer makes."""
    seen, propose = [], eng.proposer.propose
    eng.proposer.propose = lambda batch: seen.append(list((out := propose(batch)).num_draft)) or out
    return seen


@pytest.fixture(scope="module")
def prompts(tiny_tok):
    return [tiny_tok(p).input_ids for p in PROMPTS]


def one_by_one(eng, prompts, params) -> list[list[int]]:
    """Each request alone (rounds of one row), in order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [eng.generate([p], sp)[0].output_ids for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_lookup_drafts_emit_plain_greedy_tokens(tiny_dir, tiny_tok, prompts, dtype):
    target = load_model(tiny_dir, dtype=dtype)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = LLMEngine(TargetWorker(target, num_slots=4, max_model_len=256), None, tiny_tok,
                      EngineConfig(max_batch_size=4, speculate=False))
    ref = [s.output_ids for s in plain.generate(prompts, params)]
    short, long = engine(target, tiny_tok, batch=1), engine(target, tiny_tok, ngram_k=8, batch=1)
    short_drafts, long_drafts = record_drafts(short), record_drafts(long)
    assert one_by_one(short, prompts, params) == ref
    assert one_by_one(long, prompts, params) == ref
    assert max(max(d) for d in short_drafts) <= K < max(max(d) for d in long_drafts) <= 8
    assert len(long.stats.proposed_per_pos) > K  # (tokens accepted past k: test_demo, on the real target)


def test_sampled_rows_pinned_requests_budgets_and_batches_keep_k(tiny_dir, tiny_tok, prompts):
    """Seeded sampled rows draft k and draw what they draw without ngram_k; a request's
    num_speculative_tokens caps its drafts; no row drafts past what it may still emit; rounds of
    several rows, and rounds above lookup_max_batch, keep k."""
    target = load_model(tiny_dir)
    sampled = SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    mixed = [greedy, sampled, greedy, sampled]

    base = one_by_one(engine(target, tiny_tok, batch=1), prompts, mixed)
    for i, params in enumerate(mixed):
        eng = engine(target, tiny_tok, ngram_k=8, batch=1)
        drafts = record_drafts(eng)
        assert one_by_one(eng, prompts[i:i + 1], [params]) == base[i:i + 1]
        assert (max(max(d) for d in drafts) > K) == (i in (0, 2))  # only the greedy rows draft past k

    pinned = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, num_speculative_tokens=1)
    eng = engine(target, tiny_tok, ngram_k=8, batch=1)
    drafts = record_drafts(eng)
    assert [len(o) for o in one_by_one(eng, prompts, pinned)] == [30] * 4 and max(max(d) for d in drafts) <= 1

    short = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    eng = engine(target, tiny_tok, ngram_k=8, batch=1)
    drafts = record_drafts(eng)
    assert [len(o) for o in one_by_one(eng, prompts, short)] == [5] * 4 and max(max(d) for d in drafts) <= 4

    for lookup_max_batch in (8, 0):  # several rows; one row but lookups off
        eng = engine(target, tiny_tok, ngram_k=8, batch=4 if lookup_max_batch else 1,
                     lookup_max_batch=lookup_max_batch)
        drafts = record_drafts(eng)
        if lookup_max_batch:
            eng.generate(prompts, greedy)
        else:
            one_by_one(eng, prompts, greedy)
        assert max(max(d) for d in drafts if len(d) > 1 or not lookup_max_batch) <= K
