"""Lookups in multi-step plain rounds, with and without the adaptive gate (specdec.adaptive.LookupGate).

    python bench/lookup_gate.py [--batches 4,8] [--temperatures 0,0.7,1.0] [--repeats 2]

In process, bf16 (the CPU default where it is fast), the demo target with its shipped lookup corpus,
answers of 64 tokens (EOS ignored) to the HTTP benchmark's fresh and everyday questions, lanes of
`batch` rows through one engine per configuration (its cost model persists across lanes, as a
router's does; one warm-up lane first), configurations alternated per repetition:

- plain: multi-step plain rounds, no lookups (the service with speculation off);
- always: every multi-step round carries `lookup_k` lookups (the configured behaviour, gate off);
- gated: the adaptive policy's LookupGate decides per round from measured times and gains;
- draft, draft always: as gated and always, with the shipped EAGLE draft in the target's process
  drafting rows that prompt lookup finds nothing for (the service's default: `--draft-k` tokens
  for sampled rows, `--greedy-draft-k` for greedy ones).

A lookup widens each forward of the round and pays only with the tokens it gets accepted: greedy
rows accept far more of them than rows sampled at temperature 1.0, so the gate should keep
lookups for the first and drop them for the second where the wider forwards cost more than they
bring. Tokens/s are the mean over repetitions; ratios against plain decoding in the same run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from http_bench import PROMPT_SETS  # noqa: E402

from specdec import adaptive  # noqa: E402
from specdec.corpus import NgramCorpus  # noqa: E402
from specdec.eagle_draft import load_eagle  # noqa: E402
from specdec.engine import EngineConfig, LLMEngine  # noqa: E402
from specdec.loader import bundled_corpus_for, load_model, load_tokenizer, resolve_corpus  # noqa: E402
from specdec.prompts import encode_chat  # noqa: E402
from specdec.proposers import EagleProposer, NgramProposer  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.target_worker import TargetWorker  # noqa: E402

MODES = ("plain", "always", "gated", "draft", "draft always")
GATE_USE = adaptive.LookupGate.use


def _gate(on: bool) -> None:
    adaptive.LookupGate.use = GATE_USE if on else (lambda self, batch, gains: True)


def demo_target(threads: int):
    """The demo target in bf16 (the CPU default where it is fast), its tokenizer and its shipped lookup corpus."""
    torch.set_num_threads(threads)
    tok, model = load_tokenizer("smollm2"), load_model("smollm2", dtype=torch.bfloat16)
    return tok, model, NgramCorpus.load(resolve_corpus(bundled_corpus_for("smollm2")))


def make_engine(model, tok, corpus, batch: int, mode: str, lookup_k: int, eagle=None, draft_k: int = 2,
                greedy_draft_k: int = 3) -> LLMEngine:
    lk = 0 if mode == "plain" else lookup_k
    drafter = EagleProposer(eagle, batch, 2048) if mode.startswith("draft") else None
    worker = TargetWorker(model, batch, 2048, corpus=corpus, drafter=drafter, draft_k=draft_k,
                          greedy_draft_k=greedy_draft_k)
    return LLMEngine(worker, NgramProposer(), tok,
                     EngineConfig(max_batch_size=batch, num_speculative_tokens=0, adaptive=True, speculate=lk > 0,
                                  plain_steps=8, lookup_k=lk, lookup_max_batch=batch, ngram_k=8 if lk and batch == 1 else 0))


def run(eng: LLMEngine, prompts, batch: int, temperature: float, max_tokens: int) -> float:
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        seqs = eng.generate(prompts[i:i + batch], SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                                 ignore_eos=True))
        tokens += sum(len(s.output_ids) for s in seqs)
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="4,8")
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lookup-k", type=int, default=2, help="the app's default with a corpus")
    ap.add_argument("--draft-k", type=int, default=2, help="in-target draft chain, sampled rows")
    ap.add_argument("--greedy-draft-k", type=int, default=3, help="in-target draft chain, greedy rows")
    ap.add_argument("--modes", default=",".join(MODES), help="which of them (plain, the reference, must be one)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    tok, model, corpus = demo_target(a.threads)
    eagle = load_eagle("smollm2-eagle", model, torch.bfloat16)
    modes = a.modes.split(",")
    questions = PROMPT_SETS["fresh"][:16] + PROMPT_SETS["everyday"][:8]
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in questions]
    warm, timed = prompts[:8], prompts[8:]
    batches, temps = [int(b) for b in a.batches.split(",")], [float(t) for t in a.temperatures.split(",")]
    bar = tqdm(total=len(batches) * len(temps) * (a.repeats + 1) * len(modes), desc="lookup gate")
    rows = []
    for batch in batches:
        for temp in temps:
            engines = {m: make_engine(model, tok, corpus, batch, m, a.lookup_k, eagle, a.draft_k,
                                      a.greedy_draft_k) for m in modes}
            tps = {m: [] for m in modes}
            for rep in range(a.repeats + 1):
                for m in (modes if rep % 2 == 0 else modes[::-1]):
                    _gate(m == "gated" or m.startswith("draft") and "always" not in m)
                    r = run(engines[m], warm[:batch] if rep == 0 else timed, batch, temp, a.max_tokens)
                    if rep:
                        tps[m].append(r)
                    bar.update()
            _gate(True)
            rows.append((batch, temp, {m: sum(v) / len(v) for m, v in tps.items()}, engines))
    bar.close()
    print(f"\nlookups in 8-step plain rounds, bf16, lookup_k {a.lookup_k} + the shipped corpus, {a.max_tokens} tokens, "
          f"{len(timed)} questions x {a.repeats} repetitions")
    print("| batch | temperature | mode | tok/s | vs plain | lookup tokens accepted of proposed | "
          "gate: cost of a lookup forward, rounds without |")
    print("|---|---|---|---|---|---|---|")
    for batch, temp, t, engines in rows:
        for m, eng in engines.items():
            s, gate = eng.stats, eng.scheduler.cost.lookups
            cost = gate.cost(batch)
            print(f"| {batch} | {temp} | {m} | {t[m]:.1f} | {t[m] / t['plain']:.2f}x | "
                  f"{s.lookup_accepted}/{s.lookup_proposed} | "
                  f"{'-' if cost is None else f'{cost:.2f}x'}, {gate.gated} of {sum(gate.rounds.values())} |")


if __name__ == "__main__":
    main()
