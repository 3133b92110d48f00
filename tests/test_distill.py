"""`specdec-distill` end to end on a tiny random target: export loadable by transformers and by
specdec.loader, acceptance that rises with training, a lossless reduced head, resume."""
import json
import re

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


class _Interrupt(BaseException):
    """Stands for the process dying mid-training (not an Exception: nothing may catch it)."""


def test_eagle_resume_matches_an_uninterrupted_run(tiny_dir, tmp_path, monkeypatch, one_thread):
    """--arch eagle killed after step 4 (a checkpoint every step, mid-epoch) and resumed ends with
    the parameters of the run that was never interrupted (the epoch's remaining batches, the same
    input noise), and the resumed run still reports the draft vocabulary's coverage."""
    from specdec_tools.distill import eagle_train
    work = tmp_path / "work"
    run = ["--arch", "eagle", "--target", str(tiny_dir), "--draft-vocab", str(VOCAB), "--batch-tokens", "1024",
           "--seq-len", "128", "--corpus-limit", "60", "--answers", "8", "--gen-batch", "8", "--gen-tokens", "16",
           "--text-tokens", "4096", "--eval-prompts", "0", "--save-dtype", "float32", "--threads", "1",
           "--dtype-teacher", "float32", "--steps", "9", "--save-minutes", "0", "--noise", "0.1",
           "--work", str(work)]
    full = main([*run, "--out", str(tmp_path / "full")])
    want = torch.load(work / "ckpt.pt", weights_only=False)
    (work / "ckpt.pt").unlink()
    step = eagle_train.EagleTrainer.train_step

    def dying(self, rows):
        if self.step == 4:
            raise _Interrupt()
        return step(self, rows)

    monkeypatch.setattr(eagle_train.EagleTrainer, "train_step", dying)
    with pytest.raises(_Interrupt):
        main([*run, "--out", str(tmp_path / "resumed")])
    monkeypatch.setattr(eagle_train.EagleTrainer, "train_step", step)
    assert torch.load(work / "ckpt.pt", weights_only=False)["step"] == 4
    resumed = main([*run, "--out", str(tmp_path / "resumed"), "--resume"])
    got = torch.load(work / "ckpt.pt", weights_only=False)
    assert want["model"].keys() == got["model"].keys()
    for k in want["model"]:
        assert torch.equal(want["model"][k], got["model"][k]), k
    assert want["epoch"] >= 1 and [got.get(k) for k in ("step", "epoch", "epoch_pos", "tokens_seen")] == \
        [want.get(k) for k in ("step", "epoch", "epoch_pos", "tokens_seen")]
    assert resumed["vocab"] == full["vocab"] and full["vocab"]["coverage"] > 0
    # the running average of the step metrics resumes too: the summary is the uninterrupted run's
    assert resumed["train"] == {**full["train"], "minutes": resumed["train"]["minutes"]}
    card = (tmp_path / "resumed" / "README.md").read_text()
    assert f"- vocabulary: {full['vocab']}" in card


def _cut_last_line(path, keep: float = 0.5) -> dict:
    """Leave `path` as an interrupted write would: its last record half written. Returns that record."""
    raw = path.read_bytes()
    start = raw.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(raw[: start + int(keep * (len(raw) - start - 1))])
    return json.loads(raw[start:])


def _lines(path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]  # every line whole: nothing glued to a partial one


