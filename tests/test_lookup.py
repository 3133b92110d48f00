"""Prompt lookup inside multi-step plain rounds (specdec.target_worker.TargetWorker._multi_step):
rows verify n-gram continuations of their own context in the step's forward. The output is plain
decoding's, token for token (float32 and bfloat16): greedy rows compare with the argmax, sampled
rows with the target's own draw at each position (seeded: the same draws as plain rounds), and a
round's forwards yield more tokens where the text repeats itself. (The statistical test of sampled
lookups is in tests/test_lossless_proposers.py.)"""
import pytest
import torch

from specdec.engine import EngineConfig, LLMEngine
from specdec.loader import load_model
from specdec.proposers.ngram import NgramProposer
from specdec.sampling import SamplingParams
from specdec.target_worker import TargetWorker

PROMPTS = ["a b c a b c a b", "def add(a, b):\n    return a + b\n\ndef add", "import json\nimport os\nimport",
           "The weather today is"]


def engine(target, tok, lookup_k=0, lookup_max_batch=8, batch=4, plain_steps=8, corpus=None, adaptive=False):
    """k_max 0 with a proposer present: every round is a plain one, prompt lookup on when asked (in
    every multi-step round: not `adaptive`, whose LookupGate decides by measured timings)."""
    return LLMEngine(TargetWorker(target, num_slots=batch, max_model_len=256, corpus=corpus), NgramProposer(), tok,
                     EngineConfig(max_batch_size=batch, num_speculative_tokens=0, plain_steps=plain_steps,
                                  lookup_k=lookup_k, lookup_max_batch=lookup_max_batch,
                                  adaptive=adaptive))


