"""The speculative loop end to end in process: greedy identity, join/leave, stops, seeds, k=0."""
import pytest
import torch

from specdec.engine import EngineConfig, LLMEngine
from specdec.loader import ModelLoadError, check_same_vocab, load_model, load_tokenizer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer, ngram_lookup
from specdec.sampling import SamplingParams
from specdec.target_worker import TargetWorker

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add", "import json\nimport os\nimport", "class Foo:\n    x = 1\n"]


@pytest.fixture(scope="module")
def tiny(tiny_dir, tiny_draft_dir, tiny_tok):
    return load_model(tiny_dir), load_model(tiny_draft_dir), tiny_tok


def make_engine(target, proposer_kind, draft=None, tok=None, k=4, adaptive=False, batch=8, speculate=True,
                plain_steps=1, max_prefill_tokens=256):
    tw = TargetWorker(target, num_slots=batch, max_model_len=512)
    prop = {"none": None, "ngram": lambda: NgramProposer(),
            "draft": lambda: DraftModelProposer(draft, num_slots=batch, max_model_len=512)}[proposer_kind]
    return LLMEngine(tw, prop() if prop else None, tok,
                     EngineConfig(max_batch_size=batch, num_speculative_tokens=k, adaptive=adaptive,
                                  speculate=speculate, plain_steps=plain_steps,
                                  max_prefill_tokens=max_prefill_tokens))


def greedy(n=32, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def outputs(engine, prompts, params):
    return [s.output_ids for s in engine.generate(prompts, params)]


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    assert ngram_lookup([1, 2, 3, 4], 3) == []
    assert ngram_lookup([1, 2, 5, 1, 2, 6, 1, 2], 1) == [6]  # the most recent of two matches
    assert ngram_lookup([4, 7, 9, 4], 2) == [7, 9]  # down to a 1-gram (min_n) when nothing longer matches
    assert ngram_lookup([4, 7, 9, 4], 2, min_n=2) == []


def test_a_one_token_ngram_match_spares_the_hybrid_a_draft_forward():
    """k = 1 (or a match at the end of the context): the n-gram's single token is the draft, free,
    and the draft model is not asked for that row."""
    from specdec.metadata import DraftOutput, SpecBatch
    from specdec.proposers.base import Proposer
    from specdec.proposers.hybrid import HybridProposer

    class Model(Proposer):
        asked: list = []

        def propose(self, b):
            self.asked.append(list(b.num_draft))
            return DraftOutput(torch.full((len(b), max(b.num_draft, default=0)), 99), list(b.num_draft))
    h = HybridProposer(NgramProposer(min_n=3, max_n=5), Model())
    ctx = [1, 2, 3, 4, 1, 2, 3]  # suffix [1, 2, 3] matches: the n-gram drafts [4]
    out = h.propose(SpecBatch([1], [0], [ctx], [1], torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1),
                              torch.zeros(1, 3, 2, dtype=torch.float64)))
    assert out.tokens.tolist() == [[4]] and h.ngram_rows == 1 and h.model_rows == 0 and Model.asked == [[0]]
    assert ngram_lookup([5, 1, 7, 5, 1], 3, max_n=2) == [7, 5, 1]


