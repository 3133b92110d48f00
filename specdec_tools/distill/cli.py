"""`specdec-distill` / `python -m specdec_tools.distill`: train a draft model for a target, export it as a
Hugging Face checkpoint with a reduced head, and measure it with the engine.

    specdec-distill --target smollm2 --out drafts/smollm2-l4 --layers 4 --init-from-target \\
        --draft-vocab 8192 --minutes 30
    specdec-distill --eval-only drafts/smollm2-l4   (prints the results; --write-card also stores them in the draft)
    specdec-distill --arch eagle --target smollm2 --out drafts/smollm2-eagle --minutes 45   (see eagle_cli)

Pipeline: load the target (fp32, to copy initial weights, then the teacher dtype); build the
offline corpus and its held-out split (specdec_tools.distill.data); pick the draft vocabulary from the
target's greedy predictions (specdec_tools.distill.teacher); train (specdec_tools.distill.train); save the
checkpoint (specdec_tools.distill.student); evaluate on held-out prompts (specdec_tools.distill.evaluate) and
write everything into specdec.json. Methods: DistillSpec (Zhou et al. 2023), FR-Spec (Zhao et al. 2025).
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path

import torch

from specdec import envs
from specdec.eagle_draft import is_eagle, load_eagle
from specdec.loader import load_model, load_tokenizer, materialize, parse_dtype, resolve, resolve_extra
from specdec_tools.distill import eagle_cli
from specdec_tools.distill.data import Corpus, TextMix, chat_prompts
from specdec_tools.distill.evaluate import KS, evaluate, heldout_prompts
from specdec_tools.distill.seqgen import SeqPool
from specdec_tools.distill.student import DraftLM, draft_config, save_hf, write_extra
from specdec_tools.distill.teacher import Teacher, select_vocab, special_ids
from specdec_tools.distill.train import TrainConfig, Trainer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec-distill", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--target", default="smollm2", help="target model spec (HF dir, .gguf, or 'smollm2')")
    a("--out", help="output checkpoint directory")
    a("--eval-only", metavar="DIR", help="only evaluate the draft in DIR (target from its specdec.json) and print "
      "the results; DIR is left as it is unless --write-card")
    a("--write-card", action="store_true", help="with --eval-only: store the results in DIR's specdec.json metrics "
      "and, for an EAGLE draft, rewrite its README.md from them (hand-written sections of the card are lost)")
    a("--arch", choices=["llama", "eagle"], default="llama",
      help="llama: a standalone small model; eagle: one layer over the target's features (specdec.eagle_draft)")
    g = p.add_argument_group("draft architecture")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, help="hidden size (default: the target's)")
    g.add_argument("--intermediate", type=int, help="MLP size (default: the target's, scaled with --hidden)")
    g.add_argument("--heads", type=int, help="attention heads (default: the target's)")
    g.add_argument("--kv-heads", type=int, help="key/value heads (default: the target's)")
    g.add_argument("--init-from-target", action="store_true",
                   help="copy the target's embeddings, first layers, final norm and head rows where shapes match")
    g.add_argument("--train-embeddings", action="store_true", help="train copied embeddings (frozen by default)")
    g.add_argument("--draft-vocab", type=int, default=8192,
                   help="reduced head: the N tokens the target predicts most on training data (0 = full vocab)")
    g.add_argument("--vocab-tokens", type=int, default=32768, help="training tokens used to rank the vocabulary")
    t = p.add_argument_group("training")
    t.add_argument("--minutes", type=float, help="training time budget (total across resumes; default 20 "
                                                 "unless --steps is given)")
    t.add_argument("--steps", type=int, help="optimizer steps (total across resumes)")
    t.add_argument("--batch-tokens", type=int, default=4096)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=10, help="warmup steps")
    t.add_argument("--mix", type=float, default=0.25, help="fraction of rows from the target's own chat answers")
    t.add_argument("--prose-frac", type=float, default=0.3, help="fraction of plain-text rows drawn from prose")
    t.add_argument("--gen-tokens", type=int, default=128, help="max tokens per generated answer")
    t.add_argument("--gen-share", type=float, default=0.3, help="max fraction of training time spent generating")
    t.add_argument("--topk", type=int, default=64, help="teacher top-k truncation")
    t.add_argument("--dtype-teacher", default="bfloat16")
    t.add_argument("--no-amp", action="store_true", help="train the draft in float32 without bf16 autocast")
    t.add_argument("--save-minutes", type=float, default=5.0, help="checkpoint interval")
    t.add_argument("--resume", action="store_true", help="continue from --out/ckpt.pt")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--corpus-limit", type=int, default=0, help="use at most this many pieces per split (0 = all)")
    t.add_argument("--heldout-pct", type=int, default=10)
    t.add_argument("--heldout-chat-pct", type=int, default=15,
                   help="everyday-chat topics held out for evaluation (specdec_tools.distill.chat)")
    o = p.add_argument_group("output and evaluation")
    o.add_argument("--save-dtype", default="bfloat16")
    o.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts (half chat, half code); 0 = skip")
    o.add_argument("--eval-tokens", type=int, default=64)
    o.add_argument("--eval-dtype", default="bfloat16", help="dtype of target and draft in the evaluation")
    o.add_argument("--threads", type=int, default=envs.NUM_THREADS, help="torch threads (0 = torch default)")
    o.add_argument("--device", default="cpu", help="where the target and the draft run: cpu or cuda[:N] (--arch "
                   "eagle: answers, features, training and evaluation; --arch llama: --eval-only)")
    eagle_cli.add_arguments(p)
    return p


def _target_state(model, layers: int) -> dict:
    """fp32 copies of what a draft can inherit: embeddings, the first layers, final norm, head."""
    keep = {}
    for k, v in model.state_dict().items():
        if k.startswith("layers.") and int(k.split(".")[1]) >= layers:
            continue
        keep[k] = v.detach().float().clone()
    return keep


def run_eval(draft_dir: Path, target_spec: str, args, corpus: Corpus | None = None, tokenizer=None) -> dict:
    dtype = parse_dtype(args.eval_dtype)
    tokenizer = tokenizer or load_tokenizer(target_spec)
    corpus = corpus or Corpus.build(args.heldout_pct, args.corpus_limit, args.seed)
    prompts = heldout_prompts(corpus, tokenizer, args.eval_prompts, args.heldout_chat_pct)
    target = load_model(target_spec, dtype=dtype, device=args.device)
    if is_eagle(draft_dir):
        draft = load_eagle(draft_dir, target, dtype)
    else:
        draft = load_model(draft_dir, dtype=dtype, device=args.device)  # slices the head to draft_vocab (see loader)
    ids = getattr(draft, "extra", {}).get("draft_vocab")
    token_map = torch.tensor(ids, dtype=torch.long) if ids else None
    print(f"evaluating {draft_dir} against {target_spec} ({args.eval_dtype}) on "
          + ", ".join(f"{len(v)} {k}" for k, v in prompts.items()) + " held-out prompts", flush=True)
    metrics = evaluate(target, draft, token_map, tokenizer, prompts, KS, args.eval_tokens)
    metrics["eval_dtype"] = args.eval_dtype
    metrics["eval_device"] = str(target.device)
    return metrics


def _choose_vocab(args, teacher: Teacher, corpus: Corpus, tok, eos: int, specials: list[int]):
    """The draft head's token ids, ranked on `--vocab-tokens` of training text (half prose)."""
    t0 = time.perf_counter()
    sample, rng = TextMix(corpus.train, tok, args.seq_len, eos, 0.5, seed=args.seed + 17), random.Random(args.seed)
    rows = [sample.next_row(rng) for _ in range(max(1, args.vocab_tokens // args.seq_len))] if args.draft_vocab else []
    kept, info = select_vocab(teacher, rows, args.draft_vocab, teacher.model.args.vocab_size, specials)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"draft vocabulary: {len(kept)} tokens, covering {info['coverage']:.3f} of the target's greedy "
          f"predictions on {info['tokens']} training tokens ({info['seconds']} s)", flush=True)
    return kept, info


def _build_student(args, target_cfg, kept: list[int], init_sd: dict | None, ckpt: dict | None) -> DraftLM:
    """A fresh draft (initialised from the target if asked) or the one being resumed."""
    if ckpt is not None:  # the architecture of the run being resumed, whatever the flags say now
        from transformers import LlamaConfig
        config = LlamaConfig.from_dict(ckpt["config"])
    else:
        config = draft_config(target_cfg, args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads)
    student = DraftLM(config, kept)
    if ckpt is not None:
        if not args.train_embeddings and ckpt.get("frozen_embeddings"):
            student.body.embed_tokens.weight.requires_grad_(False)
        student.load_state_dict(ckpt["model"])
    elif init_sd is not None:
        copied = student.init_from_target(init_sd, freeze_embeddings=not args.train_embeddings)
        print(f"initialised from the target: {len(copied)} tensors", flush=True)
    return student


def trained_split(extra: dict) -> dict:
    """The held-out percentages a draft was trained with: stored in its specdec.json ("heldout"),
    else (older drafts) read from its recorded command ({} if that does not parse)."""
    if "heldout" in extra:
        return extra["heldout"]
    try:
        a, _ = build_parser().parse_known_args(shlex.split(extra.get("command", ""))[1:])
    except SystemExit:
        return {}
    return eagle_cli.heldout_split(a)


def use_trained_split(args, argv: list[str], extra: dict) -> None:
    """--eval-only evaluates on the split the draft was trained with: the trained percentages unless
    given, and a larger one given is refused (its extra units and topics were training data)."""
    for key, trained in trained_split(extra).items():
        flag = "--" + key.replace("_", "-")
        if not eagle_cli.given(argv, flag):
            setattr(args, key, trained)
        elif getattr(args, key) > trained:
            raise SystemExit(f"{flag} {getattr(args, key)}: the draft was trained with {flag} {trained}, so a larger "
                             "held-out share would evaluate it on its training data")


def _update_metrics(draft_dir: Path, metrics: dict) -> dict:
    extra = resolve_extra(draft_dir)
    extra.setdefault("metrics", {}).update(metrics)
    write_extra(Path(draft_dir) / "specdec.json", extra)
    return extra


def check_device(args) -> None:
    """Refuse a --device this machine lacks, or one the llama draft's training cannot use."""
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise SystemExit(f"--device {args.device}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this machine has no CUDA device (torch {torch.__version__})")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {args.device}: use cpu or cuda")
    if device.type != "cpu" and args.arch == "llama" and not args.eval_only:
        raise SystemExit("--device: the llama draft trains on the CPU only (--arch eagle trains on any device)")


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.write_card and not args.eval_only:
        raise SystemExit("--write-card goes with --eval-only DIR")
    check_device(args)
    if args.eval_only:
        d = Path(args.eval_only)
        given = eagle_cli.given(argv, "--target")
        target = args.target if given else resolve_extra(d).get("target", args.target)
        use_trained_split(args, argv, resolve_extra(d))
        metrics = run_eval(d, target, args)
        print(json.dumps({k: v for k, v in metrics.items() if k != "acceptance"}, indent=1))
        if args.write_card:
            extra = _update_metrics(d, metrics)
            if is_eagle(d):
                eagle_cli.write_model_card(d, extra)
            print(f"wrote the results into {d / 'specdec.json'}" + (" and README.md" if is_eagle(d) else ""))
        else:
            print(f"{d} left unchanged (--write-card stores the results in its specdec.json and model card)")
        return metrics
    if not args.out:
        raise SystemExit("--out is required (or --eval-only DIR)")
    if args.steps is None and args.minutes is None:
        args.minutes = 20.0
    if args.arch == "eagle":
        extra = eagle_cli.run(args, argv)
        if args.eval_prompts > 0:
            extra = _update_metrics(Path(args.out), run_eval(Path(args.out), args.target, args))
        eagle_cli.write_model_card(Path(args.out), extra)
        print(json.dumps({k: v for k, v in extra["metrics"].items() if k != "acceptance"}, indent=1))
        return extra["metrics"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = None
    if args.resume and (out / "ckpt.pt").is_file():
        ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    elif not args.resume:  # a fresh run: forget an earlier run's state and cached answers
        for name in ("ckpt.pt", "seqgen.jsonl"):
            (out / name).unlink(missing_ok=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()

    tok = load_tokenizer(args.target)
    from transformers import AutoConfig
    target_cfg = AutoConfig.from_pretrained(materialize(resolve(args.target)).path)
    target = load_model(args.target, dtype=torch.float32)
    init_sd = _target_state(target, args.layers) if args.init_from_target and ckpt is None else None
    target = target.to(parse_dtype(args.dtype_teacher))
    teacher = Teacher(target, topk=args.topk)
    corpus = Corpus.build(args.heldout_pct, args.corpus_limit, args.seed)
    eos = tok.eos_token_id if tok.eos_token_id is not None else special_ids(tok, target_cfg)[0]
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    print(f"target {args.target}: {target.args.num_layers} layers, vocab {target.args.vocab_size}; corpus "
          f"{len(corpus.train)} training / {len(corpus.heldout)} held-out pieces", flush=True)

    if ckpt is not None:
        kept, vocab_info = ckpt["kept"], ckpt.get("vocab_info", {})
    else:
        kept, vocab_info = _choose_vocab(args, teacher, corpus, tok, eos, special_ids(tok, target_cfg))
    kept_t = torch.tensor(kept, dtype=torch.long)
    teacher.set_vocab(None if len(kept) == target.args.vocab_size else kept_t)

    student = _build_student(args, target_cfg, kept, init_sd, ckpt)
    del init_sd
    n_params = sum(p.numel() for p in student.parameters())
    n_train = sum(p.numel() for p in student.parameters() if p.requires_grad)
    config = student.config
    print(f"draft: {config.num_hidden_layers} layers, hidden {config.hidden_size}, head {len(kept)} rows; "
          f"{n_params / 1e6:.1f}M parameters ({n_train / 1e6:.1f}M trained)", flush=True)

    stream = TextMix(corpus.train, tok, args.seq_len, eos, args.prose_frac, seed=args.seed,
                     state=ckpt and ckpt["stream"])
    pool = None
    if args.mix > 0:
        prompts = chat_prompts(corpus.train)
        random.Random(args.seed).shuffle(prompts)
        pool = SeqPool(out / "seqgen.jsonl", prompts, target, tok, args.gen_tokens, args.seq_len,
                       args.gen_share, state=ckpt and ckpt["pool"])
    cfg = TrainConfig(steps=args.steps, minutes=args.minutes, batch_tokens=args.batch_tokens, seq_len=args.seq_len,
                      lr=args.lr, warmup=args.warmup, mix=args.mix, seed=args.seed,
                      save_minutes=args.save_minutes, amp=not args.no_amp)
    meta = {"vocab_info": vocab_info, "frozen_embeddings": not student.body.embed_tokens.weight.requires_grad}
    trainer = Trainer(student, teacher, stream, pool, cfg, out, pad, state=ckpt, meta=meta)
    if ckpt is not None:
        print(f"resuming at step {trainer.step} ({trainer.elapsed / 60:.1f} min trained)", flush=True)
    summary = trainer.run()
    print("training: " + ", ".join(f"{k} {v}" for k, v in summary.items()), flush=True)

    full = len(kept) == target.args.vocab_size
    extra = {"target": str(args.target), "command": "specdec-distill " + shlex.join(argv),
             "heldout": eagle_cli.heldout_split(args),
             "metrics": {"train": summary, "vocab": vocab_info}, "draft_vocab": None if full else kept}
    save_hf(student, out, tok, extra, parse_dtype(args.save_dtype))
    print(f"saved {out} ({time.perf_counter() - t_start:.0f} s so far)", flush=True)
    del teacher, target, trainer, pool
    if args.eval_prompts > 0:
        metrics = run_eval(out, args.target, args, corpus, tok)
        extra = _update_metrics(out, metrics)
    print(json.dumps({k: v for k, v in extra["metrics"].items() if k != "acceptance"}, indent=1))
    return extra["metrics"]


def console() -> int:
    """Console-script entry point (`specdec-distill`)."""
    main()
    return 0
