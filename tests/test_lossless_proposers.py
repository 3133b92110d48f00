"""Sampled output through every real proposer follows the target's distribution (statistical test).

The target is a tiny random Llama over a 12-token vocabulary: small enough that the exact joint
distribution of its first three sampled tokens after a prompt can be computed (1 + V + V^2
forwards of the reference transformers model), peaked and context dependent enough that drafts
disagree with it. Each case runs N requests through `LLMEngine` with the real proposer
(n-gram, draft model with a sparse top-J q, EAGLE with a reduced vocabulary, hybrid), k = 3
fixed, and compares the empirical joint of (x1, x2, x3) with the exact one by a chi-square test.
Two prompts share every batch: one that repeats itself (the n-gram and the hybrid's n-gram side
match from the first round) and one with no repeated token (the hybrid drafts with its model).
Every proposer also has a deliberately broken variant (a real bug class) that the same harness
must reject, so the test can fail. Base seeds from a counter make each run deterministic; seeded
requests, whose drafts are checked against plain decoding's own draws, are tested too. Prompt lookup inside
multi-step plain rounds (no proposer call; checked against the target's own draws) is tested the
same way at the end, with its own broken variant.
"""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec.engine import EngineConfig, LLMEngine
from specdec.metadata import DraftOutput
from specdec.proposers.base import Proposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.hybrid import HybridProposer
from specdec.proposers.ngram import NgramProposer
from specdec.rejection_sampler import DraftProbs
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.target_worker import TargetWorker

V, STEPS, K = 12, 3, 3
N = 4000  # requests per case (half per prompt)
BATCH = 200
ALPHA = 1e-3
REPEATING = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]  # suffix [1, 2, 3] matches: n-gram drafts [4, 5, 1]
DISTINCT = [6, 7, 8, 9, 10, 11, 0, 2, 5]  # no token repeats: no n-gram match in the first round
PROMPTS = [REPEATING, DISTINCT]
EAGLE_VOCAB = [0, 2, 3, 5, 8, 9, 11]  # the EAGLE draft's reduced head: q = 0 on the other tokens
CASES = [(1.0, 0, 1.0), (1.0, 6, 0.9)]  # temperature, top_k, top_p


def _tiny_llama(path, seed: int, layers: int, hidden: int, scale: float):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, scale)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from specdec.eagle_draft import EagleDraft
    from specdec.loader import load_model
    root = tmp_path_factory.mktemp("lossless")
    ref = _tiny_llama(root / "target", seed=11, layers=2, hidden=32, scale=0.35)
    _tiny_llama(root / "draft", seed=12, layers=1, hidden=32, scale=0.35)
    target, draft = load_model(root / "target"), load_model(root / "draft")
    torch.manual_seed(13)
    eagle = EagleDraft.for_target(target, torch.tensor(EAGLE_VOCAB), feature_layers=(0,))  # fused, as shipped
    with torch.no_grad():
        for p in eagle.trained_state().values():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return ref, target, draft, eagle


def _exact_joint(ref, prompt: list[int], temp: float, top_k: int, top_p: float) -> torch.Tensor:
    """P(x1, x2, x3 | prompt) of the reference model, flattened [V^3] (float64)."""
    def next_probs(ctx: torch.Tensor) -> torch.Tensor:  # ctx [n, L] -> [n, V]
        with torch.no_grad():
            logits = ref(ctx).logits[:, -1].float()
        n = len(ctx)
        return logits_to_probs(logits, torch.full((n,), temp), torch.full((n,), top_k),
                               torch.full((n,), top_p)).double()
    p = torch.tensor(prompt)
    a = torch.arange(V)
    p1 = next_probs(p[None])[0]  # [V]
    p2 = next_probs(torch.cat([p.expand(V, -1), a[:, None]], 1))  # [V(x1), V]
    ab = torch.cartesian_prod(a, a)  # [V^2, 2]
    p3 = next_probs(torch.cat([p.expand(V * V, -1), ab], 1)).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten()


