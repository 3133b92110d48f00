"""EAGLE-style drafts (specdec.eagle_draft): lossless in the engine, features kept in step with the
target across rounds, checkpoints round-trip, and the hybrid n-gram/draft proposer."""
import pytest
import torch

from specdec.eagle_draft import EagleDraft, is_eagle, load_eagle
from specdec.engine import EngineConfig, LLMEngine
from specdec.loader import load_model
from specdec.proposers import build_proposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.hybrid import HybridProposer
from specdec.proposers.ngram import NgramProposer
from specdec.sampling import SamplingParams
from specdec.target_worker import TargetWorker

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add", "import json\nimport os\nimport", "class Foo:\n    x = 1\n",
           "a b c a b c a b"]


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(tiny_dir)


def make_eagle(target, vocab=128, seed=0):
    torch.manual_seed(seed)
    ids = torch.randperm(target.args.vocab_size)[:vocab].sort().values
    return EagleDraft.for_target(target, ids).eval()


def engine(target, proposer, k=3, batch=8, adaptive=False):
    return LLMEngine(TargetWorker(target, batch, 512), proposer, None,
                     EngineConfig(max_batch_size=batch, num_speculative_tokens=k, adaptive=adaptive),
                     eos_token_ids=[])


def run(eng, prompts, params):
    return [s.output_ids for s in eng.generate(prompts, params)]


def greedy(n=24):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_tok):
    return [tiny_tok(p).input_ids for p in PROMPTS]


@pytest.mark.parametrize("k", [1, 4])
def test_eagle_greedy_identity(target, prompts, k):
    ref = run(engine(target, None), prompts, greedy())
    draft = make_eagle(target)
    assert run(engine(target, EagleProposer(draft, 8, 512), k=k), prompts, greedy()) == ref
    single = [run(engine(target, EagleProposer(draft, 1, 512), k=k, batch=1), [p], greedy())[0] for p in prompts]
    assert single == ref


class Recorder(EagleProposer):
    """Records, per row and round, the context length, the draft tokens and the feature the draft's
    first step predicted (which drafts the first token)."""

    def __init__(self, *a, twice: bool = False, **kw):
        super().__init__(*a, **kw)
        self.seen = []  # (seq_id, n tokens, draft tokens, first step's predicted feature [hidden], context start)
        self._first: dict[int, torch.Tensor] = {}
        self.twice = twice  # every call applied twice (a reply lost after the replica applied it)

    def _step(self, j, active, sts, batch):
        logits = super()._step(j, active, sts, batch)
        if j == 0:
            self._first = {batch.seq_ids[i]: self._g[i][0].clone() for i in active}
        return logits

    def propose(self, batch):
        out = super().propose(batch)
        if self.twice:
            out = super().propose(batch)
        for i, sid in enumerate(batch.seq_ids):
            if out.num_draft[i] > 0:
                n = len(self.table[sid].tokens) - out.num_draft[i] + 1
                self.seen.append((sid, n, out.tokens[i, : out.num_draft[i]].tolist(), self._first[sid],
                                  self.buffers[sid].base))
        return out


@pytest.fixture(scope="module")
def two_token_target(tiny_dir):
    """A target whose head scores only tokens 0 and 1 (rows v and -v), so that a draft sharing the
    head agrees with it often: its rounds accept drafts, where a random target's reject nearly all."""
    t = load_model(tiny_dir)
    torch.manual_seed(1)
    v = torch.randn(t.args.hidden_size)
    w = torch.zeros_like(t.lm_head.weight)
    w[0], w[1] = v, -v
    t.lm_head.weight = torch.nn.Parameter(w)  # (untied: the embedding keeps its weights)
    return t


@pytest.mark.parametrize("which,twice", [("target", False), ("two_token_target", False), ("two_token_target", True)])
def test_eagle_cache_matches_a_full_recompute(which, twice, prompts, request):
    """The first two draft tokens of every round equal those of a cache-free pass over the
    target's true features (step 2: the last input replaced by the draft's own prediction), and so
    does the feature the first step predicts (finer than its argmax: one true feature entry missing
    from the draft's cache, or entered twice, moves it, but rarely the token): prefill features,
    per-round features, tentative entries and rollback line up, also when every call is applied twice."""
    target = request.getfixturevalue(which)
    draft = make_eagle(target, vocab=target.args.vocab_size)  # full head: argmax ids are token ids
    rec = Recorder(draft, 8, 512, twice=twice)
    eng = engine(target, rec, k=3)
    seqs = eng.generate(prompts, greedy(32))
    assert _check_against_a_recompute(target, draft, rec.seen, seqs) >= 10
    if which == "two_token_target":  # (rounds that accepted drafts: entries past the first position)
        assert eng.stats.accepted >= eng.stats.proposed / 8, (eng.stats.accepted, eng.stats.proposed)


