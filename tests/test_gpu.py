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


def test_cuda_eagle_distill_then_resume_on_the_cpu(tiny_dir, tmp_path):
    """specdec-distill --arch eagle --device cuda (with EAGLE-3 fusion): answers, features, training
    and evaluation on the GPU; the exported draft is lossless on the CPU engine, and its checkpoint
    resumes on the CPU."""
    from specdec.eagle_draft import load_eagle
    from specdec.proposers.eagle import EagleProposer
    from specdec_tools.distill import main

    run = ["--arch", "eagle", "--target", str(tiny_dir), "--out", str(tmp_path / "d"), "--work", str(tmp_path / "w"),
           "--draft-vocab", "128", "--batch-tokens", "1024", "--seq-len", "128", "--corpus-limit", "60",
           "--answers", "8", "--gen-batch", "8", "--gen-tokens", "16", "--text-tokens", "2048", "--eval-prompts", "4",
           "--eval-tokens", "16", "--eval-dtype", "float32", "--save-dtype", "float32", "--dtype-teacher", "float32",
           "--save-minutes", "0", "--resume", "--feature-layers", "0"]
    m = main([*run, "--steps", "3", "--device", "cuda"])
    assert m["train"]["steps"] == 3 and m["eval_device"].startswith("cuda") and m["greedy_acceptance"] is not None
    assert "greedy, CUDA" in (tmp_path / "d" / "README.md").read_text()
    target = load_model(tiny_dir)
    draft = load_eagle(tmp_path / "d", target)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def engine(prop):
        return LLMEngine(TargetWorker(target, 4, 256), prop, None,
                         EngineConfig(max_batch_size=4, max_model_len=256, num_speculative_tokens=3, adaptive=False),
                         eos_token_ids=[])

    ref = [s.output_ids for s in engine(None).generate(prompts, greedy)]
    assert [s.output_ids for s in engine(EagleProposer(draft, 4, 256)).generate(prompts, greedy)] == ref
    resumed = main([*run, "--steps", "5", "--device", "cpu", "--eval-prompts", "0"])
    assert resumed["train"]["steps"] == 5