@pytest.mark.parametrize("kind", ["ngram", "draft"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identity_tiny(tiny, kind, k):
    target, draft, tok = tiny
    prompts = [tok(p).input_ids for p in PROMPTS]
    ref = outputs(make_engine(target, "none", tok=tok), prompts, greedy())
    batched = outputs(make_engine(target, kind, draft, tok, k=k), prompts, greedy())
    single = [outputs(make_engine(target, kind, draft, tok, k=k, batch=1), [p], greedy())[0] for p in prompts]
    assert batched == ref
    assert single == ref


@pytest.mark.parametrize("kind,dtype", [("ngram", "float32"), ("draft", "float32"), ("draft", "bfloat16")])
def test_greedy_identity_with_prompts_prefilled_in_chunks(tiny, tiny_dir, kind, dtype, monkeypatch):
    """Prompts longer than the prefill chunk (cut at 24 here; one prompt long enough for several
    chunks, the first ones attending with SDPA, drafts riding on the last one): speculative output
    still equals plain decoding's, in bf16 too (where attention kernels round differently)."""
    from specdec import runner
    monkeypatch.setattr(runner, "PREFILL_CHUNK", 24)
    target, draft, tok = tiny
    if dtype == "bfloat16":
        target = load_model(tiny_dir, dtype=torch.bfloat16)
    prompts = [tok(p * 5).input_ids for p in PROMPTS]
    assert max(map(len, prompts)) > 3 * 24
    ref = outputs(make_engine(target, "none", tok=tok), prompts, greedy())
    assert outputs(make_engine(target, kind, draft, tok, k=3), prompts, greedy()) == ref


@pytest.mark.parametrize("kind", ["none", "draft"])
def test_a_long_prompt_enters_over_rounds_while_the_other_rows_decode(tiny, kind, monkeypatch):
    """Chunked prefill across rounds: a prompt longer than max_prefill_tokens reaches the target in
    parts cut at multiples of the prefill chunk, emitting nothing until its last part, while a
    short prompt beside it decodes; the outputs are those of whole-prompt prefills."""
    from specdec import runner
    monkeypatch.setattr(runner, "PREFILL_CHUNK", 8)
    target, draft, tok = tiny
    prompts = [tok(PROMPTS[0] * 6).input_ids, tok(PROMPTS[1]).input_ids]
    assert len(prompts[0]) > 100
    whole = outputs(make_engine(target, "none", tok=tok, max_prefill_tokens=0), prompts, greedy())
    engine = make_engine(target, kind, draft, tok, k=3, max_prefill_tokens=20)
    calls, verify = [], engine.target.verify

    def spy(batch, draft_out):  # (the long prompt is row 0 while it enters)
        out = verify(batch, draft_out)
        calls.append((batch.offsets[0], len(batch.new_tokens[0]), bool(batch.partial and batch.partial[0]),
                      out.tokens[0], out.tokens[1] if len(batch) > 1 else [], draft_out.num_draft[0]))
        return out
    engine.target.verify = spy
    assert outputs(engine, prompts, greedy()) == whole
    parts = [c for c in calls if c[2]]
    assert len(parts) >= 6 and [c[0] + c[1] for c in parts] == [16 * (j + 1) for j in range(len(parts))]
    assert all(c[3] == [] and c[5] == 0 for c in parts)  # a part of a prompt emits nothing, and has no drafts
    assert all(c[4] for c in parts)  # the short row emitted in every one of those rounds


def test_seeded_sampling_is_the_same_with_prompts_entering_over_rounds(tiny, monkeypatch):
    from specdec import runner
    monkeypatch.setattr(runner, "PREFILL_CHUNK", 8)
    target, draft, tok = tiny
    prompts = [tok(PROMPTS[2] * 8).input_ids]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    whole = outputs(make_engine(target, "none", tok=tok, max_prefill_tokens=0), prompts, params)
    assert outputs(make_engine(target, "draft", draft, tok, k=3, max_prefill_tokens=20), prompts, params) == whole


def test_self_draft_accepts_everything(tiny):
    target, _, tok = tiny
    eng = make_engine(target, "draft", load_model(target.source), tok, k=4)
    prompts = [tok(p).input_ids for p in PROMPTS]
    ref = outputs(make_engine(target, "none", tok=tok), prompts, greedy())
    assert outputs(eng, prompts, greedy()) == ref
    assert eng.stats.acceptance_rate == 1.0
    assert eng.stats.mean_accepted_length > 4.0  # 5 per round except where max_tokens truncates


def test_join_and_leave_mid_flight(tiny):
    """Sequences of different lengths join while others run (batch 2 < 5 requests)."""
    target, draft, tok = tiny
    prompts = [tok(p).input_ids for p in PROMPTS + ["x = [1, 2, 3]\n", "for i in range(10):\n"]]
    params = [greedy(n) for n in (5, 40, 12, 3, 25)]
    ref = [outputs(make_engine(target, "none", tok=tok), [p], sp)[0] for p, sp in zip(prompts, params)]
    eng = make_engine(target, "draft", draft, tok, k=3, batch=2)
    assert outputs(eng, prompts, params) == ref
    assert eng.target.table.num_free == 2 and eng.proposer.table.num_free == 2  # slots freed


def test_k0_is_plain_decoding(tiny):
    target, draft, tok = tiny
    p = [tok(PROMPTS[0]).input_ids]
    eng = make_engine(target, "draft", draft, tok, k=4)
    out = outputs(eng, p, greedy(num_speculative_tokens=0))
    assert eng.stats.proposed == 0 and eng.stats.rounds == 32
    assert out == outputs(make_engine(target, "none", tok=tok), p, greedy())


@pytest.mark.parametrize("n", [2, 5])
def test_multi_step_plain_rounds_emit_what_single_steps_emit(tiny, n):
    """plain_steps=n: a round without drafts decodes n tokens per row in one target call. Greedy
    and seeded sampled outputs equal one-step rounds' token for token (uniforms keyed by position),
    rows stop at their own EOS / stop id / max_tokens inside a call, and the calls are fewer."""
    target, _, tok = tiny
    prompts = [tok(p).input_ids for p in PROMPTS]
    params = [greedy(17), SamplingParams(max_tokens=23, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=3, ignore_eos=True)]
    one = make_engine(target, "none", tok=tok, batch=3)
    ref = [s.output_ids for s in one.generate(prompts, params)]
    multi = make_engine(target, "none", tok=tok, batch=3, plain_steps=n)
    seqs = multi.generate(prompts, params)
    assert [s.output_ids for s in seqs] == ref
    assert [s.num_output for s in seqs] == [17, 23, 20] and all(s.finish_reason == "length" for s in seqs)
    assert multi.stats.rounds < one.stats.rounds  # fewer target calls ...
    assert multi.stats.mean_accepted_length == 1.0  # ... each token still counted as a plain round's
    stop = ref[0][9]  # a stop id inside a call: the output ends right there, nothing after it
    seq = make_engine(target, "none", tok=tok, plain_steps=n).generate(prompts[:1], greedy(17, stop_token_ids=[stop]))[0]
    assert seq.output_ids == ref[0][: ref[0].index(stop) + 1] and seq.finish_reason == "stop"


def test_multi_step_round_stops_a_row_at_its_stop_token_inside_the_call(tiny):
    """The target ends a row's steps at a token of its stop ids (no decoding past EOS)."""
    target, _, tok = tiny
    p = [tok(PROMPTS[1]).input_ids]
    ref = outputs(make_engine(target, "none", tok=tok), p, greedy(12))[0]
    stop = ref[4]
    eng = make_engine(target, "none", tok=tok, plain_steps=8)
    calls = []
    verify = eng.target.verify
    eng.target.verify = lambda b, d: calls.append(verify(b, d)) or calls[-1]
    seq = eng.generate(p, greedy(12, stop_token_ids=[stop]))[0]
    assert seq.output_ids == ref[: ref.index(stop) + 1] and seq.finish_reason == "stop"
    first = ref.index(stop)
    assert first > 0  # the prompt's fixture output: the stop comes after the prefill's token
    assert [c.steps for c in calls] == [1, first]  # prefill, then steps up to the stop (of 8)
    assert sum(len(c.tokens[0]) for c in calls) == seq.num_output


@pytest.mark.parametrize("stop_at", [3, 6])  # (the prefill emits token 0, the next round 1-6)
def test_stop_token_inside_accepted_run(tiny, stop_at):
    """A stop token id in the middle of a fully accepted run ends the output right there."""
    target, _, tok = tiny
    p = [tok(PROMPTS[1]).input_ids]
    ref = outputs(make_engine(target, "none", tok=tok), p, greedy(20))[0]
    eng = make_engine(target, "draft", load_model(target.source), tok, k=5)  # self-draft: all accepted
    seq = eng.generate(p, greedy(20, stop_token_ids=[ref[stop_at]]))[0]
    first = ref.index(ref[stop_at])
    assert seq.output_ids == ref[: first + 1] and seq.finish_reason == "stop"
    # usage's accepted drafts are among the returned tokens (those after the stop are dropped)
    assert seq.accepted <= seq.num_output and seq.accepted <= seq.proposed


def test_stop_string_and_max_tokens(tiny):
    target, _, tok = tiny
    p = [tok(PROMPTS[2]).input_ids]
    ref_seq = make_engine(target, "none", tok=tok).generate(p, greedy(24))[0]
    text = ref_seq.text
    stop = text[5:8]
    eng = make_engine(target, "draft", load_model(target.source), tok, k=5)
    seq = eng.generate(p, greedy(24, stop=[stop]))[0]
    assert seq.finish_reason == "stop"
    assert seq.text == text[: text.index(stop)]
    assert stop not in seq.text
    seq = make_engine(target, "ngram", tok=tok, k=5).generate(p, greedy(7))[0]
    assert seq.num_output == 7 and seq.finish_reason == "length"


def test_streamed_deltas_reassemble_text(tiny):
    target, draft, tok = tiny
    eng = make_engine(target, "draft", draft, tok, k=3)
    s = eng.add_request(tok(PROMPTS[0]).input_ids, greedy(30, stop=["zzz"]))
    pieces = []
    while eng.scheduler.has_work:
        eng.step()
        pieces.append(s.take_delta())
    assert "".join(pieces) == s.text


def test_seeded_sampling_is_reproducible(tiny):
    target, draft, tok = tiny
    prompts = [tok(p).input_ids for p in PROMPTS]
    sp = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    a = outputs(make_engine(target, "draft", draft, tok, k=3), prompts, sp)
    b = outputs(make_engine(target, "draft", draft, tok, k=3, batch=1), prompts, sp)  # other batching
    assert a == b
    c = outputs(make_engine(target, "draft", draft, tok, k=3), prompts,
                [SamplingParams(max_tokens=20, temperature=0.9, seed=s + 10, ignore_eos=True) for s in (1, 2, 3)])
    assert a != c


def test_adaptive_turns_speculation_off_for_a_useless_draft(tiny):
    """A random draft never agrees: the adaptive policy stops proposing and probes rarely."""
    target, draft, tok = tiny
    eng = make_engine(target, "draft", draft, tok, k=4, adaptive=True)
    outputs(eng, [tok(PROMPTS[0]).input_ids], greedy(64))
    spec_fraction = eng.stats.spec_row_rounds / eng.stats.row_rounds
    assert spec_fraction < 0.4


def test_draft_vocab_mismatch_fails_at_load(tiny_tok, tmp_path):
    from tiny_models import make_tiny_checkpoint
    other = load_tokenizer(make_tiny_checkpoint(tmp_path / "other", vocab_size=300))
    with pytest.raises(ModelLoadError, match="vocabulary differs"):
        check_same_vocab(tiny_tok, other)


@pytest.mark.parametrize("kind", ["none", "draft"])
def test_context_limit_is_the_target_cache(tiny, kind):
    """EngineConfig.max_model_len (2048 by default) larger than the target's cache (64): a too-long
    prompt is refused at admission, and a sequence reaching the cache size finishes with `length`
    while the sequence batched with it is unharmed."""
    target, draft, tok = tiny
    tw = TargetWorker(target, num_slots=2, max_model_len=64)
    prop = DraftModelProposer(draft, num_slots=2, max_model_len=64) if kind == "draft" else None
    eng = LLMEngine(tw, prop, tok, EngineConfig(max_batch_size=2, num_speculative_tokens=3, adaptive=False))
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request(list(range(3, 67)), greedy(4))
    short = tok(PROMPTS[1]).input_ids
    ref = outputs(make_engine(target, "none", tok=tok), [short], greedy(8))[0]
    long_seq, healthy = eng.generate([list(range(3, 53)), short], [greedy(100), greedy(8)])
    assert long_seq.finish_reason == "length" and len(long_seq.tokens) == 64
    assert healthy.output_ids == ref and healthy.finish_reason == "length"


def test_request_usage_counts_proposer_drafts_and_target_forwards(tiny):
    """Tokens prompt lookup finds in multi-step plain rounds are not proposer drafts (SpecStats
    counts them as lookups): a request's accepted drafts stay within its proposed ones, and its
    rounds are the target forwards that made its tokens."""
    target, _, tok = tiny
    prompt = ([17, 250, 9, 41] * 8)[:24]  # repeats itself: lookups find tokens
    eng = LLMEngine(TargetWorker(target, num_slots=1, max_model_len=128), NgramProposer(), tok,
                    EngineConfig(max_batch_size=1, num_speculative_tokens=0, adaptive=False, plain_steps=8,
                                 lookup_k=3, lookup_max_batch=4))
    forwards = []
    verify = eng.target.verify
    eng.target.verify = lambda b, d: _count(forwards, verify(b, d))
    seq = eng.generate([prompt], greedy(40))[0]
    assert eng.stats.lookup_accepted > 0  # lookups did find tokens
    assert seq.proposed == 0 and seq.accepted == 0
    assert seq.rounds == sum(forwards)


def _count(forwards: list, out):
    forwards.append(out.steps)
    return out


def test_float32_greedy_identity_holds_at_a_near_tie(tiny_dir, tiny_draft_dir, tiny_tok):
    """The tiny target's greedy answer to "def add(a, b):" reaches a top-2 gap of 1.2e-6 at step
    286: with SDPA in float32 (a 1-position step and a k+1-position verify round ~1e-6 apart)
    speculation flipped it (k 1 and 3). The position-invariant path, now also float32's on CPU,
    gives each position the same bits in both, so the outputs are plain decoding's."""
    from specdec.prompts import encode_text
    ids = encode_text(tiny_tok, "def add(a, b):")
    outs = []
    for k in (0, 1, 3):
        eng = LLMEngine(TargetWorker(load_model(tiny_dir), 1, 512), DraftModelProposer(load_model(tiny_draft_dir), 1, 512),
                        tiny_tok, EngineConfig(max_batch_size=1, num_speculative_tokens=k, adaptive=False),
                        eos_token_ids=[])
        assert eng.target.model.position_invariant
        outs.append(eng.generate([ids], SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))[0].output_ids)
    assert outs[1] == outs[0] and outs[2] == outs[0]


def test_ngram_history_of_a_sequence_never_released_is_forgotten_when_idle():
    """A crashed router's sequences (or a lost release's) are never released: the n-gram proposer
    (the hybrid's too) forgets a sequence no proposal touched for IDLE_EVICT_S; one that returns
    after that comes back unknown (its context is resent)."""
    from specdec.metadata import SpecBatch
    from specdec.proposers import ngram

    now = [0.0]
    p = NgramProposer(clock=lambda: now[0])

    def batch(sid, offset, new):
        return SpecBatch([sid], [offset], [new], [2], torch.zeros(1), torch.zeros(1, dtype=torch.long),
                         torch.ones(1), torch.zeros(1, 3, 3, dtype=torch.float64))
    p.propose(batch(1, 0, [1, 2, 3, 1, 2]))
    p.propose(batch(2, 0, [4, 5, 6]))
    for _ in range(4):
        now[0] += 0.4 * ngram.IDLE_EVICT_S
        assert not p.propose(batch(2, 3, [])).unknown  # seq 2 stays in use
    assert set(p.history) == {2}
    assert p.propose(batch(1, 5, [3])).unknown == [0]  # seq 1, forgotten: its context must come again


def test_spec_stats_count_by_position_and_merge_like_one_object():
    """The benchmarks and the held-out evaluation add up per-prompt statistics with `merge`: the sum
    equals one object that observed everything (every counter, positions of unequal lengths)."""
    import dataclasses
    import random

    from specdec.stats import SpecStats
    one = SpecStats()
    one.observe_row(3, 1, 2)
    assert (one.proposed_per_pos, one.accepted_per_pos) == ([1, 1, 1], [1, 0, 0])
    one.observe_round(4, 0.5, 1.0, 2.0)
    one.observe_round(2, 0.5, 1.0, 2.0)
    assert one.mean_batch_size == 3.0 and one.per_position_acceptance == [1.0, 0.0, 0.0]
    rng = random.Random(0)
    parts, whole = [SpecStats(), SpecStats()], SpecStats()
    numeric = [f.name for f in dataclasses.fields(SpecStats) if f.type in ("int", "float")]
    for i in range(200):
        part = parts[i % 2] if i < 150 else parts[0]
        k = rng.randint(0, 5 if i % 2 else 2)
        a, b = rng.randint(0, k), rng.randint(1, 8)
        for s in (part, whole):
            s.observe_row(k, a, a + 1)
            s.observe_round(b, 0.25, 0.5, 1.0)
        for name in numeric:  # (and the counters the engine adds to directly)
            v = rng.randint(0, 3)
            for s in (part, whole):
                setattr(s, name, getattr(s, name) + v)
    total = SpecStats()
    for p in parts:
        total.merge(p)
    assert total == whole


def test_ignore_eos_runs_past_eos_but_stop_ids_still_stop():
    from specdec.sequence import FINISH_LENGTH, FINISH_STOP, Sequence
    s = Sequence([5, 6], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), eos_token_ids=frozenset({0}))
    assert s.append([0, 7, 0], None) == 3 and not s.finished
    assert s.append([0, 9], None) == 1 and s.finish_reason == FINISH_LENGTH
    s = Sequence([5], SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=[7]), eos_token_ids=frozenset({0}))
    assert s.append([0, 7, 8], None) == 2 and s.finish_reason == FINISH_STOP
    s = Sequence([5], SamplingParams(max_tokens=4), eos_token_ids=frozenset({0}))
    assert s.append([3, 0, 8], None) == 2 and s.finish_reason == FINISH_STOP


