"""Would cutting each row's draft chain where the draft's own confidence falls pay (EAGLE-2's
dynamic draft length, SpecDec++)? Measured before building it.

    python bench/draft_confidence.py [--sets everyday,tasks] [--batch 8] [--k 4] [--fixed-ms 33.5 --per-position-ms 1.64]

The engine decodes the HTTP benchmark's questions with the shipped EAGLE draft at fixed k (bf16,
greedy, adaptive off) and records, per round and row, the draft's probability of each token it
proposed and how many the target accepted. Cutting a chain at the first position whose cumulative
draft probability is below tau (lossless: the cut depends on the draft alone) then leaves
min(accepted, kept) accepted tokens per row. The table gives, per rule, drafted and accepted tokens
per row and round, and the throughput against plain decoding under a verify cost of
`fixed + per_position x positions` per round (this CPU at batch 8 in bf16: ~33.5 ms + ~1.6 ms per
position, BENCHMARKS.md), with every row's positions paid for exactly (a ragged verify, which the
engine does not have) and with the round's rows padded to its longest kept chain (today's verify).
Draft steps are not charged (c ~0.06 of a target step at batch 1), which favours long chains.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from http_bench import PROMPT_SETS  # noqa: E402

from specdec_tools.bench import add_target_args  # noqa: E402


def record(a) -> list[tuple[list[float], int, int]]:
    """(draft probabilities of a row's proposed tokens, tokens the target accepted, round) per round and row."""
    from specdec.engine import EngineConfig, LLMEngine
    from specdec.prompts import encode_chat
    from specdec.proposers import draft_model
    from specdec.sampling import SamplingParams
    from specdec.target_worker import TargetWorker
    from specdec_tools.bench import draft_factories, load_demo_target
    tok, model, dtype = load_demo_target(a)
    make = dict(draft_factories("smollm2-eagle", model, dtype))["eagle"]
    eng = LLMEngine(TargetWorker(model, a.batch, 2048), make(a.batch), tok,
                    EngineConfig(max_batch_size=a.batch, adaptive=False, num_speculative_tokens=a.k))
    confs: dict[int, list[float]] = {}
    choose = draft_model.DraftModelProposer._choose

    def recording_choose(self, logits, rows, batch, step):  # the draft's probability of its own pick
        top = torch.softmax(logits.float(), -1).max(-1).values.cpu()
        for r, i in enumerate(rows):
            confs.setdefault(batch.seq_ids[i], []).append(float(top[r]))
        return choose(self, logits, rows, batch, step)

    records, rounds = [], [0]
    verify = eng._verify

    def recording_verify(plan, draft):
        out = verify(plan, draft)
        for i, sid in enumerate(plan.draft_batch.seq_ids):
            if draft.num_draft[i]:
                records.append((confs.get(sid, [])[: draft.num_draft[i]], out.num_accepted[i], rounds[0]))
        confs.clear()
        rounds[0] += 1
        return out

    draft_model.DraftModelProposer._choose, eng._verify = recording_choose, recording_verify
    try:
        questions = [q for s in a.sets.split(",") for q in PROMPT_SETS[s]]
        prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in questions]
        eng.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True))
    finally:
        draft_model.DraftModelProposer._choose = choose
    return records


def kept(confs: list[float], tau: float, k: int) -> int:
    """Tokens kept of a chain cut at the first position (after the first) whose cumulative probability < tau."""
    n, cum = 0, 1.0
    for j, p in enumerate(confs[:k]):
        cum *= p
        if j > 0 and cum < tau:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="everyday,tasks", help="http_bench prompt sets")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=4, help="drafted per row and round (the longest chain studied)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--fixed-ms", type=float, default=33.5, help="verify cost per round")
    ap.add_argument("--per-position-ms", type=float, default=1.64, help="verify cost per row position")
    add_target_args(ap)
    a = ap.parse_args()
    records = record(a)
    B, F, c, n = a.batch, a.fixed_ms, a.per_position_ms, len(records)
    plain = B / (F + c * B)
    by_round: dict[int, list[int]] = {}
    for i, (_, _, r) in enumerate(records):
        by_round.setdefault(r, []).append(i)
    print(f"\n{n} row-rounds, batch {B}, verify cost {F} ms + {c} ms per position")
    print("| chain | tau | drafted / row-round | accepted / row-round | vs plain, ragged verify | vs plain, padded verify |")
    print("|---|---|---|---|---|---|")
    for k in range(1, a.k + 1):
        for tau in (0.0, 0.1, 0.2, 0.3, 0.4):
            if k == 1 and tau:
                continue
            lens = [kept(cf, tau, k) for cf, _, _ in records]
            dr = sum(lens) / n
            ac = sum(min(acc, L) for (_, acc, _), L in zip(records, lens)) / n
            ragged = (1 + ac) * B / (F + c * B * (1 + dr)) / plain
            pad = sum(len(rows) * max(lens[i] for i in rows) for rows in by_round.values()) / n  # per row-round
            padded = (1 + ac) * B / (F + c * B * (1 + pad)) / plain
            print(f"| k {k} | {tau} | {dr:.2f} | {ac:.2f} | {ragged:.3f}x | {padded:.3f}x |")


if __name__ == "__main__":
    main()
