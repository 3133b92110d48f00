"""A compiled target (`Transformer.compile_layers`): float32 logits stay the eager forward's up to
rounding, greedy speculation still emits plain decoding's tokens, and in bfloat16 a position's
logits still do not depend on how many positions or rows share the forward (the property bf16
speculation's identity with plain decoding rests on)."""
import pytest
import torch

from specdec.engine import EngineConfig, LLMEngine
from specdec.loader import load_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.runner import run_ragged
from specdec.sampling import SamplingParams
from specdec.target_worker import TargetWorker

SLOTS, MAX_LEN = 4, 256  # one cache shape for the whole module: a new one would compile again
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add", "import json\nimport os\nimport", "class Foo:\n    x = 1\n"]


def _compiled(path, dtype):
    model = load_model(path, dtype=dtype)
    TargetWorker(model, SLOTS, MAX_LEN, compile=True)  # compiles and warms every shape class
    return model


@pytest.fixture(scope="module")
def compiled_f32(tiny_dir):
    return _compiled(tiny_dir, torch.float32)


def _logits(model, ids, prefill, chunk, rows=1):
    """Logits of positions prefill.. of `ids`, computed `chunk` positions per forward in `rows`
    identical rows (slots 0..rows-1); row 0's."""
    slots = list(range(rows))
    out = [run_ragged(model, [ids[:prefill]] * rows, slots, [0] * rows, [1] * rows)[0]]
    for p in range(prefill, len(ids) - 1, chunk):
        feed = ids[p:min(p + chunk, len(ids) - 1)]
        out.append(run_ragged(model, [feed] * rows, slots, [p] * rows, [len(feed)] * rows)[0])
    return torch.cat(out)  # [positions, vocab]


def test_compiled_float32_logits_match_eager(compiled_f32, tiny_dir):
    eager = load_model(tiny_dir)
    eager.setup_cache(SLOTS, MAX_LEN)
    ids = [(7 + 13 * i) % 500 for i in range(40)]
    for chunk, rows in [(1, 1), (4, 1), (1, 3), (5, 2)]:
        got, ref = _logits(compiled_f32, ids, 20, chunk, rows), _logits(eager, ids, 20, chunk, rows)
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (chunk, rows, (got - ref).abs().max())


def _greedy(model, proposer, tok) -> list[list[int]]:
    """Greedy outputs of PROMPTS from an engine over `model` (plain decoding without a proposer)."""
    engine = LLMEngine(TargetWorker(model, SLOTS, MAX_LEN), proposer, tok,
                       EngineConfig(max_batch_size=SLOTS, num_speculative_tokens=3, adaptive=False,
                                    speculate=proposer is not None))
    assert model.feature_layers == (tuple(proposer.feature_layers) if proposer and proposer.needs_features else ())
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [s.output_ids for s in engine.generate([tok(p).input_ids for p in PROMPTS], params)]


def test_compiled_target_greedy_speculation_is_plain_decoding(compiled_f32, tiny_draft_dir, tiny_tok):
    draft = DraftModelProposer(load_model(tiny_draft_dir), SLOTS, MAX_LEN)
    assert _greedy(compiled_f32, draft, tiny_tok) == _greedy(compiled_f32, None, tiny_tok)


def test_compiled_target_feeds_an_eagle_draft_its_features(compiled_f32, tiny_eagle_dir, tiny_tok):
    """The engine warms the compiled target's forwards that tap features (an EAGLE-3 draft's)
    when it is built; speculation with the draft still emits plain decoding's tokens."""
    from specdec.eagle_draft import load_eagle
    from specdec.proposers import EagleProposer
    eagle = EagleProposer(load_eagle(tiny_eagle_dir, compiled_f32), SLOTS, MAX_LEN)
    assert eagle.feature_layers
    assert _greedy(compiled_f32, eagle, tiny_tok) == _greedy(compiled_f32, None, tiny_tok)


def test_compiled_bf16_positions_stay_invariant(tiny_dir):
    model = _compiled(tiny_dir, torch.bfloat16)
    assert model.position_invariant
    ids = [(11 + 29 * i) % 500 for i in range(36)]
    ref = _logits(model, ids, 16, 1)
    for chunk, rows in [(2, 1), (4, 1), (8, 1), (4, 3), (1, 3)]:
        assert torch.equal(_logits(model, ids, 16, chunk, rows), ref), (chunk, rows)


def test_warm_up_covers_every_round_of_the_default_app(tiny_dir, tiny_eagle_dir, tiny_tok):
    """A compiled bf16 target set up as the default app's (features for an EAGLE-3 draft, the
    in-target draft, prompt lookups in multi-step plain rounds, hybrid speculative rounds) compiles
    nothing after its warm-up, at batch 1 and at a full batch, greedy and sampled."""
    from torch._dynamo.utils import counters

    from specdec.eagle_draft import load_eagle
    from specdec.proposers import EagleProposer, HybridProposer, NgramProposer
    target = load_model(tiny_dir, dtype=torch.bfloat16)
    drafter = EagleProposer(load_eagle(tiny_eagle_dir, target), SLOTS, MAX_LEN)
    worker = TargetWorker(target, SLOTS, MAX_LEN, return_hidden=True, drafter=drafter, draft_k=2, greedy_draft_k=3,
                          compile=True)
    proposer = HybridProposer(NgramProposer(), EagleProposer(load_eagle(tiny_eagle_dir, target), SLOTS, MAX_LEN))
    engine = LLMEngine(worker, proposer, tiny_tok, EngineConfig(max_batch_size=SLOTS, plain_steps=8, lookup_k=2,
                                                                lookup_max_batch=8, ngram_k=8))
    graphs = counters["stats"]["unique_graphs"]
    prompts = [tiny_tok(p).input_ids for p in PROMPTS]
    for params in (SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)):
        engine.generate(prompts[:1], params)
        engine.generate(prompts, params)
    assert engine.stats.rounds > 0 and engine.stats.proposed > 0
    assert counters["stats"]["unique_graphs"] == graphs


def test_warm_up_covers_sequences_longer_than_one_key_chunk(compiled_f32):
    """Steps and a verification across the first key chunk's end compile nothing new: the warm-up
    covers two-chunk reads (else the first sequence past ATTN_KEYS compiles inside a request's round)."""
    from torch._dynamo.utils import counters

    from specdec.model import ATTN_KEYS
    graphs = counters["stats"]["unique_graphs"]
    ids = [(5 + 7 * i) % 500 for i in range(ATTN_KEYS + 8)]
    # (the warm-up's shapes only, under inference mode as TargetWorker runs them: steps and a
    # 5-position verification at positions inside the first key chunk and past it; the cache
    # contents do not matter for the graphs)
    with torch.inference_mode():
        for p in range(ATTN_KEYS - 4, len(ids)):  # one-token steps across the chunk boundary
            run_ragged(compiled_f32, [[ids[p]]], [0], [p], [1])
        run_ragged(compiled_f32, [ids[-5:]], [1], [ATTN_KEYS - 4], [5])  # a verification across it
    assert counters["stats"]["unique_graphs"] == graphs
