"""The in-target draft (`TargetWorker.drafter`): in multi-step plain rounds, an EAGLE-style draft
in the target's own process drafts the rows that prompt lookup finds nothing for, from the
features the target has just computed. Its chains are checked against plain decoding's own draws
(argmax for greedy rows, the row's seeded draw for sampled ones), so the output is plain
decoding's token for token (unseeded sampled rows race their chains instead: exact draws, tested
statistically in tests/test_lossless_proposers.py); its chains are the draft's own from the true features (a cache-free
recompute); accepted drafts save forwards; finished sequences free its state."""
import pytest
import torch

from specdec.eagle_draft import EagleDraft
from specdec.engine import EngineConfig, LLMEngine
from specdec.loader import load_model
from specdec.metadata import DraftOutput
from specdec.proposers.base import Proposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.ngram import NgramProposer
from specdec.sampling import SamplingParams
from specdec.target_worker import TargetWorker

PROMPTS = ["The weather today is", "import json\nimport os\nimport", "Once upon a time", "a b c a b c a b"]


def make_eagle(target, seed=0):
    """An untrained draft with the full head that fuses the target's layer 0 (EAGLE-3, random fuse)."""
    torch.manual_seed(seed)
    draft = EagleDraft.for_target(target, torch.arange(target.args.vocab_size), feature_layers=(0,))
    with torch.no_grad():
        draft.fuse.weight.normal_(0.0, 0.2)
    return draft.to(target.dtype).eval()


def engine(target, drafter=None, batch=4, k=2, lookup_k=2, plain_steps=8, worker=TargetWorker):
    """Plain rounds only (k_max 0), `plain_steps` per call, lookups in every multi-step round (not
    adaptive: the LookupGate would decide by timings)."""
    return LLMEngine(worker(target, batch, 256, drafter=drafter, draft_k=k), NgramProposer(), None,
                     EngineConfig(max_batch_size=batch, num_speculative_tokens=0, plain_steps=plain_steps,
                                  lookup_k=lookup_k, lookup_max_batch=8, ngram_k=8, adaptive=False),
                     eos_token_ids=[])


def outputs(eng, prompts, params):
    return [s.output_ids for s in eng.generate(prompts, params)]