def test_jsonl_caches_resume_over_a_partial_last_line(tiny_dir, tmp_path, one_thread):
    """An interruption mid-write leaves a cache's last line partial: readers skip it, the next writer
    cuts it off, and the resumed run writes that record again -- none lost, none twice -- for the
    answers (generate_answers), the llama trainer's pool (SeqPool), self-instruct questions and
    specdec-corpus."""
    from specdec_tools.distill import chat
    from specdec_tools.distill.answers import generate_answers, read_jsonl, training_prompts
    from specdec_tools.distill.data import Corpus, chat_prompts
    from specdec_tools.distill.seqgen import SeqPool
    from specdec_tools.make_corpus import read_answers
    tok, model = load_tokenizer(tiny_dir), load_model(tiny_dir, dtype=torch.float32)
    corpus = Corpus.build(10, 50, 0)

    prompts = training_prompts(corpus, tok)[:6]
    ref, path = tmp_path / "ref.jsonl", tmp_path / "work" / "answers.jsonl"
    generate_answers(model, tok, prompts, ref, batch=2, max_new=6)
    path.parent.mkdir()
    path.write_bytes(ref.read_bytes())
    _cut_last_line(path)
    assert read_jsonl(path) == _lines(ref)[:-1]
    assert read_answers(path.parent, {0.0}, 0) == [r["output"] for r in _lines(ref)[:-1]]  # specdec-corpus
    assert generate_answers(model, tok, prompts, path, batch=2, max_new=6) == len(prompts)
    assert sorted(_lines(path), key=lambda r: r["i"]) == sorted(_lines(ref), key=lambda r: r["i"])

    questions = tmp_path / "questions.jsonl"
    chat.self_instruct(model, tok, ["bees", "chess"], 1, questions, batch=4)
    want = _lines(questions)
    _cut_last_line(questions)
    chat.self_instruct(model, tok, ["bees", "chess"], 1, questions, batch=4)
    assert _lines(questions) == want

    pool_path = tmp_path / "seqgen.jsonl"
    chats = chat_prompts(corpus.train)
    pool = SeqPool(pool_path, chats, model, tok, max_new=6, seq_len=256)
    assert pool.generate_batch() > 1
    made = _lines(pool_path)
    _cut_last_line(pool_path)
    # the checkpoint counted every record (the lost one included): the pool goes on from what is left
    resumed = SeqPool(pool_path, chats, model, tok, max_new=6, seq_len=256, state={"cursor": len(made)})
    assert len(resumed.records) == len(made) - 1
    row, start = resumed.take(0.0)
    assert row == made[-1]["prompt"] + made[-1]["output"] and start == len(made[-1]["prompt"])
    assert _lines(pool_path)[: len(made)] == made and len({r["i"] for r in _lines(pool_path)}) == len(_lines(pool_path))


def test_eval_only_reports_and_leaves_the_draft_alone_unless_write_card(tiny_dir, tmp_path, capsys, one_thread):
    """--eval-only measures and prints, under a progress bar; the shipped card (with its hand-written
    sections) and specdec.json stay as they are. --write-card stores the results in both."""
    d = tmp_path / "e"
    main(["--arch", "eagle", "--target", str(tiny_dir), "--out", str(d), "--draft-vocab", str(VOCAB),
          "--seq-len", "128", "--corpus-limit", "60", "--answers", "4", "--gen-batch", "4", "--gen-tokens", "8",
          "--text-tokens", "1024", "--eval-prompts", "0", "--save-dtype", "float32", "--threads", "1",
          "--dtype-teacher", "float32", "--steps", "0"])
    with (d / "README.md").open("a") as f:
        f.write("\n## Notes written by hand\n\nkept across evaluations\n")
    card, extra = (d / "README.md").read_bytes(), (d / "specdec.json").read_bytes()
    assert "acceptance" not in json.loads(extra)["metrics"]
    evaluate = ["--eval-only", str(d), "--eval-prompts", "2", "--eval-tokens", "8", "--eval-dtype", "float32",
                "--corpus-limit", "60", "--threads", "1"]
    capsys.readouterr()
    m = main(evaluate)
    out, err = capsys.readouterr()
    assert set(m["acceptance"]["all"]) == {"1", "2", "3", "4"} and "k=1: acceptance" in out
    assert "evaluate: 100%" in err  # the progress bar, finished
    assert (d / "README.md").read_bytes() == card and (d / "specdec.json").read_bytes() == extra
    m2 = main([*evaluate, "--write-card"])
    assert json.loads((d / "specdec.json").read_text())["metrics"]["acceptance"] == m2["acceptance"]
    assert "| 1 |" in (d / "README.md").read_text()  # the card's table rewritten from the measurements


def _eagle(tiny_dir, tmp_path, *extra) -> list[str]:
    """A seconds-sized --arch eagle command on the tiny target (work dir tmp_path/work, out tmp_path/d)."""
    return ["--arch", "eagle", "--target", str(tiny_dir), "--out", str(tmp_path / "d"),
            "--work", str(tmp_path / "work"),
            "--draft-vocab", str(VOCAB), "--batch-tokens", "1024", "--seq-len", "128", "--corpus-limit", "60",
            "--answers", "8", "--gen-batch", "8", "--gen-tokens", "16", "--text-tokens", "2048", "--eval-prompts", "0",
            "--save-dtype", "float32", "--threads", "1", "--dtype-teacher", "float32", "--save-minutes", "0", *extra]