def _check_against_a_recompute(target, draft, seen, seqs) -> int:
    """Each recorded round's first two drafts and first predicted feature against a cache-free pass
    of the draft over the target's true features of the row's context (from where the draft's
    context starts: its cache index 0); returns how many rounds it checked."""
    by_id = {s.seq_id: s for s in seqs}
    with torch.inference_mode():
        for sid, n, drafts, g0, base in seen:
            x = torch.tensor(by_id[sid].tokens)[None]  # [1, L]
            target.setup_cache(1, x.shape[1] + 8)
            f = target.hidden_states(x, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
            f, x = f[:, base:], x[:, base:]
            m = n - base
            g, _ = draft.forward_train(f[:, : m - 1], x[:, 1:m])  # [1, m-1, hidden]; g[m-2] drafts x_n
            assert int(draft.lm_head(g[0, -1]).argmax()) == drafts[0]
            torch.testing.assert_close(g0, g[0, -1], atol=1e-4, rtol=1e-4)
            if len(drafts) > 1:  # step 2 reads (g_{n-2}, d_1) at position n-1
                g2, _ = draft.forward_train(torch.cat([f[:, : m - 1], g[:, -1:]], 1),
                                            torch.cat([x[:, 1:m], torch.tensor([[drafts[0]]])], 1))
                assert int(draft.lm_head(g2[0, -1]).argmax()) == drafts[1]
    return len(seen)


def test_after_a_gap_in_its_features_the_draft_restarts_its_context_there(two_token_target, prompts, monkeypatch):
    """Rows that ran more plain rounds than their feature queue holds (speculation off for a while:
    the adaptive policy, a draft replica down) come back with the oldest features dropped: the draft
    starts its context afresh at the first feature it gets, and predicts as a cache-free pass from
    there does."""
    from dataclasses import replace

    from specdec.sequence import Sequence
    monkeypatch.setattr(Sequence, "MAX_PENDING_FEATURES", 4)
    target = two_token_target
    draft = make_eagle(target, vocab=target.args.vocab_size)
    rec = Recorder(draft, 8, 512)
    eng = engine(target, rec, k=3)
    seqs = [eng.add_request(p, greedy(48)) for p in prompts]
    for _ in range(3):
        eng.step()
    cfg = eng.scheduler.cfg
    eng.scheduler.set_config(replace(cfg, speculate=False))  # plain rounds: features queue up
    for _ in range(8):
        eng.step()
    eng.scheduler.set_config(cfg)
    before = len(rec.seen)
    while eng.scheduler.has_work:
        eng.step()
    after = rec.seen[before:]
    assert after and all(base > 0 for *_, base in after)  # (the gap: a context of its own)
    assert _check_against_a_recompute(target, draft, after, seqs) >= 10


def test_second_pass_with_context_is_the_second_draft_step(target):
    """forward_train(context=...) gives, at every position p, what inference's second step gives:
    true entries before p, one entry from the draft's own prediction at p."""
    draft = make_eagle(target)
    torch.manual_seed(0)
    B, T, H = 2, 12, target.args.hidden_size
    f, x = torch.randn(B, T, H), torch.randint(0, target.args.vocab_size, (B, T))
    with torch.no_grad():
        g1, kv = draft.forward_train(f, x)
        g2, _ = draft.forward_train(torch.cat([f[:, :1], g1[:, :-1]], 1), x, context=kv)
        for p in (1, 5, T - 1):
            ref, _ = draft.forward_train(torch.cat([f[:, :p], g1[:, p - 1: p]], 1), x[:, : p + 1])
            torch.testing.assert_close(g2[:, p], ref[:, p], atol=1e-5, rtol=1e-5)


def test_eagle_checkpoint_roundtrip(target, tiny_dir, tiny_tok, tmp_path, prompts):
    draft = make_eagle(target)
    draft.save(tmp_path / "eagle", tiny_tok, {"target": str(tiny_dir)}, dtype=torch.float32)
    assert is_eagle(tmp_path / "eagle") and not is_eagle(tiny_dir)
    again = load_eagle(tmp_path / "eagle", target)
    for k, v in draft.trained_state().items():
        assert torch.equal(v, again.trained_state()[k]), k
    assert torch.equal(again.token_map, draft.token_map)
    # "draft" and "eagle" kinds both load it (a draft checkpoint of the EAGLE kind)
    for kind in ("eagle", "draft"):
        prop = build_proposer(kind, draft=str(tmp_path / "eagle"), target=str(tiny_dir), num_slots=8,
                              max_model_len=512, target_model=target)
        assert isinstance(prop, EagleProposer)
    ref = run(engine(target, None), prompts, greedy())
    assert run(engine(target, prop), prompts, greedy()) == ref


def test_eagle_refuses_a_mismatched_target(target, tiny_draft_dir, tiny_tok, tmp_path):
    make_eagle(target).save(tmp_path / "e", tiny_tok, {}, dtype=torch.float32)
    with pytest.raises(ValueError, match="hidden_size"):
        load_eagle(tmp_path / "e", load_model(tiny_draft_dir))
    with pytest.raises(ValueError, match="not an EAGLE draft"):
        load_eagle(tiny_draft_dir, target)


@pytest.mark.parametrize("k", [2, 4])
def test_hybrid_is_lossless_and_uses_both(target, prompts, k):
    ref = run(engine(target, None), prompts, greedy(32))
    hyb = HybridProposer(NgramProposer(min_n=2, max_n=4), EagleProposer(make_eagle(target), 8, 512))
    assert run(engine(target, hyb, k=k), prompts, greedy(32)) == ref
    assert hyb.ngram_rows > 0 and hyb.model_rows > 0


def test_eagle_restarts_after_a_gap(target, prompts):
    """A proposer that loses a sequence (replica restart) rejoins from the features it gets."""
    prop = EagleProposer(make_eagle(target), 8, 512)
    eng = engine(target, prop, k=3)
    ref = run(engine(target, None), prompts[:2], greedy(32))
    seqs = [eng.add_request(p, greedy(32)) for p in prompts[:2]]
    for _ in range(3):
        eng.step()
    prop.release([s.seq_id for s in seqs])  # forget everything: the next round reports unknown rows
    base = {}  # the position each sequence's draft context starts at, as last seen
    while eng.scheduler.has_work:
        eng.step()
        base |= {s.seq_id: prop.buffers[s.seq_id].base for s in seqs if s.seq_id in prop.buffers}
    assert [s.output_ids for s in seqs] == ref
    assert eng.stats.proposed > 0
    # the target re-prefilled them, so the draft's context starts at the prompt again, not where
    # the loss happened (which would cost acceptance for the rest of the sequence)
    assert base == {s.seq_id: 0 for s in seqs}


def test_training_time_test_unrolls_each_step_on_the_previous_steps_predictions(target):
    """eagle_loss with draft_steps=3: a third pass reads the second pass's predictions (shifted by
    one, the first pass's entries as context), masked where no such prediction exists, weighted
    step2_weight^2; draft_steps 2 is unchanged by it."""
    from specdec_tools.distill.eagle_train import EagleTrainConfig, _step_loss, eagle_loss
    draft = make_eagle(target)
    torch.manual_seed(1)
    B, T, H = 2, 10, target.args.hidden_size
    feats, toks = torch.randn(B, T, H), torch.randint(0, 128, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    cfg = lambda n: EagleTrainConfig(draft_steps=n, noise=0.0)  # noqa: E731
    with torch.no_grad():
        l2, i2 = eagle_loss(draft, feats, toks, mask, cfg(2))
        l3, i3 = eagle_loss(draft, feats, toks, mask, cfg(3))
        f_in, f_out = feats[:, :-1], feats[:, 1:]
        head = draft.lm_head.weight.float()
        p_t = torch.softmax(f_out @ head.T, -1)
        g1, kv = draft.forward_train(f_in, toks[:, 1:])
        g2, _ = draft.forward_train(torch.cat([f_in[:, :1], g1[:, :-1]], 1), toks[:, 1:], context=kv)
        g3, _ = draft.forward_train(torch.cat([f_in[:, :1], g2[:, :-1]], 1), toks[:, 1:], context=kv)
        m3 = torch.ones(B, T - 1)
        m3[:, :2] = 0
        want, _ = _step_loss(g3, f_out, head, p_t, p_t.argmax(-1), m3, cfg(3).cls_weight)
    assert "top1_step3" in i3 and "top1_step3" not in i2 and i3["top1_step2"] == i2["top1_step2"]
    torch.testing.assert_close(l3, l2 + cfg(3).step2_weight ** 2 * want)
    loss, _ = eagle_loss(draft, feats, toks, mask, cfg(4))  # and it trains: backward through all steps
    loss.backward()
    assert draft.fc.weight.grad is not None and bool(draft.fc.weight.grad.abs().sum() > 0)


def test_feature_cache_reuses_rows_by_content_wherever_they_move(target, tmp_path):
    """A rerun whose rows were inserted or reordered prefills only the new rows and returns every
    row in the order asked (a cache matched by position would pair rows with other rows' data)."""
    from specdec_tools.distill.eagle_train import FeatureCache
    g = torch.Generator().manual_seed(0)
    rows = [("chat", torch.randint(0, target.args.vocab_size, (n,), generator=g).tolist()) for n in (9, 5, 12)]
    path = tmp_path / "features.pt"
    first = FeatureCache.build(target, rows, path=path)
    prefilled = []
    prefill = FeatureCache._prefill
    FeatureCache._prefill = lambda self, t, rs: prefilled.extend(rs) or prefill(self, t, rs)
    try:
        new = ("follow-up", [3, 1, 4, 1, 5, 9])
        again = FeatureCache.build(target, [rows[2], new, rows[0], rows[1]], path=path)
    finally:
        FeatureCache._prefill = prefill
    assert prefilled == [new[1]]
    assert [t.tolist() for t in again.tokens] == [rows[2][1], new[1], rows[0][1], rows[1][1]]
    assert again.kinds == ["chat", "follow-up", "chat", "chat"]
    assert torch.equal(again.feats[0], first.feats[2]) and torch.equal(again.feats[2], first.feats[0])
    assert len(FeatureCache.load(path).tokens) == 4


@pytest.mark.parametrize("save_minutes, saves", [(0, 3), (60, 1)])
def test_feature_cache_saves_its_store_on_a_clock_and_at_the_end(target, tmp_path, monkeypatch, save_minutes, saves):
    """Chunks of one row: with save_minutes 0 the store is rewritten after every chunk (an interrupted
    run keeps what it prefilled); with an hour, once, at the end, holding every row (on a GPU a
    chunk takes seconds and rewriting gigabytes after each would dominate)."""
    from specdec_tools.distill.eagle_train import FeatureCache
    rows = [("chat", [5 + i, 6, 7, 8 + i]) for i in range(3)]
    written = []
    save = FeatureCache.save
    monkeypatch.setattr(FeatureCache, "save", lambda self, path: written.append(len(self.tokens)) or save(self, path))
    FeatureCache.build(target, rows, path=tmp_path / "f.pt", chunk_rows=1, save_minutes=save_minutes)
    assert written == [1, 2, 3][-saves:] and len(FeatureCache.load(tmp_path / "f.pt").tokens) == 3


class Drafts(EagleProposer):
    """Records every round's proposals."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.proposed = []

    def propose(self, batch):
        out = super().propose(batch)
        self.proposed.append([out.tokens[i, : out.num_draft[i]].tolist() for i in range(len(batch))])
        return out


def fused_copy(target, draft, layers=(0,)):
    """`draft` with EAGLE-3 fusion over `layers`, fuse at its identity start."""
    fused = EagleDraft.for_target(target, draft.token_map, feature_layers=layers).eval()
    fused.load_state_dict(draft.trained_state(), strict=False)
    return fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_feature_taps_leave_the_logits_alone(tiny_dir, dtype):
    """With feature_layers the features gain the taps in front; the logits stay bit-identical."""
    model = load_model(tiny_dir, dtype=dtype)
    model.setup_cache(2, 64)
    x, slots, starts = torch.randint(0, 500, (2, 7)), torch.arange(2), torch.zeros(2, dtype=torch.long)
    with torch.inference_mode():
        ref_logits, ref_h = model(x, slots, starts, n_logits=4, n_hidden=5)
        model.feature_layers = (0,)
        logits, h = model(x, slots, starts, n_logits=4, n_hidden=5)
    H = model.args.hidden_size
    assert torch.equal(logits, ref_logits) and torch.equal(h[..., H:], ref_h)
    assert h.shape[-1] == 2 * H and not torch.equal(h[..., :H], ref_h)


def test_fused_draft_starts_as_the_unfused_one_and_is_lossless(target, prompts, tiny_tok, tiny_dir, tmp_path):
    """EAGLE-3 fusion: at its identity start a fusing draft proposes exactly what the draft it was
    made from proposes; with a trained (here: perturbed) fuse the target's taps change its
    proposals, greedy output still equals plain decoding, and the checkpoint round-trips."""
    from specdec.eagle_draft import feature_layers
    ref = run(engine(target, None), prompts, greedy())
    draft = make_eagle(target, vocab=target.args.vocab_size)
    plain_p, fused_p = Drafts(draft, 8, 512), Drafts(fused_copy(target, draft), 8, 512)
    assert run(engine(target, plain_p), prompts, greedy()) == ref
    assert run(engine(target, fused_p), prompts, greedy()) == ref
    assert fused_p.proposed == plain_p.proposed and sum(map(len, sum(plain_p.proposed, []))) > 20
    fused = fused_copy(target, draft)
    with torch.no_grad():
        fused.fuse.weight.add_(torch.randn_like(fused.fuse.weight) * 0.5)
    perturbed = Drafts(fused, 8, 512)
    assert run(engine(target, perturbed), prompts, greedy()) == ref
    assert perturbed.proposed != plain_p.proposed
    fused.save(tmp_path / "fused", tiny_tok, {"target": str(tiny_dir)}, dtype=torch.float32)
    again = load_eagle(tmp_path / "fused", target)
    assert again.feature_layers == (0,) and feature_layers(tmp_path / "fused") == [0]
    assert all(torch.equal(v, again.trained_state()[k]) for k, v in fused.trained_state().items())
    hybrid = HybridProposer(NgramProposer(min_n=3), EagleProposer(again, 8, 512))
    assert hybrid.feature_layers == (0,) and run(engine(target, hybrid), prompts, greedy()) == ref
    target.feature_layers = ()


def test_fused_features_are_cached_and_trained(target, tmp_path):
    """The feature cache of a target with feature_layers holds [taps; final feature] per position
    (the final part equal to an untapped cache), and eagle_loss trains fuse through every step."""
    from specdec_tools.distill.eagle_train import EagleTrainConfig, FeatureCache, eagle_loss
    g = torch.Generator().manual_seed(0)
    rows = [("chat", torch.randint(0, target.args.vocab_size, (n,), generator=g).tolist()) for n in (9, 12)]
    H = target.args.hidden_size
    plain = FeatureCache.build(target, rows, path=tmp_path / "f.pt")
    target.feature_layers = (0,)
    try:
        tapped = FeatureCache.build(target, rows, path=tmp_path / "f-0.pt")
    finally:
        target.feature_layers = ()
    assert all(f.shape[-1] == 2 * H and torch.equal(f[:, H:], p) for f, p in zip(tapped.feats, plain.feats))
    assert torch.equal(tapped.pred_counts, plain.pred_counts)
    draft = fused_copy(target, make_eagle(target))
    feats = torch.nn.utils.rnn.pad_sequence(tapped.feats, batch_first=True).float()
    toks = torch.nn.utils.rnn.pad_sequence(tapped.tokens, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(t), dtype=torch.bool) for t in tapped.tokens],
                                           batch_first=True)
    loss, info = eagle_loss(draft, feats, toks, mask, EagleTrainConfig(draft_steps=3, noise=0.0))
    loss.backward()
    assert "top1_step3" in info and bool(draft.fuse.weight.grad[:, :H].abs().sum() > 0)


def test_a_grown_draft_starts_as_its_source_and_is_lossless(target, prompts, tiny_tok, tiny_dir, tmp_path):
    """`load_grown`: a two-layer draft loaded from a one-layer one proposes exactly what its source
    proposes (the new layer starts as the identity); once the new layer is trained (here: perturbed)
    its proposals change, greedy output still equals plain decoding, and the checkpoint round-trips."""
    ref = run(engine(target, None), prompts, greedy())
    draft = make_eagle(target, vocab=target.args.vocab_size)
    grown = EagleDraft.for_target(target, draft.token_map, num_layers=2).eval()
    grown.load_grown(draft.trained_state())
    source_p, grown_p = Drafts(draft, 8, 512), Drafts(grown, 8, 512)
    assert run(engine(target, source_p), prompts, greedy()) == ref
    assert run(engine(target, grown_p), prompts, greedy()) == ref
    assert grown_p.proposed == source_p.proposed and sum(map(len, sum(source_p.proposed, []))) > 20
    with torch.no_grad():
        for p in grown.layers[1].parameters():
            p.add_(torch.randn_like(p) * 0.5)
    perturbed = Drafts(grown, 8, 512)
    assert run(engine(target, perturbed), prompts, greedy()) == ref
    assert perturbed.proposed != source_p.proposed
    grown.save(tmp_path / "grown", tiny_tok, {"target": str(tiny_dir)}, dtype=torch.float32)
    again = load_eagle(tmp_path / "grown", target)
    assert len(again.layers) == 2
    assert all(torch.equal(v, again.trained_state()[k]) for k, v in grown.trained_state().items())
    with pytest.raises(ValueError, match="2 decoder layers"):
        make_eagle(target).load_grown(grown.trained_state())


def test_features_of_a_re_fed_position_replace_the_queued_ones():
    """After a taken sibling the target feeds the sibling's position again; when the next round
    sends nothing to the proposer (plain), the queue must keep the positions before it: a restart
    there made the EAGLE draft lose its whole context for the rest of the sequence."""
    from specdec.sampling import SamplingParams
    from specdec.sequence import Sequence
    s = Sequence([1, 2, 3], SamplingParams(max_tokens=8))
    first, again = torch.arange(10.0).reshape(5, 2), -torch.ones(2, 2)
    s.add_features(0, first)  # positions 0..4
    s.add_features(4, again)  # position 4 fed again, then 5
    start, feats = s.pending_features()
    assert start == 0 and torch.equal(feats, torch.cat([first[:4], again]))
    s.add_features(9, again)  # a gap: start over there
    assert s.pending_features()[0] == 9


def test_a_draft_made_for_another_target_of_the_same_shape_loads_with_a_warning(
        target, tiny_dir, tiny_tok, tmp_path, caplog):
    """The draft records its target's fingerprint; the same target in another dtype matches it, a
    same-shape target with other weights (another fine-tune) is named in the log (output stays
    the target's; acceptance drops), and a draft saved without one loads quietly."""
    import json
    make_eagle(target).save(tmp_path / "e", tiny_tok, {"target": str(tiny_dir)}, dtype=torch.float32)
    other = load_model(tiny_dir)
    with torch.no_grad():
        other.embed_tokens.weight.add_(0.05 * torch.randn_like(other.embed_tokens.weight))
    with caplog.at_level("WARNING", logger="specdec.eagle_draft"):
        load_eagle(tmp_path / "e", target)
        load_eagle(tmp_path / "e", load_model(tiny_dir, dtype=torch.bfloat16))
        assert not caplog.records
        load_eagle(tmp_path / "e", other)
        assert len(caplog.records) == 1 and "another target" in caplog.records[0].getMessage()
        meta = tmp_path / "e" / "specdec.json"
        meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "target_fingerprint"}))
        load_eagle(tmp_path / "e", other)
        assert len(caplog.records) == 1


