"""`specdec-distill --arch eagle`: the EAGLE-style draft pipeline (see specdec_tools.distill.eagle_train).

    specdec-distill --arch eagle --target smollm2 --out drafts/smollm2-eagle \\
        --answers 2000 --text-tokens 400000 --draft-vocab 8192 --minutes 45

1. the target's greedy answers to training chat prompts and code prefixes (resumable jsonl), and
   with --chat-answers its greedy and sampled answers to everyday chat (specdec_tools.distill.chat);
   --pack-data keeps them in one small file, and --data adds earlier runs' files (specdec_tools.distill.packed);
2. teacher features: one bf16 prefill over those answers and packed plain text (resumable);
3. the draft vocabulary from the target's greedy predictions in that pass;
4. training (resumable with --resume); 5. export (fc + layer, bf16) and held-out evaluation.
Caches and the optimizer state live in --work (default <out>.work), outside the shipped directory.
"""
from __future__ import annotations

import hashlib
import json
import random
import shlex
import time
from array import array
from pathlib import Path

import torch

from specdec.eagle_draft import EagleDraft, is_eagle, load_eagle
from specdec.loader import load_model, load_tokenizer, materialize, parse_dtype, resolve
from specdec.prompts import encode_chat
from specdec_tools.distill import chat, packed
from specdec_tools.distill.answers import generate_answers, read_jsonl, training_prompts
from specdec_tools.distill.data import Corpus, TextMix
from specdec_tools.distill.eagle_train import EagleTrainConfig, EagleTrainer, FeatureCache
from specdec_tools.distill.teacher import check_draft_vocab, special_ids

# flags of the llama draft (specdec_tools.distill.cli) that --arch eagle has no use for
LLAMA_ONLY = ("--layers", "--hidden", "--intermediate", "--heads", "--kv-heads", "--init-from-target",
              "--train-embeddings", "--vocab-tokens", "--mix", "--gen-share", "--topk")


def add_arguments(p) -> None:
    g = p.add_argument_group("EAGLE drafts (--arch eagle)")
    g.add_argument("--answers", type=int, default=1000, help="target answers to generate (chat + code)")
    g.add_argument("--gen-minutes", type=float,
                   help="stop generating answers after this long (total across resumes)")
    g.add_argument("--gen-batch", type=int, default=24, help="batch size of answer generation")
    g.add_argument("--text-tokens", type=int, default=200_000, help="plain-text tokens prefilled for features")
    g.add_argument("--feature-batch", type=int, default=16, help="rows per prefill of the teacher features")
    g.add_argument("--cls-weight", type=float, default=0.5, help="CE weight beside the feature regression")
    g.add_argument("--noise", type=float, default=0.1, help="uniform noise on input features")
    g.add_argument("--train-steps", type=int, default=2, choices=[1, 2, 3, 4],
                   help="draft steps trained (training-time test): each step past the first adds a "
                   "pass on the previous step's predicted features")
    g.add_argument("--work", help="caches and optimizer state (default: <out>.work)")
    g.add_argument("--feature-layers", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                   help="EAGLE-3 fusion: target layers (0-based, e.g. 2,14) whose outputs the draft reads "
                   "beside the final feature (default: none, EAGLE-1)")
    g.add_argument("--data", nargs="+", default=[], metavar="FILE",
                   help="packed answers of earlier runs (specdec_tools.distill.packed) trained on beside this run's")
    g.add_argument("--pack-data", metavar="FILE", help="pack this run's answers into FILE (.npz) for later runs' --data")
    g.add_argument("--init-draft", help="start from this EAGLE draft's fuse, fc and layers (fine-tuning; its "
                   "vocabulary is replaced by the one selected from this run's data, unless --init-vocab)")
    g.add_argument("--init-vocab", action="store_true",
                   help="with --init-draft: keep that draft's vocabulary (its head rows) instead of selecting one")
    g.add_argument("--eagle-layers", type=int,
                   help="decoder layers of the draft (default: --init-draft's, else 1). Layers beyond --init-draft's "
                   "start as the identity (EagleDraft.load_grown): the grown draft starts as the one it grows from")
    c = p.add_argument_group("everyday chat data (specdec_tools.distill.chat)")
    c.add_argument("--chat-answers", type=int, default=0, help="target answers to everyday-chat prompts")
    c.add_argument("--chat-minutes", type=float,
                   help="time for chat answers, total across resumes (first turns get 1 - --follow-up-frac "
                   "of it, second turns the rest)")
    c.add_argument("--chat-seed", type=int,
                   help="seed of the everyday-chat data alone (task templates, self-instruct questions, order, "
                   "sampled answers; default --seed): another value makes new conversations about the same "
                   "training topics, leaving the held-out split and the code data as they were")
    c.add_argument("--chat-topics", choices=chat.TOPIC_SETS, default="base",
                   help="which topic list the chat prompts are about (specdec_tools.distill.chat: TOPICS is 'base', "
                   "MORE_TOPICS 'more'); the held-out topics of both stay out of training either way")
    c.add_argument("--questions-per-topic", type=int, default=6, help="self-instruct questions per topic")
    c.add_argument("--sampled-frac", type=float, default=0.5,
                   help="share of chat answers sampled (half at temperature 0.7, half at 1.0), the rest greedy")
    c.add_argument("--follow-up-frac", type=float, default=0.2, help="chat answers continued by a second turn")
    c.add_argument("--resample-minutes", type=float, default=0.0,
                   help="time (total across resumes) for a second, sampled answer to the first-turn prompts "
                   "(temperature 0.7 / 1.0, "
                   "the one the first answer did not use; other seeds): more of the target's distribution "
                   "per prompt, without writing questions")