def test_eagle_rerun_at_the_final_step_keeps_the_training_metrics(tiny_dir, tmp_path, one_thread):
    """The same --resume command rerun after a finished run (a kill during export or evaluation)
    trains nothing and reports the finished run's train_top1/train_loss, not zeros."""
    args = _eagle(tiny_dir, tmp_path, "--steps", "3", "--resume")
    done = main(args)["train"]
    assert done["steps"] == 3 and done["train_loss"] > 0
    assert main(args)["train"] == done
    assert f"- training: {done}" in (tmp_path / "d" / "README.md").read_text()


def test_eagle_card_names_the_head_size_without_an_evaluation(tiny_dir, tmp_path, one_thread):
    """--eval-prompts 0: the card still says how many head rows the draft has, and specdec.json
    records the held-out split it was trained with (for --eval-only)."""
    main(_eagle(tiny_dir, tmp_path, "--steps", "0", "--heldout-pct", "7"))
    assert f"head rows for {VOCAB} tokens" in (tmp_path / "d" / "README.md").read_text()
    extra = json.loads((tmp_path / "d" / "specdec.json").read_text())
    assert extra["heldout"] == {"heldout_pct": 7, "heldout_chat_pct": 15}


@pytest.mark.parametrize("layers", ["7", "1"])
def test_eagle_refuses_feature_layers_the_target_lacks(tiny_dir, tmp_path, one_thread, layers):
    """The tiny target has 2 layers: a fused layer must be 0 (check_eagle_fits refuses the rest at
    load time), and the run says so before it generates anything."""
    with pytest.raises(SystemExit, match=r"--feature-layers \[\d\]: the target has 2 layers"):
        main(_eagle(tiny_dir, tmp_path, "--steps", "1", "--feature-layers", layers))
    assert not (tmp_path / "work" / "answers.jsonl").exists()


@pytest.mark.parametrize("extra, error, words", [
    (["--draft-vocab", "2"], ValueError, "--draft-vocab 2 is smaller than the"),
    (["--data", "{tmp}/nope.npz"], SystemExit, "nope.npz: no such file"),
    (["--init-draft", "{tmp}/nope"], SystemExit, "nope is not an EAGLE draft"),
    (["--init-vocab"], SystemExit, "it needs --init-draft"),
    (["--layers", "3"], SystemExit, "--layers is a flag of the llama draft"),
    (["--init-from-target"], SystemExit, "--init-from-target is a flag of the llama draft"),
    (["--mix", "0.9"], SystemExit, "--mix is a flag of the llama draft"),
])
def test_eagle_refuses_bad_arguments_before_generating(tiny_dir, tmp_path, one_thread, extra, error, words):
    """Arguments that would fail late (after hours of answers and features) or be ignored are refused
    before anything is generated."""
    with pytest.raises(error, match=re.escape(words)):
        main(_eagle(tiny_dir, tmp_path, "--steps", "1", *[a.format(tmp=tmp_path) for a in extra]))
    assert not (tmp_path / "work" / "answers.jsonl").exists()


def test_eagle_resume_refuses_another_draft_shape_or_other_data(tiny_dir, tmp_path, one_thread):
    """--resume onto a checkpoint of another draft shape, or with training rows that changed (the
    checkpoint's batch position would apply to other batches), exits with a message; the same
    command resumes."""
    args = _eagle(tiny_dir, tmp_path, "--steps", "2", "--resume")
    main(args)
    for extra, words in [(["--eagle-layers", "2"], "another draft shape (layers 1 there, 2 now)"),
                         (["--feature-layers", "0"], "another draft shape (feature_layers [] there, [0] now)"),
                         (["--answers", "6"], "another training data (rows")]:
        with pytest.raises(SystemExit, match=re.escape(words)):
            main([*args, *extra])
    assert main([*args, "--steps", "3"])["train"]["steps"] == 3