def test_an_eagle_checkpoint_missing_a_trained_weight_is_refused(tiny_dir, tiny_eagle_dir, tmp_path):
    """A draft would otherwise run with random layers, and nothing would say so."""
    import shutil

    from safetensors.torch import load_file, save_file
    target = load_model(tiny_dir)
    load_eagle(tiny_eagle_dir, target)  # complete: loads
    bad = tmp_path / "eagle"
    shutil.copytree(tiny_eagle_dir, bad)
    state = load_file(str(bad / "model.safetensors"))
    state.pop(next(k for k in state if k.startswith("layers.0.mlp.")))
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not match"):
        load_eagle(bad, target)


def test_finished_sequences_leave_no_feature_buffers(target, prompts):
    """A released sequence's queued target features go with it: a replica serving for days keeps
    no buffer per sequence it ever served."""
    prop = EagleProposer(make_eagle(target), 8, 512)
    seqs = engine(target, prop, k=3).generate(prompts, greedy(12))
    assert all(s.finished for s in seqs) and len(prop.table) == 0
    assert prop.buffers == {}


def test_a_reduced_draft_head_holds_the_targets_rows_of_its_tokens(target, tiny_tok, tmp_path):
    """The draft's head row j is the target's head row of token_map[j] (FR-Spec), fresh and loaded."""
    ids = torch.tensor([3, 17, 42, 99, 250])
    draft = EagleDraft.for_target(target, ids)
    want = target.lm_head.weight.detach()[ids]
    assert torch.equal(draft.lm_head.weight, want)
    draft.save(tmp_path / "e", tiny_tok, {}, dtype=torch.float32)
    assert torch.equal(load_eagle(tmp_path / "e", target).lm_head.weight, want)


