"""How good is a draft for its target: greedy acceptance through the real engine on held-out
prompts, and the cost ratio c that decides whether that acceptance pays.

- acceptance: `LLMEngine` with the target and a `DraftModelProposer` over the draft (its reduced
  head mapped through `draft_vocab`, FR-Spec, Zhao et al. 2025), or an `EagleProposer` for an
  EAGLE draft (specdec.eagle_draft), greedy, fixed k in {1..4}
  (adaptive off), on held-out chat prompts (chat template) and code prefixes, separately.
- c: median batch-1 forward time of the draft over the target's, one new token after a
  128-token context, both in the same dtype. With per-token acceptance a the expected speedup of
  k drafts is roughly (1 - a^(k+1)) / ((1 - a)(1 + k c)) (Leviathan et al. 2023); DistillSpec
  (Zhou et al. 2023) reports exactly these two quantities. We report the measured version:
  mean accepted length / (1 + k c).
"""
from __future__ import annotations

import statistics
import time

import torch
from tqdm import tqdm

from specdec.eagle_draft import EagleDraft
from specdec.engine import EngineConfig, LLMEngine
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleProposer
from specdec.prompts import encode_chat
from specdec.sampling import SamplingParams
from specdec.target_worker import TargetWorker
from specdec_tools.distill.chat import ChatItem, seed_prompts
from specdec_tools.distill.chat import split_topics as generic_split
from specdec_tools.distill.data import Corpus, chat_ids, chat_prompts, code_prompts

KS = (1, 2, 3, 4)


def heldout_prompts(corpus: Corpus, tokenizer, n: int, generic_pct: int = 15,
                    max_prompt_tokens: int = 384) -> dict[str, list[list[int]]]:
    """n held-out prompts, half chat about the standard library (through the chat template) and
    half raw code prefixes, plus n everyday-chat prompts about held-out topics ("generic")."""
    chat = [p for p in chat_ids(tokenizer, chat_prompts(corpus.heldout)[: 4 * n]) if len(p) <= max_prompt_tokens]
    code = [tokenizer(c, add_special_tokens=False).input_ids for c in code_prompts(corpus.heldout)[: 4 * n]]
    code = [p for p in code if 0 < len(p) <= max_prompt_tokens]
    n_chat = (n + 1) // 2
    generic = [encode_chat(tokenizer, list(it.messages)) for it in generic_prompts(n, generic_pct)]
    return {"chat": chat[:n_chat], "code": code[: n - n_chat], "generic": generic}


def generic_prompts(n: int, pct: int = 15, topic_set: str = "base") -> list[ChatItem]:
    """n everyday-chat tasks about the held-out topics of `topic_set` (the card's generic set: the
    first list's). Only the tasks about a topic: rewrites, math and code requests are the same
    whatever the topic, so they are training prompts too (5 of the 32 were, before this filter)."""
    _, topics = generic_split(pct, topic_set)
    return [it for it in seed_prompts(topics, seed=1) if it.kind == "task"][:n]


def acceptance(target, draft, token_map, tokenizer, prompts: list[list[int]], k: int, max_tokens: int = 64,
               batch: int = 8):
    """Run `prompts` greedily with k drafts per round; returns (engine stats, output ids)."""
    max_len = max(len(p) for p in prompts) + max_tokens + k + 8
    worker = TargetWorker(target, batch, max_len)
    if isinstance(draft, EagleDraft):  # reads the target's features; its token map is its own
        proposer = EagleProposer(draft, batch, max_len)
    else:
        proposer = DraftModelProposer(draft, batch, max_len, token_map=token_map)
    engine = LLMEngine(worker, proposer, tokenizer, EngineConfig(max_batch_size=batch, max_model_len=max_len,
                                                                 num_speculative_tokens=k, adaptive=False))
    seqs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return engine.stats, [list(s.output_ids) for s in seqs]