def given(argv: list[str], flag: str) -> bool:
    """Whether `flag` is on the command line `argv` (`--flag value` or `--flag=value`)."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def heldout_split(args) -> dict:
    """The held-out percentages of a run (recorded in the draft's specdec.json, read by --eval-only)."""
    return {"heldout_pct": args.heldout_pct, "heldout_chat_pct": args.heldout_chat_pct}


def check_flags(args, argv: list[str]) -> None:
    """Refuse, before anything loads, what would otherwise be ignored or fail only after the answers
    and features are made: flags of the llama draft, --init-vocab without --init-draft, --data files
    that do not exist, an --init-draft that is no EAGLE draft."""
    checks = [(given(argv, f), f"{f} is a flag of the llama draft (--arch llama)") for f in LLAMA_ONLY]
    checks += [(args.init_vocab and not args.init_draft, "--init-vocab keeps --init-draft's vocabulary: "
                "it needs --init-draft"),
               *((not Path(f).is_file(), f"--data {f}: no such file") for f in args.data),
               (bool(args.init_draft) and not is_eagle(args.init_draft),
                f"--init-draft {args.init_draft} is not an EAGLE draft (no specdec.json with kind 'eagle')")]
    problems = [msg for bad, msg in checks if bad]
    if problems:
        raise SystemExit("specdec-distill --arch eagle: " + "; ".join(problems))


def draft_shape(args) -> dict:
    """The draft this run trains: decoder layers (--eagle-layers, else --init-draft's, else 1) and
    the target layers it fuses."""
    init = json.loads((resolve(args.init_draft).path / "config.json").read_text()) if args.init_draft else {}
    return {"layers": args.eagle_layers or init.get("num_hidden_layers", 1),
            "feature_layers": list(args.feature_layers)}


def ckpt_shape(ckpt: dict | None) -> dict:
    """The draft shape a checkpoint holds ({} without one): as recorded, else (older checkpoints)
    the number of decoder layers its weights hold."""
    if ckpt is None:
        return {}
    return ckpt.get("shape") or {"layers": len({k.split(".")[1] for k in ckpt["model"] if k.startswith("layers.")})}


def check_feature_layers(layers: list[int], num_layers: int) -> None:
    """The engine's rule (specdec.eagle_draft.check_eagle_fits): a fused layer i has 0 <= i < num_layers - 1."""
    bad = [i for i in layers if not 0 <= i < num_layers - 1]
    if bad:
        raise SystemExit(f"--feature-layers {bad}: the target has {num_layers} layers; a fused layer must be "
                         f"0 .. {num_layers - 2} (its last layer's output is the final feature itself)")


def data_fingerprint(rows: list[tuple[str, list[int]]]) -> dict:
    """Rows, tokens and a hash of the training rows' tokens in order: what a checkpoint trained on."""
    h = hashlib.sha1()
    for _, r in rows:
        h.update(array("q", [len(r), *r]).tobytes())
    return {"rows": len(rows), "tokens": sum(len(r) for _, r in rows), "sha1": h.hexdigest()[:16]}


def refuse_changed(then: dict, now: dict, what: str, remedy: str) -> None:
    """Exit when this run's `now` differs from what the checkpoint to resume recorded (`then`) on
    any of its keys: training would go on with another draft or on other batches."""
    changed = [f"{k} {v} there, {now.get(k)} now" for k, v in then.items() if now.get(k) != v]
    if changed:
        raise SystemExit(f"--resume: the checkpoint in the work directory was trained with another {what} "
                         f"({'; '.join(changed)}): {remedy}")


def held_out_free(answers: list[dict], tok, heldout_pct: int = 15) -> list[dict]:
    """`answers` without those whose prompt names a held-out chat topic of any topic list
    (chat.heldout_topics, chat.mentioned_topic): questions written before that filter existed, and
    packed data of earlier runs."""
    heldout = chat.heldout_topics(heldout_pct)
    kept = [r for r in answers if not chat.mentioned_topic(chat.user_text(tok, r["prompt"]), heldout)]
    if len(kept) < len(answers):
        print(f"{len(answers) - len(kept)} answers left out: their prompts name held-out topics", flush=True)
    return kept


def training_rows(args, corpus: Corpus, tok, eos: int, answers: list[dict]) -> list[tuple[str, list[int]]]:
    answers = held_out_free(answers, tok, args.heldout_chat_pct)
    rows = [(r["kind"], r["prompt"] + r["output"]) for r in sorted(answers, key=lambda r: r["i"])]
    text = TextMix(corpus.train, tok, args.seq_len, eos, args.prose_frac, seed=args.seed)
    rng = random.Random(args.seed)
    rows += [("text", text.next_row(rng)) for _ in range(args.text_tokens // args.seq_len)]
    return rows


def earlier_answers(files: list[str], answers: list[dict]) -> list[dict]:
    """The answers packed in `files` that `answers` does not hold already, numbered after them."""
    seen = {(tuple(r["prompt"]), tuple(r["output"])) for r in answers}
    out = []
    for f in files:
        records, new = packed.unpack(f), []
        for r in records:
            key = (tuple(r["prompt"]), tuple(r["output"]))
            if key not in seen:
                seen.add(key)
                new.append(r)
        out += new
        print(f"{f}: {len(new)} of {len(records)} answers added ({sum(len(r['output']) for r in new)} tokens)",
              flush=True)
    return [{**r, "i": len(answers) + j} for j, r in enumerate(out)]


def _temperatures(n: int, sampled_frac: float) -> list[float]:
    """Greedy for the first (1 - sampled_frac) of every 20 answers, then 0.7 and 1.0 alternating."""
    sampled = round(20 * sampled_frac)
    return [0.0 if i % 20 < 20 - sampled else (0.7, 1.0)[i % 2] for i in range(n)]


def chat_rows(args, target, tok, work: Path) -> list[dict]:
    """Answers to everyday-chat prompts of the training topics (seed tasks, self-instruct
    questions, then second turns), resumable in `work`; returns their answer records."""
    train_topics = chat.split_topics(args.heldout_chat_pct, args.chat_topics)[0]
    heldout_topics = chat.heldout_topics(args.heldout_chat_pct)
    seed = args.seed if args.chat_seed is None else args.chat_seed
    offset = 0 if seed == args.seed else 10_000_019 * seed  # answers' sampling seeds
    questions = chat.self_instruct(target, tok, train_topics, args.questions_per_topic, work / "questions.jsonl",
                                   args.gen_batch, seed, avoid=heldout_topics)
    items = chat.seed_prompts(train_topics, seed) + questions[0]
    random.Random(seed).shuffle(items)
    for a, later in enumerate(questions[1:], 1):  # after the first run's order: cached answers keep their index
        random.Random(seed + a).shuffle(later)
        items += later
    items = items[: args.chat_answers]
    n_follow = int(args.follow_up_frac * len(items))
    first = items[: len(items) - n_follow]
    prompts = [(it.kind, encode_chat(tok, list(it.messages))) for it in first]
    share = args.follow_up_frac  # of the time budget, for second turns
    minutes = args.chat_minutes
    generate_answers(target, tok, prompts, work / "chat_answers.jsonl", args.gen_batch, args.gen_tokens,
                     minutes and minutes * (1 - share), temperatures=_temperatures(len(prompts), args.sampled_frac),
                     desc="chat answers", seed_offset=offset)
    done = {r["i"]: r for r in read_jsonl(work / "chat_answers.jsonl")}
    base = [i for i in range(len(first)) if i in done and done[i]["temperature"] == 0.0][:n_follow]
    seconds = chat.follow_ups([first[i] for i in base],
                              [tok.decode(done[i]["output"], skip_special_tokens=True) for i in base], seed)
    prompts2 = [(it.kind, encode_chat(tok, list(it.messages))) for it in seconds]
    if prompts2:  # over the greedy first turns answered so far (in index order: a resumed run extends it)
        generate_answers(target, tok, prompts2, work / "chat_follow_ups.jsonl", args.gen_batch, args.gen_tokens,
                         minutes and minutes * share, temperatures=_temperatures(len(prompts2), args.sampled_frac),
                         desc="follow-up answers", seed_offset=offset)
    if args.resample_minutes:
        temps = [(0.7, 1.0)[i % 2] if t == 0 else round(1.7 - t, 1)
                 for i, t in enumerate(_temperatures(len(prompts), args.sampled_frac))]
        generate_answers(target, tok, prompts, work / "chat_resampled.jsonl", args.gen_batch, args.gen_tokens,
                         args.resample_minutes, temperatures=temps, desc="resampled answers", seed_offset=offset + 1_000_003)
    return (list(done.values()) + read_jsonl(work / "chat_follow_ups.jsonl")
            + read_jsonl(work / "chat_resampled.jsonl"))


def run(args, argv: list[str]) -> dict:
    out = Path(args.out)
    work = Path(args.work or f"{out}.work")
    check_flags(args, argv)
    shape = draft_shape(args)
    ckpt = (torch.load(work / "ckpt.pt", weights_only=False, map_location="cpu")  # (a run on another device resumes it)
            if args.resume and (work / "ckpt.pt").is_file() else None)
    refuse_changed(ckpt_shape(ckpt), shape, "draft shape", "resume with the --eagle-layers and --feature-layers "
                   "it was trained with, or start over without --resume")
    work.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    tok = load_tokenizer(args.target)
    from transformers import AutoConfig
    target_cfg = AutoConfig.from_pretrained(materialize(resolve(args.target)).path)
    check_draft_vocab(args.draft_vocab, target_cfg.vocab_size, special_ids(tok, target_cfg))
    target = load_model(args.target, dtype=parse_dtype(args.dtype_teacher), device=args.device)
    check_feature_layers(args.feature_layers, target.args.num_layers)
    corpus = Corpus.build(args.heldout_pct, args.corpus_limit, args.seed)
    eos = tok.eos_token_id if tok.eos_token_id is not None else special_ids(tok, target_cfg)[0]

    prompts = training_prompts(corpus, tok)  # chat and code interleaved, in corpus order
    n = generate_answers(target, tok, prompts, work / "answers.jsonl", args.gen_batch, args.gen_tokens,
                         args.gen_minutes, args.answers)
    answers = read_jsonl(work / "answers.jsonl")[: args.answers]
    print(f"target answers: {len(answers)} of {n} generated ({sum(len(r['output']) for r in answers)} tokens)",
          flush=True)
    if args.chat_answers:
        talk = chat_rows(args, target, tok, work)
        print(f"everyday chat answers: {len(talk)} ({sum(len(r['output']) for r in talk)} tokens)", flush=True)
        answers += [{**r, "i": len(answers) + j} for j, r in enumerate(talk)]
    if args.pack_data:
        print(f"packed {len(answers)} answers into {packed.pack(args.pack_data, answers, shlex.join(argv))}", flush=True)
    answers += earlier_answers(args.data, answers)
    rows = training_rows(args, corpus, tok, eos, answers)
    data = data_fingerprint(rows)
    refuse_changed((ckpt or {}).get("data", {}), data, "training data",
                   "resume with the flags it was trained with (the generation budgets are total across "
                   "resumes), or start over without --resume")
    target.feature_layers = tuple(args.feature_layers)
    name = "features" + "".join(f"-{i}" for i in args.feature_layers)  # one cache per feature layout
    cache = FeatureCache.build(target, rows, batch_rows=args.feature_batch, path=work / f"{name}.pt")
    print(f"teacher features: {len(cache.tokens)} rows, {cache.num_tokens} tokens", flush=True)

    init = load_eagle(args.init_draft, target, torch.float32) if args.init_draft else None
    if ckpt is not None:
        kept, vocab_info = ckpt["token_map"], ckpt.get("vocab_info", {})
    elif init is not None and args.init_vocab:
        kept, vocab_info = init.token_map.tolist(), {"from": str(args.init_draft)}
    else:
        kept, vocab_info = cache.select_vocab(args.draft_vocab, special_ids(tok, target_cfg))
    print(f"draft vocabulary: {len(kept)} tokens covering {vocab_info.get('coverage')} of the target's "
          f"greedy predictions on the training rows", flush=True)
    layers = shape["layers"]
    draft = EagleDraft.for_target(target, torch.tensor(kept, dtype=torch.long), layers,
                                  feature_layers=args.feature_layers)
    if init is not None and ckpt is None:
        draft.load_grown(init.trained_state())
        print(f"initialised from {args.init_draft} ({len(init.layers)} of {layers} layers)", flush=True)
    cfg = EagleTrainConfig(minutes=args.minutes, steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr,
                           warmup=args.warmup, cls_weight=args.cls_weight, noise=args.noise, draft_steps=args.train_steps,
                           save_minutes=args.save_minutes, seed=args.seed, amp=not args.no_amp)
    trainer = EagleTrainer(draft, cache, cfg, work, state=ckpt,
                           meta={"vocab_info": vocab_info, "shape": shape, "data": data})
    if ckpt is not None:
        print(f"resuming at step {trainer.step} ({trainer.elapsed / 60:.1f} min trained)", flush=True)
    summary = trainer.run()
    print("training: " + ", ".join(f"{k} {v}" for k, v in summary.items()), flush=True)
    extra = {"target": str(args.target), "command": "specdec-distill " + shlex.join(argv),
             "heldout": heldout_split(args),
             "metrics": {"train": summary, "vocab": vocab_info,
                         "data": {"answers": len(answers), "rows": len(cache.tokens), "tokens": cache.num_tokens}}}
    draft.save(out, tok, extra, parse_dtype(args.save_dtype))
    print(f"saved {out} ({time.perf_counter() - t_start:.0f} s so far)", flush=True)
    return extra


def write_model_card(out: Path, extra: dict) -> Path:
    """README.md beside the checkpoint: what it is, the exact command, data, size and measurements."""
    out = Path(out)
    m = extra.get("metrics", {})
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    acc = m.get("acceptance", {})
    config = json.loads((out / "config.json").read_text())
    taps, n = config.get("feature_layers") or [], config["num_hidden_layers"]
    head = config.get("draft_vocab_size", len(extra.get("draft_vocab") or []))  # the export's: `extra` may lack it
    feature = (f"[the target's layers {taps} (RMS-normalized) and final-norm feature, fused by a linear map (EAGLE-3, "
               "Li et al. 2025)" if taps else "[the target's final-norm feature")
    lines = [
        f"# EAGLE-style draft for `{extra.get('target')}`", "",
        f"{'One decoder layer' if n == 1 else f'{n} decoder layers'} over {feature}, the next token's embedding] that",
        "predicts the target's next feature (Li et al. 2024, EAGLE-1), with the target's own embedding and",
        f"the target's head rows for {head} tokens (FR-Spec, Zhao et al. 2025) "
        "shared at load time, so",
        f"only {'fuse, ' if taps else ''}the fc and the {'layer' if n == 1 else 'layers'} are stored: {size / 1e6:.1f} MB ({'bf16' if size else '-'} safetensors).",
        "Load it with `proposer=eagle draft=<this directory>` (or `proposer=hybrid`); see specdec/eagle_draft.py.", "",
        "## How it was made", "", "```bash", extra.get("command", ""), "```", "",
        f"- data: {m.get('data', {})}",
        f"- vocabulary: {m.get('vocab', {})}",
        f"- training: {m.get('train', {})}", "",
        f"## Measured on held-out prompts (greedy, {m.get('eval_device', 'cpu').upper()}, specdec_tools.distill.evaluate)", "",
        f"cost ratio c = {m.get('cost_ratio')} (draft step {m.get('draft_ms')} ms vs target step "
        f"{m.get('target_ms')} ms, batch 1, {m.get('eval_dtype')}); head coverage of the target's tokens "
        f"{m.get('vocab_coverage')}; prompts {m.get('eval_prompts')}, {m.get('eval_max_tokens')} new tokens.", "",
        "*chat*: questions about held-out standard-library code; *code*: held-out code prefixes; *generic*:",
        "everyday chat about held-out topics (specdec_tools.distill.chat).", "",
        "| k | acceptance (all) | chat | code | generic | mean accepted length | est. speedup L/(1+kc) | per position |",
        "|---|---|---|---|---|---|---|---|"]
    for k, r in sorted(acc.get("all", {}).items()):
        lines.append(f"| {k} | {r['acceptance_rate']} | {acc.get('chat', {}).get(k, {}).get('acceptance_rate')} | "
                     f"{acc.get('code', {}).get(k, {}).get('acceptance_rate')} | "
                     f"{acc.get('generic', {}).get(k, {}).get('acceptance_rate')} | {r['mean_accepted_length']} | "
                     f"{r['est_speedup']} | {r['per_position']} |")
    path = out / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path