def test_generation_time_budget_is_total_across_runs(tiny_dir, tmp_path, one_thread):
    """A rerun of generate_answers with the same time budget generates nothing once earlier runs
    spent it (the seconds are recorded beside the cache); a new cache starts a new budget. (No
    wall-time bound: the budget is the seconds the first run recorded.)"""
    from specdec_tools.distill.answers import generate_answers, spent_seconds, training_prompts
    from specdec_tools.distill.data import Corpus
    tok, model = load_tokenizer(tiny_dir), load_model(tiny_dir, dtype=torch.float32)
    prompts = training_prompts(Corpus.build(10, 50, 0), tok)[:12]
    path = tmp_path / "answers.jsonl"
    assert generate_answers(model, tok, prompts, path, batch=1, max_new=4, max_answers=4) == 4
    spent = spent_seconds(path)
    assert spent > 0
    used_up = dict(batch=1, max_new=4, minutes=spent / 60)  # what the first run already spent
    assert generate_answers(model, tok, prompts, path, **used_up) == 4
    assert spent_seconds(path) == spent
    assert generate_answers(model, tok, prompts, path, batch=1, max_new=4, minutes=1e3) == 12  # budget left: the rest
    assert spent_seconds(path) > spent
    path.unlink()
    assert spent_seconds(path) == 0.0  # a new cache: its own budget (the old seconds beside no cache count nothing)


def test_eval_only_evaluates_on_the_split_the_draft_was_trained_with(tiny_dir, tmp_path, monkeypatch):
    """--eval-only takes the held-out percentages the draft was trained with from its specdec.json;
    a smaller one given is a subset of them, a larger one (training data) is refused."""
    from specdec_tools.distill import cli
    d = tmp_path / "s"
    distill(tiny_dir, d, "--steps", "0", "--mix", "0", "--eval-prompts", "0", "--heldout-pct", "5",
            "--heldout-chat-pct", "5")
    seen = []
    monkeypatch.setattr(cli, "run_eval", lambda d, t, args, *a: seen.append((args.heldout_pct, args.heldout_chat_pct))
                        or {})
    main(["--eval-only", str(d), "--threads", "1"])
    main(["--eval-only", str(d), "--threads", "1", "--heldout-pct", "3"])
    assert seen == [(5, 5), (3, 5)]
    with pytest.raises(SystemExit, match="the draft was trained with --heldout-chat-pct 5"):
        main(["--eval-only", str(d), "--threads", "1", "--heldout-chat-pct", "15"])


@pytest.mark.parametrize("device, arch, cuda, words", [
    ("cuda", "eagle", False, "--device cuda: this machine has no CUDA device"),
    ("mps", "eagle", False, "--device mps: use cpu or cuda"),
    ("nodevice", "eagle", False, "--device nodevice: "),
    ("cuda", "llama", True, "the llama draft trains on the CPU only"),
])
def test_a_device_the_run_cannot_use_is_refused_before_anything_loads(tiny_dir, tmp_path, monkeypatch, one_thread,
                                                                      device, arch, cuda, words):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    args = _eagle(tiny_dir, tmp_path, "--steps", "1", "--device", device)
    if arch == "llama":
        args = ["--target", str(tiny_dir), "--out", str(tmp_path / "d"), *COMMON, "--steps", "1", "--device", device]
    with pytest.raises(SystemExit, match=re.escape(words)):
        main(args)
    assert not (tmp_path / "work").exists() and not (tmp_path / "d").exists()


def test_features_and_training_follow_the_models_device(tiny_dir, tmp_path, one_thread):
    """The teacher's features are kept in host memory whatever the target's device, and a training
    step moves each batch to the draft's device (checked on the CPU; tests/test_gpu.py runs the whole
    pipeline on CUDA)."""
    from specdec.eagle_draft import EagleDraft
    from specdec_tools.distill.eagle_train import EagleTrainConfig, EagleTrainer, FeatureCache
    target = load_model(tiny_dir)
    cache = FeatureCache.build(target, [("chat", list(range(5, 40))), ("text", list(range(7, 30)))], batch_rows=2)
    assert [f.device.type for f in cache.feats] == ["cpu", "cpu"] and cache.feats[0].dtype == torch.bfloat16
    draft = EagleDraft.for_target(target, torch.arange(VOCAB))
    trainer = EagleTrainer(draft, cache, EagleTrainConfig(steps=1, minutes=None), tmp_path)
    assert trainer.device == target.device and trainer.noise_generator().device == target.device
    moved = []
    real = torch.Tensor.to

    def to(t, *a, **kw):
        moved.append(a[0] if a else kw.get("device"))
        return real(t, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "to", to)
        trainer.train_step([0, 1])
    assert moved[:3] == [target.device] * 3  # feats, tokens, mask