@torch.inference_mode()
def forward_ms(model, ctx: int = 128, reps: int = 20) -> list[float]:
    """Batch-1 times (ms) of one new token after a `ctx`-token context, on the model's device."""
    dev = model.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model.setup_cache(1, ctx + 8)
    slot = torch.zeros(1, dtype=torch.long, device=dev)

    def kw(T: int) -> dict:  # an EAGLE draft also reads one feature per token
        return {"features": torch.zeros(1, T, model.args.hidden_size, device=dev)} if isinstance(model, EagleDraft) else {}

    model(torch.ones(1, ctx, dtype=torch.long, device=dev), slot, torch.zeros(1, dtype=torch.long, device=dev), **kw(ctx))
    out = []
    one, token, pos = kw(1), torch.ones(1, 1, dtype=torch.long, device=dev), torch.full((1,), ctx, dtype=torch.long, device=dev)
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        model(token, slot, pos, **one)
        sync()
        out.append(1000 * (time.perf_counter() - t0))
    return out


def cost_ratio(target, draft, ctx: int = 128, reps: int = 20) -> dict:
    """c = median draft forward / median target forward (batch 1, same dtype), interleaved runs."""
    forward_ms(draft, ctx, 3), forward_ms(target, ctx, 3)  # warm up
    d, t = [], []
    for _ in range(3):
        d += forward_ms(draft, ctx, reps)
        t += forward_ms(target, ctx, reps)
    dm, tm = statistics.median(d), statistics.median(t)
    return {"cost_ratio": round(dm / tm, 4), "draft_ms": round(dm, 3), "target_ms": round(tm, 3)}


def evaluate(target, draft, token_map, tokenizer, prompts: dict[str, list[list[int]]], ks=KS,
             max_tokens: int = 64, log=None) -> dict:
    """Acceptance per category and k, the cost ratio, and the head's coverage of the target's tokens.
    A progress bar counts the cost measurement and each (k, category) run; `log` (default: printed
    above the bar) gets a line per result."""
    bar = tqdm(total=1 + len(ks) * sum(1 for ps in prompts.values() if ps), desc="evaluate", unit="run",
               dynamic_ncols=True)
    log = log or bar.write
    bar.set_postfix_str("cost ratio")
    cost = cost_ratio(target, draft)
    bar.update()
    log(f"cost ratio c = {cost['cost_ratio']:.3f} (draft {cost['draft_ms']:.2f} ms, target {cost['target_ms']:.2f} ms)")
    table: dict[str, dict] = {}
    covered = emitted = 0
    kept = set(token_map.tolist()) if token_map is not None else None
    for k in ks:
        total = None
        for cat, ps in prompts.items():
            if not ps:
                continue
            bar.set_postfix(k=k, prompts=cat)
            stats, outs = acceptance(target, draft, token_map, tokenizer, ps, k, max_tokens)
            bar.update()
            table.setdefault(cat, {})[str(k)] = _row(stats, k, cost["cost_ratio"])
            if k == ks[0]:
                emitted += sum(len(o) for o in outs)
                covered += sum(len(o) if kept is None else sum(t in kept for t in o) for o in outs)
            if total is None:
                total = stats
            else:
                total.merge(stats)
        if total is not None:
            table.setdefault("all", {})[str(k)] = _row(total, k, cost["cost_ratio"])
            r = table["all"][str(k)]
            log(f"k={k}: acceptance {r['acceptance_rate']:.3f}, mean accepted length "
                f"{r['mean_accepted_length']:.3f}, est. speedup {r['est_speedup']:.2f}x  "
                + "  ".join(f"{c}: {table[c][str(k)]['acceptance_rate']:.3f}"
                            for c in prompts if str(k) in table.get(c, {})))
    bar.close()
    first = table.get("all", {}).get(str(ks[0]), {})
    return {"greedy_acceptance": first.get("acceptance_rate"), **cost,
            "vocab_coverage": round(covered / emitted, 4) if emitted else None,
            "eval_prompts": {c: len(p) for c, p in prompts.items()}, "eval_max_tokens": max_tokens,
            "acceptance": table}


def _row(stats, k: int, c: float) -> dict:
    mal = stats.mean_accepted_length
    return {"acceptance_rate": round(stats.acceptance_rate, 4), "mean_accepted_length": round(mal, 4),
            "per_position": [round(x, 4) for x in stats.per_position_acceptance],
            "est_speedup": round(mal / (1 + k * c), 3)}