@pytest.fixture(scope="module")
def prompts(tiny_tok):
    return [tiny_tok(p).input_ids for p in PROMPTS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafted_rounds_emit_plain_greedy_tokens(tiny_dir, prompts, dtype):
    target = load_model(tiny_dir, dtype=dtype)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = outputs(engine(target, plain_steps=1, lookup_k=0), prompts, params)
    eng = engine(target, EagleProposer(make_eagle(target), 4, 256))
    assert outputs(eng, prompts, params) == ref
    assert eng.stats.target_drafted > 0 and eng.stats.target_drafted <= eng.stats.lookup_proposed
    one = engine(target, EagleProposer(make_eagle(target), 1, 256), batch=1, k=3)
    assert [outputs(one, [p], params)[0] for p in prompts] == ref
    assert one.target.drafter.num_active == 0 and not one.target._pending and not one.target._fed  # released


def test_drafted_sampled_rows_draw_what_plain_rounds_draw(tiny_dir, prompts):
    target = load_model(tiny_dir)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=23, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    params = [sampled, greedy, sampled, greedy]
    ref = outputs(engine(target, plain_steps=1, lookup_k=0), prompts, params)
    eng = engine(target, EagleProposer(make_eagle(target), 4, 256))
    assert outputs(eng, prompts, params) == ref
    assert eng.stats.target_drafted > 0


class RaceCounter(TargetWorker):
    """Counts the chain positions drawn by the exponential race."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.raced = 0

    def _race_noise(self, batch, i, e, k):
        noise = super()._race_noise(batch, i, e, k)
        self.raced += 0 if noise is None else len(noise)
        return noise


def test_unseeded_sampled_rows_race_beside_rows_that_must_reproduce(tiny_dir, prompts):
    """An unseeded sampled row races its chains (sampling.race_sample) in the same lane as a seeded
    sampled row and greedy rows, which still emit plain decoding's tokens; seeded rows never race."""
    target = load_model(tiny_dir)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=23, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    unseeded = SamplingParams(max_tokens=27, temperature=0.8, top_p=0.9, ignore_eos=True)
    ref = outputs(engine(target, plain_steps=1, lookup_k=0), prompts, [seeded, greedy, unseeded, greedy])
    eng = engine(target, EagleProposer(make_eagle(target), 4, 256), worker=RaceCounter)
    out = outputs(eng, prompts, [seeded, greedy, unseeded, greedy])
    assert [out[i] for i in (0, 1, 3)] == [ref[i] for i in (0, 1, 3)]
    assert len(out[2]) == 27 and eng.target.raced > 0
    seeded_only = engine(target, EagleProposer(make_eagle(target), 4, 256), worker=RaceCounter)
    assert outputs(seeded_only, prompts, [seeded, greedy, seeded, greedy]) == \
        outputs(engine(target, plain_steps=1, lookup_k=0), prompts, [seeded, greedy, seeded, greedy])
    assert seeded_only.target.raced == 0 and seeded_only.stats.target_drafted > 0


class ChainLengths(TargetWorker):
    """Records the chain length asked of the drafter per row kind (greedy or sampled)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.asked = {True: set(), False: set()}

    def _draft_chains(self, batch, go, ks, noise):
        for (i, _), k in zip(go, ks):
            self.asked[bool(batch.temperature[i] == 0)].add(k)
        return super()._draft_chains(batch, go, ks, noise)


def test_greedy_rows_draft_longer_chains(tiny_dir, prompts):
    """`greedy_draft_k` for greedy rows, `draft_k` for sampled ones, in one lane (both within the
    step's lookup room); the output stays plain decoding's."""
    target = load_model(tiny_dir)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=23, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    params = [seeded, greedy, seeded, greedy]
    ref = outputs(engine(target, plain_steps=1, lookup_k=0), prompts, params)
    eng = LLMEngine(ChainLengths(target, 4, 256, drafter=EagleProposer(make_eagle(target), 4, 256), draft_k=2,
                                 greedy_draft_k=3), NgramProposer(), None,
                    EngineConfig(max_batch_size=4, num_speculative_tokens=0, plain_steps=8, lookup_k=3,
                                 lookup_max_batch=8, ngram_k=8, adaptive=False), eos_token_ids=[])
    assert outputs(eng, prompts, params) == ref
    assert 3 in eng.target.asked[True] and max(eng.target.asked[True]) == 3
    assert eng.target.asked[False] and max(eng.target.asked[False]) == 2


class Recorder(EagleProposer):
    """Records each drafted row's context length and chain."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []  # (seq_id, confirmed tokens, chain)

    def propose(self, batch):
        out = super().propose(batch)
        for i, sid in enumerate(batch.seq_ids):
            if out.num_draft[i] > 0:
                n = len(self.table[sid].tokens) - out.num_draft[i] + 1  # the chain's tentative tokens come after
                self.seen.append((sid, n, out.tokens[i, : out.num_draft[i]].tolist()))
        return out


def test_chains_come_from_the_true_features(tiny_dir, prompts):
    """Every chain's first token is what the draft predicts from the target's features of the
    whole confirmed context, with the taps it fuses (one cache-free pass): the features the worker
    keeps and sends line up with the positions, across steps, calls and rows."""
    target = load_model(tiny_dir)
    draft = make_eagle(target)
    rec = Recorder(draft, 4, 256)
    eng = engine(target, rec)
    seqs = eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    by_id = {s.seq_id: s for s in seqs}
    target.feature_layers = (0,)  # the draft's taps, whatever the worker set
    with torch.inference_mode():
        for sid, n, chain in rec.seen:
            x = torch.tensor(by_id[sid].tokens)[None]  # [1, L]
            target.setup_cache(1, x.shape[1] + 8)
            f = target.hidden_states(x, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), taps=True)
            g, _ = draft.forward_train(f[:, : n - 1], x[:, 1:n])  # g[n-2] drafts x_n
            assert int(draft.lm_head(g[0, -1]).argmax()) == chain[0]
    assert len(rec.seen) >= 20


class Oracle(Proposer):
    """Knows the reference continuations: proposes the true next token, then a wrong one."""

    def __init__(self, sequences: list[list[int]], vocab: int):
        self.sequences, self.vocab, self.tokens = sequences, vocab, {}

    def propose(self, batch):
        tokens = torch.zeros(len(batch), batch.max_draft, dtype=torch.long)
        for i, sid in enumerate(batch.seq_ids):
            ctx = self.tokens[sid] = self.tokens.get(sid, [])[: batch.offsets[i]] + batch.new_tokens[i]
            full = next(s for s in self.sequences if s[: len(ctx)] == ctx)
            true = full[len(ctx)]
            tokens[i, : batch.num_draft[i]] = torch.tensor([true, (true + 1) % self.vocab, true][: batch.num_draft[i]])
        return DraftOutput(tokens, list(batch.num_draft))

    def release(self, seq_ids):
        for s in seq_ids:
            self.tokens.pop(s, None)


def test_accepted_drafts_save_forwards(tiny_dir, prompts):
    target = load_model(tiny_dir)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = engine(target, plain_steps=1, lookup_k=0, batch=1)
    ref = [outputs(plain, [p], params)[0] for p in prompts]
    eng = engine(target, Oracle([p + r for p, r in zip(prompts, ref)], target.args.vocab_size), batch=1, k=3)
    calls = []
    verify = eng.target.verify
    eng.target.verify = lambda b, d: calls.append(verify(b, d)) or calls[-1]
    assert [outputs(eng, [p], params)[0] for p in prompts] == ref
    st = eng.stats
    assert st.target_draft_accepted > 0 and st.target_draft_accepted < st.target_drafted  # the wrong ones
    assert sum(c.steps for c in calls) == len(prompts) * 30 - st.lookup_accepted  # each accepted token: one forward less


def test_undrafted_rows_keep_a_bounded_feature_tail(tiny_dir, prompts, monkeypatch):
    """Rows the drafter does not draft (here: no lookups at all) keep only the last
    PENDING_FEATURES positions of features, not their whole history, and nothing once released."""
    from specdec import target_worker
    monkeypatch.setattr(target_worker, "PENDING_FEATURES", 16)
    target = load_model(tiny_dir)
    eng = engine(target, EagleProposer(make_eagle(target), 4, 256), lookup_k=0)
    seen = []
    verify = eng.target.verify

    def spy(b, d):
        out = verify(b, d)
        for _, chunks, n in eng.target._pending.values():
            assert n == sum(map(len, chunks))  # the count kept beside the chunks
            seen.append(n)
        return out
    eng.target.verify = spy
    eng.generate(prompts, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    assert eng.stats.target_drafted == 0 and max(seen) >= 16
    assert max(seen) < 16 + max(map(len, prompts))  # the tail, and at most the chunk before it
    assert not eng.target._pending


def test_corpus_fill_is_not_counted_as_the_drafters_tokens(tiny_dir, prompts, monkeypatch):
    """In a step of several rows the corpus continues short drafts to the step's K: the tokens it
    appends to a drafter's chain are lookups, not the drafter's (target_drafted counted them)."""
    import specdec.target_worker as tw
    from specdec.corpus import NgramCorpus
    target = load_model(tiny_dir)
    torch.manual_seed(0)
    corpus = NgramCorpus(torch.randint(0, target.args.vocab_size, (4000,)).tolist(), target.args.vocab_size)
    second = prompts[1]  # its row "finds" a 4-token lookup each step (wrong tokens: verified, output unchanged)
    real_lookup = tw.lookup_draft
    monkeypatch.setattr(tw, "ngram_lookup", lambda tokens, k, *n: [3] if tokens[:len(second)] == second else [])
    monkeypatch.setattr(tw, "lookup_draft", lambda tokens, room, corpus=None: [3] * min(4, room)
                        if tokens[:len(second)] == second else real_lookup(tokens, room, corpus))
    own = []

    class Counting(TargetWorker):
        def __init__(self, *a, **kw):
            super().__init__(*a, corpus=corpus, **kw)

        def _step_drafts(self, batch, go, rooms, emitted):
            drafts, drafted, race = super()._step_drafts(batch, go, rooms, emitted)
            own.extend(len(drafts[r]) for r in drafted)
            return drafts, drafted, race
    eng = engine(target, EagleProposer(make_eagle(target), 2, 256), batch=2, k=1, lookup_k=4, worker=Counting)
    outputs(eng, prompts[:2], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert own and eng.stats.target_drafted == sum(own)  # (the chains of 1 were filled to the step's K = 4)
    assert eng.stats.target_draft_accepted <= eng.stats.target_drafted
