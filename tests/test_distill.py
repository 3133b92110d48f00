"""`specdec-distill` end to end on a tiny random target: export loadable by transformers and by
specdec.loader, acceptance that rises with training, a lossless reduced head, resume."""
import json

import pytest
import torch

from specdec.engine import EngineConfig, LLMEngine
from specdec.loader import load_model, load_tokenizer
from specdec.proposers import build_proposer
from specdec.sampling import SamplingParams
from specdec.target_worker import TargetWorker
from specdec_tools.distill import main

VOCAB = 128  # reduced head of the tiny draft (the tiny tokenizer has 512 tokens)
COMMON = ["--layers", "1", "--init-from-target", "--draft-vocab", str(VOCAB), "--batch-tokens", "1024",
          "--seq-len", "128", "--corpus-limit", "200", "--vocab-tokens", "4096", "--gen-tokens", "32",
          "--eval-prompts", "8", "--eval-tokens", "32", "--eval-dtype", "float32", "--save-dtype", "float32",
          "--threads", "1"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread_here(one_thread):
    yield


def distill(target, out, *extra):
    return main(["--target", str(target), "--out", str(out), *COMMON, *extra])


@pytest.fixture(scope="module")
def drafts(tiny_dir, tmp_path_factory, one_thread):
    """(untrained, trained) drafts: the same init and vocabulary, 0 and 80 steps."""
    root = tmp_path_factory.mktemp("distill")
    untrained = distill(tiny_dir, root / "d0", "--steps", "0")
    trained = distill(tiny_dir, root / "d1", "--steps", "80", "--lr", "3e-3")
    return (root / "d0", untrained), (root / "d1", trained)


def test_acceptance_rises_with_training(drafts):
    (_, m0), (_, m1) = drafts
    assert m1["train"]["steps"] == 80 and m1["train"]["seq_level_rows"] > 0
    assert m1["greedy_acceptance"] > m0["greedy_acceptance"] + 0.05, (m0["greedy_acceptance"], m1["greedy_acceptance"])
    for cat in ("chat", "code", "all"):
        assert set(m1["acceptance"][cat]) == {"1", "2", "3", "4"}
    assert 0 < m1["cost_ratio"] < 2


def test_both_loaders_and_reduced_head(drafts, tiny_dir):
    from transformers import AutoModelForCausalLM
    d, _ = drafts[1]
    extra = json.loads((d / "specdec.json").read_text())
    kept = extra["draft_vocab"]
    assert len(kept) == VOCAB and extra["target"] == str(tiny_dir) and "specdec-distill" in extra["command"]
    tok = load_tokenizer(tiny_dir)
    assert tok.eos_token_id in kept and tok.convert_tokens_to_ids("<|im_end|>") in kept
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    compact = load_model(d)  # head sliced to the kept rows
    assert compact.lm_head.weight.shape == (VOCAB, hf.config.hidden_size)
    ids = torch.tensor([tok("def f(x):\n    return x").input_ids])
    with torch.no_grad():
        ref = hf(ids).logits[0, -1, kept]  # [VOCAB]
    compact.setup_cache(1, 64)
    got, _ = compact(ids, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    torch.testing.assert_close(got[0, -1], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 3])
def test_reduced_vocab_draft_is_lossless(drafts, tiny_dir, k):
    d, _ = drafts[1]
    tok = load_tokenizer(tiny_dir)
    target = load_model(tiny_dir, dtype=torch.float32)
    prompts = [tok(p).input_ids for p in ["import os\nimport", "class A:\n    def __init__(self", "x = [1, 2"]]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    def run(proposer, k):
        eng = LLMEngine(TargetWorker(target, 4, 256), proposer, tok,
                        EngineConfig(max_batch_size=4, max_model_len=256, num_speculative_tokens=k, adaptive=False))
        return [s.output_ids for s in eng.generate(prompts, params)], eng.stats

    ref, _ = run(None, 0)
    proposer = build_proposer("draft", draft=str(d), dtype=torch.float32, num_slots=4, max_model_len=256)
    assert proposer.token_map is not None and len(proposer.token_map) == VOCAB
    out, stats = run(proposer, k)
    assert out == ref
    assert stats.proposed > 0


def test_resume_continues_from_saved_step(tiny_dir, tmp_path):
    out = tmp_path / "r"
    first = distill(tiny_dir, out, "--steps", "3", "--eval-prompts", "0", "--mix", "0.5")
    ck = torch.load(out / "ckpt.pt", weights_only=False)
    assert ck["step"] == 3 and ck["stream"]["code"]["offset"] + ck["stream"]["code"]["piece"] > 0
    generated = (out / "seqgen.jsonl").read_text().count("\n")
    assert generated > 0
    second = distill(tiny_dir, out, "--steps", "6", "--eval-prompts", "0", "--mix", "0.5", "--resume")
    ck2 = torch.load(out / "ckpt.pt", weights_only=False)
    assert first["train"]["steps"] == 3 and second["train"]["steps"] == 6 and ck2["step"] == 6
    assert second["train"]["rows"] == 2 * first["train"]["rows"]  # counters carried over, not restarted
    assert ck2["stream"] != ck["stream"]  # the text cursor moved on
    assert (out / "seqgen.jsonl").read_text().count("\n") >= generated  # cached answers kept


EAGLE = ["--arch", "eagle", "--draft-vocab", str(VOCAB), "--batch-tokens", "1024", "--seq-len", "128",
         "--corpus-limit", "200", "--answers", "16", "--gen-batch", "8", "--gen-tokens", "32",
         "--text-tokens", "16384", "--eval-prompts", "8", "--eval-tokens", "32", "--eval-dtype", "float32",
         "--save-dtype", "float32", "--threads", "1", "--dtype-teacher", "float32"]


def test_eagle_distill_end_to_end(tiny_dir, tmp_path, one_thread):
    """--arch eagle: answers + features + training + export; acceptance rises, and the draft stays
    lossless through the loader and the proposer factory; a resumed run continues its schedule."""
    m0 = main(["--target", str(tiny_dir), "--out", str(tmp_path / "e0"), *EAGLE, "--steps", "0"])
    m1 = main(["--target", str(tiny_dir), "--out", str(tmp_path / "e1"), *EAGLE, "--steps", "150", "--lr", "1e-2"])
    assert m1["train"]["steps"] == 150 and m1["data"]["answers"] == 16
    # a random tiny target is hard to predict from its features (~0.07 after 150 steps vs ~0.01)
    a0, a1 = m0["greedy_acceptance"], m1["greedy_acceptance"]
    assert a1 > max(2 * a0, a0 + 0.03), (a0, a1)
    assert (tmp_path / "e1.work" / "features.pt").is_file() and not (tmp_path / "e1" / "ckpt.pt").exists()
    target = load_model(tiny_dir)
    prop = build_proposer("draft", draft=str(tmp_path / "e1"), target=str(tiny_dir), num_slots=4,
                          max_model_len=256, target_model=target)
    tok = load_tokenizer(tmp_path / "e1")
    prompts = [tok(p).input_ids for p in ["def f(x):\n    return", "import os\nimport"]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(proposer):
        eng = LLMEngine(TargetWorker(target, 4, 256), proposer, tok,
                        EngineConfig(max_batch_size=4, num_speculative_tokens=3, adaptive=False))
        return [s.output_ids for s in eng.generate(prompts, params)], eng.stats

    ref, _ = run(None)
    out, stats = run(prop)
    assert out == ref and stats.accepted > 0
    m2 = main(["--target", str(tiny_dir), "--out", str(tmp_path / "e1"), *EAGLE, "--steps", "170", "--lr", "1e-2",
               "--resume", "--eval-prompts", "0"])
    assert m2["train"]["steps"] == 170
    # --init-draft: fine-tuning starts from a trained draft's fc and layer (0 steps: its acceptance, not a fresh init's)
    m3 = main(["--target", str(tiny_dir), "--out", str(tmp_path / "e3"), *EAGLE, "--steps", "0",
               "--work", str(tmp_path / "e1.work"), "--init-draft", str(tmp_path / "e1")])
    a3 = m3["greedy_acceptance"]
    assert a3 > max(2 * a0, a0 + 0.03) and abs(a3 - a1) < 0.02, (a0, a1, a3)