@pytest.mark.parametrize("layers", [(1,), (5,)])
def test_an_eagle_draft_fusing_layers_the_target_lacks_is_refused_at_load(target, tiny_tok, tmp_path, layers):
    """The tiny target has 2 layers: only layer 0 may be fused (the last one is the final feature)."""
    torch.manual_seed(0)
    ids = torch.randperm(target.args.vocab_size)[:128].sort().values
    EagleDraft.for_target(target, ids, feature_layers=layers).save(tmp_path / "e", tiny_tok, {}, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"fuses target layers \[\d\]; the target has 2"):
        load_eagle(tmp_path / "e", target)


def test_a_proposer_and_a_drafter_tapping_different_target_layers_are_refused(target, tiny_eagle_dir):
    """The target returns one set of tapped layers per forward: a proposer and an in-target drafter
    that read different ones would get features of the wrong layers."""
    from specdec.eagle_draft import load_eagle
    saved = target.feature_layers
    try:
        drafter = EagleProposer(make_eagle(target), 8, 512)  # EAGLE-1: the final feature only
        proposer = EagleProposer(load_eagle(tiny_eagle_dir, target), 8, 512)  # EAGLE-3: layer 0 too
        assert tuple(drafter.feature_layers) != tuple(proposer.feature_layers)
        with pytest.raises(ValueError, match="different target layers"):
            LLMEngine(TargetWorker(target, 8, 512, drafter=drafter), proposer, None,
                      EngineConfig(max_batch_size=8, num_speculative_tokens=3), eos_token_ids=[])
    finally:
        target.feature_layers = saved