def test_a_draft_whose_vocabulary_maps_other_ids_is_refused_even_at_the_same_size():
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)
    check_same_vocab(Tok({"a": 0, "b": 1}), Tok({"a": 0, "b": 1}))
    with pytest.raises(ModelLoadError, match="vocabulary differs"):
        check_same_vocab(Tok({"a": 0, "b": 1}), Tok({"a": 1, "b": 0}))


def test_aborting_a_running_request_frees_its_slots_at_once(tiny):
    """`LLMEngine.abort` frees the row's target and draft slots at once (not at idle eviction), and
    the other row's output stays plain decoding's."""
    target, draft, tok = tiny
    prompts = [tok(p).input_ids for p in PROMPTS]
    ref = outputs(make_engine(target, "none", batch=2), prompts[1:2], greedy(16))
    eng = make_engine(target, "draft", draft, batch=2)
    gone, kept = eng.add_request(prompts[0], greedy(16)), eng.add_request(prompts[1], greedy(16))
    eng.step()
    eng.step()
    assert gone.seq_id in eng.target.table and gone.seq_id in eng.proposer.table
    eng.abort(gone.seq_id)
    assert gone.finish_reason == "abort"
    assert gone.seq_id not in eng.target.table and gone.seq_id not in eng.proposer.table
    while eng.scheduler.has_work:
        eng.step()
    assert kept.output_ids == ref[0]
    assert len(eng.target.table) == 0 and len(eng.proposer.table) == 0