def _sample(target, proposer: Proposer | None, temp: float, top_k: int, top_p: float, n: int = N,
            seed0: int = 0, seeded: bool = False) -> dict[int, torch.Tensor]:
    """Codes x1*V^2 + x2*V + x3 of n requests per prompt (alternating in the batch). Unseeded
    requests (rejection sampling, `random_verify`) get their base seeds from a counter here, so that
    the run is deterministic; seeded ones are checked against plain decoding's draws
    (`coupled_verify`)."""
    import itertools

    import specdec.sequence
    eng = LLMEngine(TargetWorker(target, BATCH, 64), proposer, None,
                    EngineConfig(max_batch_size=BATCH, max_model_len=64, num_speculative_tokens=K, adaptive=False),
                    eos_token_ids=[])
    params = [SamplingParams(max_tokens=STEPS, temperature=temp, top_k=top_k, top_p=top_p,
                             seed=seed0 + i if seeded else None, ignore_eos=True) for i in range(n)]
    seeds = itertools.count(seed0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(specdec.sequence, "new_base_seed", lambda seed: next(seeds) if seed is None else seed)
        seqs = eng.generate([PROMPTS[i % 2] for i in range(n)], params)
    out = torch.tensor([s.output_ids for s in seqs])  # [n, STEPS]
    assert eng.stats.proposed > 0
    codes = out[:, 0] * V * V + out[:, 1] * V + out[:, 2]
    return {j: codes[j::2] for j in range(2)}


def _pvalue(codes: torch.Tensor, exact: torch.Tensor) -> float:
    n = len(codes)
    counts = torch.bincount(codes, minlength=V ** 3).double()
    keep = exact * n >= 5  # chi-square needs expected counts >= 5: pool the rest into one cell
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([exact[keep], exact[~keep].sum()[None]]) * n
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
        obs[exp.argmax()] += counts[~keep].sum()
    return float(chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)


def _pvalues(ref, codes: dict[int, torch.Tensor], case) -> list[float]:
    return [_pvalue(codes[j], _exact_joint(ref, PROMPTS[j], *case)) for j in range(2)]


# ---- the proposers under test ------------------------------------------------------------------
def _ngram(target, draft, eagle):
    return NgramProposer(min_n=1, max_n=3)


def _draft(target, draft, eagle):
    return DraftModelProposer(draft, BATCH, 64, top_j=4)  # sparse q: the top-4 truncation


def _eagle(target, draft, eagle):
    return EagleProposer(eagle, BATCH, 64, top_j=4)


def _hybrid(target, draft, eagle):
    return HybridProposer(NgramProposer(min_n=3, max_n=5), _eagle(target, draft, eagle))


PROPOSERS = {"ngram": _ngram, "draft": _draft, "eagle": _eagle, "hybrid": _hybrid}


class Tracking(Proposer):
    """Delegates to a proposer; records which rows it drafted (and can corrupt what it returns)."""

    def __init__(self, inner: Proposer, corrupt=None):
        self.inner, self.corrupt = inner, corrupt
        self.needs_features = inner.needs_features
        self.rows_drafted = 0

    has_model = property(lambda self: self.inner.has_model)

    def release(self, seq_ids) -> None:
        self.inner.release(seq_ids)

    def propose(self, batch) -> DraftOutput:
        out = self.inner.propose(batch)
        self.rows_drafted += sum(1 for n in out.num_draft if n > 0)
        return self.corrupt(out) if self.corrupt else out


def test_target_is_context_dependent(models):
    ref = models[0]
    p2 = _exact_joint(ref, DISTINCT, 1.0, 0, 1.0).view(V, V, V).sum(2)  # P(x1, x2)
    cond = p2 / p2.sum(1, keepdim=True)  # P(x2 | x1)
    assert (cond[:, None] - cond[None]).abs().sum(-1).max() > 0.5  # total variation between contexts
    assert p2.sum(1).max() < 0.8  # x1 is not (nearly) deterministic at temperature 1


@pytest.mark.parametrize("case", CASES, ids=["T1", "T1-topk6-topp0.9"])
@pytest.mark.parametrize("kind", list(PROPOSERS))
def test_sampling_is_lossless_through_proposer(models, kind, case):
    ref, target, draft, eagle = models
    prop = Tracking(PROPOSERS[kind](target, draft, eagle))
    codes = _sample(target, prop, *case, seed0=1000 * CASES.index(case))
    assert prop.rows_drafted > N // 2  # drafts were really proposed
    if kind == "hybrid":
        assert prop.inner.ngram_rows > N // 4 and prop.inner.model_rows > N // 4  # both sides drafted
    pv = _pvalues(ref, codes, case)
    assert min(pv) > ALPHA, pv


@pytest.mark.parametrize("kind", ["draft", "hybrid"])
def test_seeded_sampling_is_lossless_through_proposer(models, kind):
    """Seeded rows: drafts (a sampled q, and the hybrid's n-gram and EAGLE sides) checked against
    plain decoding's draws."""
    ref, target, draft, eagle = models
    prop = Tracking(PROPOSERS[kind](target, draft, eagle))
    codes = _sample(target, prop, *CASES[0], seed0=200_000, seeded=True)
    assert prop.rows_drafted > N // 2
    pv = _pvalues(ref, codes, CASES[0])
    assert min(pv) > ALPHA, pv


class _Flaky(Tracking):
    """A proposer that drafts nothing for every third call's rows (a draft replica down, no free
    draft slot)."""

    calls = 0

    def propose(self, batch) -> DraftOutput:
        self.calls += 1
        if self.calls % 3 == 0:
            return DraftOutput.empty(len(batch))
        return super().propose(batch)


@pytest.mark.parametrize("kind", list(PROPOSERS))
def test_seeded_sampled_output_is_plain_decodings_whatever_is_drafted(models, kind):
    """A seeded sampled request reproduces: with speculation (adaptive k, batch-mates without
    seeds, calls that draft nothing) its tokens are plain decoding's for its seed, token for token."""
    ref, target, draft, eagle = models

    def run(proposer, k, adaptive, mates):
        eng = LLMEngine(TargetWorker(target, 16, 64), proposer, None,
                        EngineConfig(max_batch_size=16, max_model_len=64, num_speculative_tokens=k, adaptive=adaptive),
                        eos_token_ids=[])
        seeded = [SamplingParams(max_tokens=20, temperature=t, top_k=tk, seed=i, ignore_eos=True)
                  for i, (t, tk) in enumerate([(1.0, 0), (0.7, 0), (1.0, 6)] * 2)]
        others = [SamplingParams(max_tokens=20 - i, temperature=1.0, ignore_eos=True) for i in range(mates)]
        seqs = eng.generate([PROMPTS[i % 2] for i in range(len(seeded) + mates)], seeded + others)
        return [s.output_ids for s in seqs[: len(seeded)]], eng.stats

    plain, _ = run(None, 0, False, 0)
    accepted = 0
    for k, adaptive, mates, flaky in [(3, False, 0, False), (2, True, 4, False), (4, False, 3, True)]:
        prop = (_Flaky if flaky else Tracking)(PROPOSERS[kind](target, draft, eagle))
        out, stats = run(prop, k, adaptive, mates)
        assert prop.rows_drafted > 0  # it speculated
        assert out == plain, (k, adaptive, mates, flaky)
        accepted += stats.accepted
    assert accepted > 0  # and drafts were accepted


# ---- broken variants: the harness must reject each ----------------------------------------------
def _always_accept(out: DraftOutput) -> DraftOutput:
    """q(x) = 0 on every draft: the acceptance test u * q < p always passes."""
    ids = out.tokens[:, :, None]
    return DraftOutput(out.tokens, out.num_draft, DraftProbs(ids, torch.zeros(ids.shape)), out.unknown)


class _LocalIdsEagle(EagleProposer):
    """Reduced-vocabulary bug: q keeps the draft head's local ids instead of the target's."""

    def _choose(self, logits, rows, batch, step):
        token_map, self.token_map = self.token_map, None
        try:
            local, q_ids, q_vals = super()._choose(logits, rows, batch, step)
        finally:
            self.token_map = token_map
        return token_map[local], q_ids, q_vals


def _scatter_dense(self, vocab_size: int) -> torch.Tensor:
    """The hybrid's old bug: `scatter_` lets a padding column (value 0) overwrite q(x)."""
    B, K_, _ = self.ids.shape
    return torch.zeros(B, K_, vocab_size).scatter_(2, self.ids, self.vals.float())


BROKEN = {
    "ngram": lambda t, d, e: Tracking(_ngram(t, d, e), corrupt=_always_accept),
    "draft": lambda t, d, e: Tracking(_draft(t, d, e), corrupt=_always_accept),
    "eagle": lambda t, d, e: _LocalIdsEagle(e, BATCH, 64, top_j=4),
    "hybrid": lambda t, d, e: _hybrid(t, d, e),  # with the old DraftProbs.dense below
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_harness_rejects_broken_proposer(models, kind, monkeypatch):
    ref, target, draft, eagle = models
    if kind == "hybrid":
        monkeypatch.setattr(DraftProbs, "dense", _scatter_dense)
    codes = _sample(target, BROKEN[kind](target, draft, eagle), *CASES[0], n=N // 2, seed0=7)
    pv = _pvalues(ref, codes, CASES[0])
    # the n-gram side of the hybrid is biased on the repeating prompt; the others on both prompts
    assert (pv[0] if kind in ("ngram", "hybrid") else min(pv)) < ALPHA, pv


# ---- prompt lookup inside multi-step plain rounds: drafts checked against the target's own draws --
PAIRS = [t for v in range(V) for t in (3, v)] + [3]  # "3 v" for every v: after x1 = v a 2-gram matches
LOOKUP_PROMPTS = [PAIRS, REPEATING]


class _OneDrawPerStep(TargetWorker):
    """The bug class `coupled_verify` must avoid: one uniform drawing every position of a forward."""

    @staticmethod
    def _draws(batch, i, e, n):
        return batch.uniforms[i, 1:, e: e + 1].expand(-1, n)


def _sample_lookup(ref, target, worker=TargetWorker, n: int = N, seed0: int = 0, case=CASES[0],
                   prompts=LOOKUP_PROMPTS, corpus=None, seeded: bool = True, max_tokens: int = STEPS):
    """p-values per prompt of n seeded requests through plain rounds of up to `max_tokens` tokens
    whose rows verify prompt-lookup tokens (continued from `corpus`, if any) in the same forward
    (batches of BATCH requests, so that none waits and rounds run multi-step: the prefill round
    draws x1, one multi-step round x2 and x3 and any further tokens; (x1, x2, x3) are tested)."""
    eng = LLMEngine(worker(target, BATCH, 64, corpus=corpus), NgramProposer(), None,
                    EngineConfig(max_batch_size=BATCH, max_model_len=64, num_speculative_tokens=0,
                                 plain_steps=max_tokens, lookup_k=max_tokens - 1, lookup_max_batch=BATCH,
                                 adaptive=False),
                    eos_token_ids=[])
    out = []
    for lo in range(0, n, BATCH):
        params = [SamplingParams(max_tokens=max_tokens, temperature=case[0], top_k=case[1], top_p=case[2],
                                 seed=None if seeded is False else seed0 + i, ignore_eos=True)
                  for i in range(lo, min(n, lo + BATCH))]
        out += [s.output_ids[:STEPS] for s in eng.generate([prompts[i % 2] for i in range(lo, lo + len(params))],
                                                           params)]
    out = torch.tensor(out)  # [n, STEPS]
    codes = out[:, 0] * V * V + out[:, 1] * V + out[:, 2]
    return [_pvalue(codes[j::2], _exact_joint(ref, prompts[j], *case)) for j in range(2)], eng.stats


@pytest.mark.parametrize("case", CASES, ids=["T1", "T1-topk6-topp0.9"])
def test_sampled_prompt_lookup_is_lossless(models, case):
    ref, target = models[:2]
    pv, st = _sample_lookup(ref, target, seed0=50_000 + 1000 * CASES.index(case), case=case)
    assert st.lookup_accepted > N // 10 and st.lookup_proposed > st.lookup_accepted  # both paths taken
    assert min(pv) > ALPHA, pv


@pytest.mark.parametrize("case", CASES, ids=["T1", "T1-topk6-topp0.9"])
def test_sampled_draft_in_target_is_lossless(models, case):
    """The target worker's own copy of the EAGLE draft (TargetWorker.drafter, fused as shipped)
    drafting in multi-step plain rounds, on prompts that never repeat a token: its greedy chains
    are kept only where they equal the row's own draw."""
    ref, target, _, eagle = models
    worker = lambda t, b, m, corpus=None: TargetWorker(t, b, m, corpus=corpus, drafter=EagleProposer(eagle, b, m))  # noqa: E731
    pv, st = _sample_lookup(ref, target, worker, seed0=90_000 + 1000 * CASES.index(case), case=case,
                            prompts=[DISTINCT, DISTINCT[::-1]])
    assert st.target_draft_accepted > N // 25 and st.target_drafted > st.target_draft_accepted  # both paths taken
    assert min(pv) > ALPHA, pv


class _Raced(TargetWorker):
    """Counts the chain positions drawn by the exponential race (TargetWorker._race_noise), of
    them those raced over the draft's reduced vocabulary (sampling.RaceNoise), and the longest chain."""
    raced = reduced = longest = 0

    def _race_noise(self, batch, i, e, k):
        from specdec.sampling import RaceNoise
        noise = super()._race_noise(batch, i, e, k)
        type(self).raced += 0 if noise is None else len(noise)
        type(self).reduced += len(noise) if isinstance(noise, RaceNoise) else 0
        type(self).longest = max(type(self).longest, 0 if noise is None else len(noise))
        return noise


class _PositionNoise(_Raced):
    """Broken: race noise keyed by the position in the round, not by the sequence's own draws (every
    request then races with the same noise there: its draw is a function of the context)."""

    def _race_noise(self, batch, i, e, k):
        from specdec.sampling import race_noise_over
        noise = super()._race_noise(batch, i, e, k)
        u = torch.arange(e, e + k, dtype=torch.float64) / 64
        return None if noise is None else race_noise_over(u, self.vocab_size, self.drafter.token_map)


def _sample_raced(models, worker, case, seed0: int, monkeypatch, max_tokens: int = STEPS, draft_k: int = 2):
    """Unseeded requests (their base seeds from a counter here, so that the run is deterministic)
    through the in-target drafter: sampled rows without a seed race their chains."""
    import itertools

    import specdec.sequence
    ref, target, _, eagle = models
    seeds = itertools.count(seed0)
    monkeypatch.setattr(specdec.sequence, "new_base_seed", lambda seed: next(seeds) if seed is None else seed)
    worker.raced = worker.longest = 0
    make = lambda t, b, m, corpus=None: worker(t, b, m, corpus=corpus, drafter=EagleProposer(eagle, b, m),  # noqa: E731
                                               draft_k=draft_k)
    return _sample_lookup(ref, target, make, case=case, prompts=[DISTINCT, DISTINCT[::-1]], seeded=False,
                          max_tokens=max_tokens)


@pytest.mark.parametrize("case", CASES, ids=["T1", "T1-topk6-topp0.9"])
def test_sampled_raced_draft_in_target_is_lossless(models, case, monkeypatch):
    """Unseeded sampled rows: the in-target drafter's chains are raced with the noise of the
    positions they draft, and those positions are drawn by the exponential race with the same
    noise (TargetWorker._step_drafts): the draws are still exactly the target's."""
    _Raced.reduced = 0
    pv, st = _sample_raced(models, _Raced, case, 110_000 + 1000 * CASES.index(case), monkeypatch)
    assert _Raced.raced > N // 4  # the race path ran
    assert _Raced.reduced == _Raced.raced  # over the draft's reduced vocabulary (the rest merged)
    assert st.target_draft_accepted > N // 25 and st.target_drafted > st.target_draft_accepted
    assert min(pv) > ALPHA, pv


def test_raced_chains_of_several_tokens_are_lossless(models, monkeypatch):
    """Chains of up to 3 raced drafts per step (max_tokens 5: the multi-step round's budget of 4
    leaves them room), so a position whose noise a rejected chain already read is drawn again in
    the next step."""
    pv, st = _sample_raced(models, _Raced, CASES[0], 130_000, monkeypatch, max_tokens=5, draft_k=3)
    assert _Raced.longest >= 2 and _Raced.raced > N // 4  # chains of several raced positions ran
    assert st.target_draft_accepted > N // 25
    assert min(pv) > ALPHA, pv


def test_harness_rejects_race_noise_not_keyed_by_the_sequence(models, monkeypatch):
    pv, st = _sample_raced(models, _PositionNoise, CASES[0], 120_000, monkeypatch)
    assert _PositionNoise.raced > N // 4
    assert min(pv) < ALPHA, pv


class _CountFills(TargetWorker):
    """Counts the lookup tokens that filled padding positions (TargetWorker._fill)."""
    filled = 0

    def _fill(self, states, drafts, sizes):
        new = super()._fill(states, drafts, sizes)
        type(self).filled += sum(len(n) - len(d) for n, d in zip(new, drafts))
        return new


@pytest.mark.parametrize("min_ratio", [0.0, 0.4], ids=["any", "confident+fills"])
@pytest.mark.parametrize("case", CASES, ids=["T1", "T1-topk6-topp0.9"])
def test_sampled_corpus_lookup_is_lossless(models, case, min_ratio):
    """Lookups from a corpus of the target's own sampled answers (specdec.corpus), on prompts that
    never repeat a token: every lookup draft is the corpus's. With the default `min_ratio`, rows
    whose confident drafts end short fill the step's padding positions with the corpus's likeliest
    tokens (TargetWorker._fill): that path is driven here too."""
    from specdec.corpus import SEP, NgramCorpus
    ref, target = models[:2]
    prompts = [DISTINCT, DISTINCT[::-1]]
    eng = LLMEngine(TargetWorker(target, BATCH, 64), None, None,
                    EngineConfig(max_batch_size=BATCH, max_model_len=64, speculate=False), eos_token_ids=[])
    answers = [p[-3:] + s.output_ids for p in prompts for s in eng.generate(
        [p] * BATCH, [SamplingParams(max_tokens=STEPS, temperature=1.0, seed=10**6 + i) for i in range(BATCH)])]
    corpus = NgramCorpus([t for a in answers for t in (*a, SEP)], V, min_ratio=min_ratio)
    _CountFills.filled = 0
    pv, st = _sample_lookup(ref, target, _CountFills, seed0=70_000 + 1000 * CASES.index(case), case=case,
                            prompts=prompts, corpus=corpus)
    assert st.lookup_accepted > N // 10 and st.lookup_proposed > st.lookup_accepted  # both paths taken
    assert (_CountFills.filled > N // 10) == (min_ratio > 0)
    assert min(pv) > ALPHA, pv


def test_harness_rejects_lookup_with_one_draw_per_step(models):
    ref, target = models[:2]
    pv, st = _sample_lookup(ref, target, _OneDrawPerStep, seed0=9)
    assert st.lookup_accepted > N // 10
    assert min(pv) < ALPHA, pv


def test_a_draft_vocabulary_smaller_than_top_j_drafts(models):
    """q's truncation is min(top_j, vocabulary) wide everywhere (a 12-token draft with the default
    top_j crashed when sampled)."""
    ref, target, draft, eagle = models
    prop = Tracking(DraftModelProposer(draft, 8, 64))
    assert prop.inner.top_j > V
    eng = LLMEngine(TargetWorker(target, 8, 64), prop, None,
                    EngineConfig(max_batch_size=8, max_model_len=64, num_speculative_tokens=K, adaptive=False),
                    eos_token_ids=[])
    seqs = eng.generate([DISTINCT] * 4, SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True))
    assert prop.rows_drafted > 0 and all(len(s.output_ids) == 8 for s in seqs)


class _Recording(Tracking):
    """Keeps every round's draft output."""

    def __init__(self, inner):
        super().__init__(inner)
        self.outputs: list[DraftOutput] = []

    def propose(self, batch) -> DraftOutput:
        out = super().propose(batch)
        self.outputs.append(out)
        return out


@pytest.mark.parametrize("kind", ["draft", "eagle"])
def test_a_sampled_draft_reports_the_distribution_it_drew_from(models, kind):
    """The rejection sampler is lossless only if q is the distribution each draft was drawn from.
    With a top-2 truncation (most of the draft's mass cut off) every sampled row's q sums to 1, and
    the drafts fall on q's likelier token as often as q says (a q left unnormalised after the
    truncation over-accepted: biased output that the top-4 chi-square above did not resolve)."""
    ref, target, draft, eagle = models
    inner = (DraftModelProposer(draft, BATCH, 64, top_j=2) if kind == "draft"
             else EagleProposer(eagle, BATCH, 64, top_j=2))
    prop = _Recording(inner)
    eng = LLMEngine(TargetWorker(target, BATCH, 64), prop, None,
                    EngineConfig(max_batch_size=BATCH, max_model_len=64, num_speculative_tokens=K, adaptive=False),
                    eos_token_ids=[])
    eng.generate([PROMPTS[i % 2] for i in range(BATCH)],
                 SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True))
    hits, expected, rows = 0, 0.0, 0
    for out in prop.outputs:
        for b, n in enumerate(out.num_draft):
            ids, vals = out.probs.ids[b, :n], out.probs.vals[b, :n]  # [n, 2]
            assert torch.allclose(vals.sum(-1), torch.ones(n), atol=1e-5), vals
            drawn = ids == out.tokens[b, :n, None]  # [n, 2]
            assert drawn.any(1).all() and (vals[drawn] > 0).all()  # each draft is one of q's tokens
            hits += int((out.tokens[b, :n] == ids[:, 0]).sum())  # drew the likelier of the two
            expected += float(vals[:, 0].sum())
            rows += n
    assert rows > 1000
    sd = (expected * (1 - expected / rows)) ** 0.5  # binomial-like spread of the hit count
    assert abs(hits - expected) < 5 * sd, (hits, expected, rows)