def test_queued_features_keep_only_the_newest_max_pending():
    """Rounds that send the proposer nothing (plain rounds) must not queue a feature per token forever."""
    from specdec.sampling import SamplingParams
    from specdec.sequence import Sequence
    s = Sequence([1, 2, 3], SamplingParams(max_tokens=8))
    s.MAX_PENDING_FEATURES = 4
    f = torch.arange(12.0).reshape(6, 2)
    s.add_features(0, f[:3])
    s.add_features(3, f[3:])  # positions 0..5 queued: the two oldest go
    start, feats = s.pending_features()
    assert start == 2 and torch.equal(feats, f[2:]) and s.num_pending_features == 4


def test_dropping_sent_features_moves_the_queue_start():
    """Features sent to the proposer leave the queue with their positions: the next ones keep theirs."""
    from specdec.sampling import SamplingParams
    from specdec.sequence import Sequence
    s = Sequence([1, 2, 3], SamplingParams(max_tokens=8))
    f = torch.arange(12.0).reshape(6, 2)
    s.add_features(0, f[:5])
    s.drop_features(3)  # positions 0..2 went to the proposer
    start, feats = s.pending_features()
    assert start == 3 and torch.equal(feats, f[3:5])
    s.drop_features(2)  # the rest went too
    assert s.pending_features() is None and s.num_pending_features == 0
    s.add_features(5, f[5:])  # the next round's features continue the queue
    start, feats = s.pending_features()
    assert start == 5 and torch.equal(feats, f[5:])
