"""The engine's CUDA path (skipped on machines without a GPU): sampled draft rows keep every
per-round tensor on the model's device, and greedy output equals plain decoding."""
import pytest
import torch

from specdec.engine import EngineConfig, LLMEngine
from specdec.loader import load_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.sampling import SamplingParams
from specdec.target_worker import TargetWorker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(target, draft, k=3):
    prop = DraftModelProposer(draft, 4, 256, top_j=8) if draft is not None else None
    return LLMEngine(TargetWorker(target, 4, 256), prop, None,
                     EngineConfig(max_batch_size=4, max_model_len=256, num_speculative_tokens=k, adaptive=False),
                     eos_token_ids=[])


def test_cuda_draft_model_greedy_and_sampled(tiny_dir, tiny_draft_dir):
    target = load_model(tiny_dir, dtype=torch.float32, device="cuda")
    draft = load_model(tiny_draft_dir, dtype=torch.float32, device="cuda")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = [s.output_ids for s in _engine(target, None).generate(prompts, greedy)]
    assert [s.output_ids for s in _engine(target, draft).generate(prompts, greedy)] == ref
    eng = _engine(target, draft)
    sampled = [SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True) for i in range(2)]
    outs = [s.output_ids for s in eng.generate(prompts, sampled)]
    assert all(len(o) == 24 for o in outs) and eng.stats.proposed > 0  # the draft really drafted
    again = [s.output_ids for s in _engine(target, draft).generate(prompts, sampled)]
    assert again == outs  # seeded: reproducible