def count_forwards(eng):
    calls = []
    verify = eng.target.verify
    eng.target.verify = lambda b, d: calls.append(verify(b, d)) or calls[-1]
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_emits_plain_greedy_tokens_in_fewer_forwards(tiny_dir, tiny_tok, dtype):
    target = load_model(tiny_dir, dtype=dtype)
    prompts = [tiny_tok(p).input_ids for p in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = [s.output_ids for s in engine(target, tiny_tok, plain_steps=1).generate(prompts, params)]
    eng = engine(target, tiny_tok, lookup_k=4)
    assert [s.output_ids for s in eng.generate(prompts, params)] == ref
    st = eng.stats
    assert st.lookup_proposed > 0 and 0 < st.lookup_accepted <= st.lookup_proposed
    assert st.proposed == 0 and st.accepted == 0  # no proposer drafted: acceptance stays the proposer's
    # one row at a time: each accepted lookup token saves one target forward
    plain, one = engine(target, tiny_tok, batch=1), engine(target, tiny_tok, lookup_k=4, batch=1)
    plain_calls, calls = count_forwards(plain), count_forwards(one)
    for p, r in zip(prompts, ref):  # one request at a time (a waiting request makes rounds one-step)
        assert [s.output_ids for s in plain.generate([p], params)] == [r]
        assert [s.output_ids for s in one.generate([p], params)] == [r]
    assert one.stats.lookup_accepted > 0
    assert sum(c.steps for c in calls) == sum(c.steps for c in plain_calls) - one.stats.lookup_accepted
    assert sum(c.lookup_accepted for c in calls) == one.stats.lookup_accepted
    assert any(len(c.tokens[0]) > c.steps for c in calls)  # a round's forwards yield more tokens


def test_lookup_respects_budget_stops_and_sampled_rows(tiny_dir, tiny_tok):
    """Rows never emit past max_tokens or a stop id inside a call; sampled rows draw exactly what
    plain rounds draw (seeded); a request's num_speculative_tokens=0 turns lookup off."""
    target = load_model(tiny_dir)
    prompts = [tiny_tok(p).input_ids for p in PROMPTS]
    greedy = SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=21, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    params = [greedy, sampled, greedy, sampled]
    ref = [s.output_ids for s in engine(target, tiny_tok, plain_steps=1).generate(prompts, params)]
    eng = engine(target, tiny_tok, lookup_k=4)
    seqs = eng.generate(prompts, params)
    assert [s.output_ids for s in seqs] == ref and [s.num_output for s in seqs] == [37, 21, 37, 21]
    assert eng.stats.lookup_proposed > 0
    stop = ref[0][7]
    seq = engine(target, tiny_tok, lookup_k=4).generate(prompts[:1], SamplingParams(
        max_tokens=37, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert seq.output_ids == ref[0][: ref[0].index(stop) + 1] and seq.finish_reason == "stop"
    off = engine(target, tiny_tok, lookup_k=4)
    off.generate(prompts, SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, num_speculative_tokens=0))
    assert off.stats.lookup_proposed == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_lookup_draws_what_plain_rounds_draw(tiny_dir, tiny_tok, dtype):
    """Sampled rows with prompt lookup emit, for every seed, the tokens of plain one-step rounds.
    (The tiny random model rarely repeats itself: lookups accepted on real text, tests/test_demo.py;
    and in distribution, tests/test_lossless_proposers.py.)"""
    target = load_model(tiny_dir, dtype=dtype)
    prompts = [tiny_tok(p).input_ids for p in PROMPTS]
    params = [SamplingParams(max_tokens=40, temperature=t, top_p=p, seed=seed, ignore_eos=True)
              for seed in range(6) for t, p in ((0.05, 1.0), (1.0, 0.9))]
    batch = [prompts[i % len(prompts)] for i in range(len(params))]
    ref = [s.output_ids for s in engine(target, tiny_tok, plain_steps=1, batch=12).generate(batch, params)]
    eng = engine(target, tiny_tok, lookup_k=4, lookup_max_batch=12, batch=12)
    assert [s.output_ids for s in eng.generate(batch, params)] == ref
    assert eng.stats.lookup_proposed > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_corpus_lookups_keep_plain_tokens_in_fewer_forwards(tiny_dir, tiny_tok, dtype):
    """A corpus continues prompt-lookup drafts: whether it holds the target's own answers (drafts
    accepted) or noise (drafts rejected), greedy and seeded sampled rows emit plain decoding's
    tokens, and the answers' corpus saves forwards over prompt lookup alone."""
    from specdec.corpus import NgramCorpus
    target = load_model(tiny_dir, dtype=dtype)
    prompts = [tiny_tok(p).input_ids for p in PROMPTS]
    params = [SamplingParams(max_tokens=40, temperature=t, seed=s, ignore_eos=True)
              for s, t in enumerate((0.0, 0.0, 0.7, 1.0))]
    ref = [s.output_ids for s in engine(target, tiny_tok, plain_steps=1).generate(prompts, params)]
    answers = [p[-6:] + r for p, r in zip(prompts, ref)]  # as specdec-corpus writes them
    own = NgramCorpus([t for a in answers for t in (*a, -1)], target.args.vocab_size)
    g = torch.Generator().manual_seed(0)
    noise = NgramCorpus(torch.randint(0, target.args.vocab_size, (4000,), generator=g).numpy(),
                        target.args.vocab_size, min_ratio=0.0)
    steps = {}
    for name, corpus in (("none", None), ("own", own), ("noise", noise)):
        eng = engine(target, tiny_tok, lookup_k=4, batch=1, corpus=corpus)
        calls = count_forwards(eng)
        for p, prm, r in zip(prompts, params, ref):  # one request at a time: multi-step rounds
            assert [s.output_ids for s in eng.generate([p], prm)] == [r], name
        steps[name] = sum(c.steps for c in calls)
        if corpus is noise:
            assert eng.stats.lookup_proposed > eng.stats.lookup_accepted  # its drafts are tried and fail
    assert steps["own"] < steps["none"] and steps["own"] <= sum(map(len, ref)) // 2


def test_padding_positions_take_the_corpus_likeliest_tokens(tiny_dir, tiny_tok):
    """A step's forward computes K + 1 positions for every row when one row has K confident
    lookups: a row whose own lookups end short fills those positions with the corpus's likeliest
    tokens (below `min_ratio`), free of cost. Alone, that row proposes nothing; batched with a
    confident row its fills are tried and kept where right; the output stays plain decoding's."""
    from specdec.corpus import NgramCorpus
    target = load_model(tiny_dir)
    prompts = [tiny_tok(p).input_ids for p in PROMPTS[2:]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = [s.output_ids for s in engine(target, tiny_tok, plain_steps=1).generate(prompts, params)]
    sure, vague = (p[-6:] + r for p, r in zip(prompts, ref))
    V = target.args.vocab_size
    # vague: every 6-token context of the answer is followed by its right token 2 times in 6 (below 40%)
    wrong = [[*vague[i - 6:i], (vague[i] + j) % V] for i in range(6, len(vague)) for j in range(1, 5)]
    corpus = NgramCorpus([t for a in [sure, vague, vague, *wrong] for t in (*a, -1)], V)
    alone = []
    for p, r in zip(prompts, ref):
        eng = engine(target, tiny_tok, lookup_k=4, batch=1, corpus=corpus)
        assert [s.output_ids for s in eng.generate([p], params)] == [r]
        alone.append(eng.stats.lookup_accepted)
    both = engine(target, tiny_tok, lookup_k=4, batch=2, corpus=corpus)
    assert [s.output_ids for s in both.generate(prompts, params)] == ref
    assert alone[0] > 20 and alone[1] < 5  # the sure row's lookups hit; the vague row's are not tried
    assert both.stats.lookup_accepted >= alone[0] + alone[1] + 10  # fills of the vague row hit


def test_lookup_only_up_to_its_batch_size(tiny_dir, tiny_tok):
    target = load_model(tiny_dir)
    prompts = [tiny_tok(p).input_ids for p in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    big = engine(target, tiny_tok, lookup_k=4, lookup_max_batch=2)
    big.generate(prompts, params)  # every round holds all 4 rows (they finish together): no lookup
    small = engine(target, tiny_tok, lookup_k=4, lookup_max_batch=2)
    small.generate(prompts[:2], params)
    small.generate(prompts[2:], params)
    assert big.stats.lookup_proposed == 0 and small.stats.lookup_proposed > 0


def test_lookup_rounds_return_the_features_of_every_confirmed_position(tiny_dir, tiny_tok):
    """With an EAGLE-style draft the target returns its features of every position a round
    confirmed; with lookups a forward confirms several: they must be those positions' features (a
    full recompute over the final sequence), contiguous across forwards and rounds."""
    from specdec.eagle_draft import EagleDraft
    from specdec.proposers.eagle import EagleProposer
    target, ref_model = load_model(tiny_dir), load_model(tiny_dir)
    torch.manual_seed(0)
    draft = EagleDraft.for_target(target, torch.randperm(target.args.vocab_size)[:128].sort().values).eval()
    ref_model.setup_cache(1, 256)
    accepted = 0
    for prompt in PROMPTS:
        eng = LLMEngine(TargetWorker(target, num_slots=1, max_model_len=256), EagleProposer(draft, 1, 256), tiny_tok,
                        EngineConfig(max_batch_size=1, num_speculative_tokens=0, plain_steps=8, lookup_k=4,
                                     lookup_max_batch=1, adaptive=False))
        calls = count_forwards(eng)
        seq = eng.generate([tiny_tok(prompt).input_ids], SamplingParams(max_tokens=64, temperature=0.0,
                                                                       ignore_eos=True))[0]
        accepted += eng.stats.lookup_accepted
        full = seq.prompt_ids + seq.output_ids
        with torch.inference_mode():
            h = ref_model.hidden_states(torch.tensor([full]), torch.tensor([0]), torch.tensor([0]))[0]  # [T, hidden]
        pos = None
        for c in calls:
            start, feats = c.hidden_start[0], c.hidden[0]
            assert pos is None or start == pos  # contiguous with the previous call's
            torch.testing.assert_close(feats, h[start: start + len(feats)], atol=1e-4, rtol=1e-4)
            pos = start + len(feats)
        assert pos == len(full) - 1  # every position but the newest token's
    assert accepted > 0


def test_lookup_rows_count_each_rows_forwards_and_accepted_tokens(tiny_dir, tiny_tok):
    """The target reports per row the forwards that carried its lookups and the lookup tokens it
    accepted (the gain the scheduler's LookupGate weighs); their sums are the call's totals."""
    target = load_model(tiny_dir)
    prompts = [tiny_tok(p).input_ids for p in PROMPTS]
    eng = engine(target, tiny_tok, lookup_k=4)
    calls = count_forwards(eng)
    eng.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    multi = [c for c in calls if c.lookup_rows is not None]
    assert multi and sum(h for c in multi for _, h in c.lookup_rows) == eng.stats.lookup_accepted > 0
    for c in multi:
        assert sum(h for _, h in c.lookup_rows) == c.lookup_accepted
        assert all(0 < f <= c.steps or (f, h) == (0, 0) for f, h in c.lookup_rows)
    assert any(f for c in multi for f, _ in c.lookup_rows)
    assert all(s.lookup_forwards > 0 for s in eng.scheduler.running) or not eng.scheduler.running


@pytest.mark.parametrize("temperature", [0.0, 0.05])
def test_gated_lookups_keep_plain_tokens(tiny_dir, tiny_tok, temperature, monkeypatch):
    """Whether a round carries lookups depends on timings (LookupGate): any pattern of rounds with
    and without them emits plain decoding's tokens (greedy, and seeded sampled rows; at a low
    temperature the tiny random model repeats itself, so lookups are found and checked)."""
    from specdec.adaptive import LookupGate
    target = load_model(tiny_dir)
    prompts = [tiny_tok(p).input_ids for p in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=temperature, seed=5, ignore_eos=True)
    ref = [s.output_ids for s in engine(target, tiny_tok, plain_steps=1).generate(prompts, params)]
    flips = iter([True, False, False, True] * 20)
    monkeypatch.setattr(LookupGate, "use", lambda self, batch, gains: next(flips))
    eng = engine(target, tiny_tok, lookup_k=4, adaptive=True)
    assert [s.output_ids for s in eng.generate(prompts, params)] == ref
    assert eng.stats.lookup_proposed > 0


def test_the_scheduler_drops_lookups_that_do_not_pay(tiny_dir, tiny_tok):
    """With the adaptive policy, a multi-step round carries lookups only where the rows' measured
    gain pays for the measured wider forwards; without it, always (the configured lookup_k)."""
    from specdec.sequence import Sequence
    eng = engine(load_model(tiny_dir), tiny_tok, lookup_k=2, adaptive=True)
    sched, gate = eng.scheduler, eng.scheduler.cost.lookups
    gate.step = {(4, True): 0.13, (4, False): 0.10}  # lookups make a forward 1.3x as dear
    gate.samples = {(4, True): 3, (4, False): 3}  # (both sides measured)
    seqs = [Sequence([1, 2, 3], SamplingParams(max_tokens=20, temperature=1.0)) for _ in range(4)]
    for s in seqs:
        s.lookup_hits, s.lookup_forwards = 2.0, 20.0  # 0.1 tokens per forward (sampled rows)
    assert sched._lookups(seqs) is None
    for s in seqs:
        s.lookup_hits = 10.0  # 0.5 (greedy rows on repetitive text)
    assert sched._lookups(seqs) == [2, 2, 2, 2]
    sched.cfg.adaptive = False
    for s in seqs:
        s.lookup_hits = 0.0
    assert sched._lookups(seqs) == [2, 2, 2, 2]
