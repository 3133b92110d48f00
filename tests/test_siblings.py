"""The smallest draft tree: a sibling of a greedy row's first draft, verified in the same target
forward (specdec.target_worker). Its logits are those of the sibling at the first draft's
position; when the first draft is rejected and the target's token is the sibling, the round
emits two tokens, the ones plain greedy decoding emits; output stays token-identical."""
import pytest
import torch

from specdec.engine import EngineConfig, LLMEngine
from specdec.loader import load_model
from specdec.metadata import DraftOutput, SpecBatch
from specdec.proposers import build_proposer
from specdec.sampling import SamplingParams
from specdec.target_worker import TargetWorker

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add", "import json\nimport os\nimport", "class Foo:\n    x = 1\n",
           "a b c a b c a b", "The weather today is", "Once upon a time"]


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def prompts(tiny_tok):
    return [tiny_tok(p).input_ids for p in PROMPTS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sibling_logits_are_the_first_draft_positions(tiny_dir, dtype):
    """[context..., d1, d2, d3, s] after a cached context: s's logits equal those of one plain
    step feeding s (same position, the chain unseen), and the chain's logits do not change by s's
    presence; in bfloat16 (position-invariant path) bit for bit."""
    target = load_model(tiny_dir, dtype=dtype)
    torch.manual_seed(0)
    V = target.args.vocab_size
    ctx, chain, s = torch.randint(0, V, (7,)).tolist(), torch.randint(0, V, (3,)).tolist(), 5
    target.setup_cache(2, 64)
    n = len(ctx) - 1
    with torch.inference_mode():
        for slot in (0, 1):  # the same context cached in both slots
            target(torch.tensor([ctx[:n]]), torch.tensor([slot]), torch.tensor([0]))
        tree, _ = target(torch.tensor([ctx[n:] + chain + [s]]), torch.tensor([0]), torch.tensor([n]), None, 5,
                         sibling=torch.tensor([[4, 3]]))
        plain, _ = target(torch.tensor([ctx[n:] + chain]), torch.tensor([1]), torch.tensor([n]), None, 4)
        alone, _ = target(torch.tensor([[s]]), torch.tensor([1]), torch.tensor([n + 1]), None, 1)
    tol = {} if dtype == torch.float32 else {"atol": 0.0, "rtol": 0.0}
    torch.testing.assert_close(tree[0, -1], alone[0, -1], **tol)
    torch.testing.assert_close(tree[0, :4], plain[0], **tol)


def _batch(seq_ids, offsets, new_tokens, k):
    B = len(seq_ids)
    return SpecBatch(seq_ids, offsets, new_tokens, [k] * B, torch.zeros(B), torch.zeros(B, dtype=torch.long),
                     torch.ones(B), torch.zeros(B, 3, k + 1, dtype=torch.float64))


def test_an_accepted_sibling_emits_what_plain_greedy_emits(target, prompts):
    """A wrong first draft with the right sibling: two tokens, plain greedy's; the next rounds
    (cache rolled back to before the sibling) continue exactly as plain decoding."""
    plain = TargetWorker(target, 2, 256, return_hidden=True)  # reference: plain greedy, one token per round
    ref = plain.verify(_batch([0], [0], [prompts[0]], 0), DraftOutput.empty(1)).tokens[0]
    feats = []  # feats[j]: the target's feature at the position of ref[j]
    for _ in range(5):
        o = plain.verify(_batch([0], [len(prompts[0]) + len(ref) - 1], [ref[-1:]], 0), DraftOutput.empty(1))
        ref, feats = ref + o.tokens[0], feats + [o.hidden[0][0]]
    w = TargetWorker(target, 2, 256, return_hidden=True)
    first = w.verify(_batch([1], [0], [prompts[0]], 0), DraftOutput.empty(1))
    assert first.tokens[0] == ref[:1]
    wrong = (ref[1] + 1) % target.args.vocab_size
    draft = DraftOutput(torch.tensor([[wrong, 3]]), [2], sibling=torch.tensor([ref[1]]))
    out = w.verify(_batch([1], [len(prompts[0])], [ref[:1]], 2), draft)
    # two tokens, counted as a taken sibling only: the chain's first draft was rejected (no accepted
    # draft beside one proposed, which once reported acceptance above the chain's and misled adaptive k)
    assert out.tokens[0] == ref[1:3] and out.num_accepted[0] == 0 and out.sibling_accepted == 1
    assert len(out.hidden[0]) == 2 and out.hidden_start[0] == len(prompts[0])  # features of ref[0], the sibling
    torch.testing.assert_close(out.hidden[0], torch.stack(feats[:2]), atol=1e-4, rtol=1e-4)
    n = len(prompts[0]) + 3
    nxt = w.verify(_batch([1], [n - 1], [ref[2:3]], 0), DraftOutput.empty(1))
    assert nxt.tokens[0] == ref[3:4]


def _engine(target, proposer, siblings, batch=4):
    return LLMEngine(TargetWorker(target, batch, 512), proposer, None,
                     EngineConfig(max_batch_size=batch, num_speculative_tokens=3, adaptive=False,
                                  siblings_max_batch=siblings), eos_token_ids=[])


@pytest.mark.parametrize("proposer", ["self", "hybrid"])
def test_greedy_output_is_identical_with_siblings(target, prompts, tiny_dir, tiny_draft_dir, proposer):
    """Greedy output with siblings equals plain decoding, at batch 1 and 4; with the self-draft
    (the target's first layer: often second-best right) siblings get accepted. The hybrid's
    random draft model rarely ranks the target's token second: identity only."""
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ref = [s.output_ids for s in _engine(target, None, 0).generate(prompts, greedy)]
    taken = 0
    for batch in (1, 4):
        prop = build_proposer(proposer, draft=str(tiny_draft_dir) if proposer == "hybrid" else None,
                              target=str(tiny_dir), target_model=target, num_slots=batch, max_model_len=512,
                              self_draft_layers=1)
        eng = _engine(target, prop, siblings=batch, batch=batch)
        assert [s.output_ids for s in eng.generate(prompts, greedy)] == ref
        taken += eng.stats.sibling_accepted
    assert taken > 0 or proposer == "hybrid"


def test_sampled_rows_get_no_sibling(target, prompts, tiny_dir):
    """A sampled row's chain is verified with its own q: the proposer sends it no sibling."""
    prop = build_proposer("self", target=str(tiny_dir), target_model=target, num_slots=4, max_model_len=512,
                          self_draft_layers=1)
    batch = _batch([0, 1], [0, 0], prompts[:2], 2)
    batch.temperature = torch.tensor([0.0, 1.0])
    batch.siblings = True
    out = prop.propose(batch)
    assert out.sibling is not None and int(out.sibling[0]) >= 0 and int(out.sibling[1]) == -1
