"""How many tokens a target forward yields from prompt lookup, exactly, on the target's own answers.

    python bench/lookup_yield.py [--temperatures 0,0.7,1.0] [--lookups 4,8] [--max-tokens 256]
    python bench/lookup_yield.py --corpus smollm2-corpus  # also with the corpus's lookups
    python bench/lookup_yield.py --timed-batches 1,4      # also tokens/s in process, greedy

Prompt lookup inside multi-step plain rounds keeps a lookup token only where it equals the
target's own token at that position (greedy: the argmax; sampled: its draw with that position's
uniform, `coupled_verify`), so the answer is plain decoding's, and the lookups a forward keeps are
exactly the leading lookup tokens that equal the answer's next tokens. This script generates plain
answers (bf16, seeded, stopping at EOS) to the HTTP benchmark's questions (`--prompts`: everyday
and tasks by default) and replays them: tokens per forward = answer tokens / forwards, for each temperature and `lookup_k`,
prompt lookup alone and, with `--corpus`, continued from that corpus (specdec/corpus.py) (no timing: what lookups can give before their extra positions are paid). `--timed-batches`
then runs plain 8-step rounds with each configuration (and without lookups) on the same questions
and the coding ones, greedy, batch by batch with the configurations alternating, and prints tokens/s
(every configuration's answers must equal plain decoding's).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from http_bench import CODING, PROMPT_SETS  # noqa: E402

from specdec.engine import EngineConfig, LLMEngine  # noqa: E402
from specdec.prompts import encode_chat  # noqa: E402
from specdec.corpus import NgramCorpus  # noqa: E402
from specdec.loader import resolve_corpus  # noqa: E402
from specdec.proposers.ngram import NgramProposer  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.target_worker import TargetWorker, lookup_draft  # noqa: E402
from specdec_tools.bench import add_target_args, load_demo_target  # noqa: E402


def forwards(tokens: list[int], prompt_len: int, lookup_k: int, corpus: NgramCorpus | None = None) -> int:
    """Target forwards that emit tokens[prompt_len:] when each verifies up to lookup_k lookups."""
    n, end, count = prompt_len, len(tokens), 0
    while n < end:
        drafts = lookup_draft(tokens[:n], min(lookup_k, end - n - 1), corpus) if end - n > 1 else []
        kept = 0
        while kept < len(drafts) and tokens[n + kept] == drafts[kept]:
            kept += 1
        n, count = n + kept + 1, count + 1
    return count


Config = tuple[int, "NgramCorpus | None"]  # (lookup_k, corpus)
NAMES: dict[int, str] = {}  # id(corpus) -> its name in the tables, when several are compared


def label(cfg: Config) -> str:
    return f"lookup_k {cfg[0]}" + ("" if cfg[1] is None else f" + {NAMES.get(id(cfg[1]), 'corpus')}")


def timed(model, tok, prompts, configs: list[Config], batch: int, max_tokens: int) -> list[float]:
    """Greedy tokens/s of plain 8-step rounds without lookups, then with each configuration,
    alternating per batch."""
    def run(cfg, ps):
        eng = LLMEngine(TargetWorker(model, batch, 2048, corpus=cfg[1]), NgramProposer(), tok,
                        EngineConfig(max_batch_size=batch, max_model_len=2048, num_speculative_tokens=0,
                                     plain_steps=8, lookup_k=cfg[0], lookup_max_batch=batch))
        t0 = time.perf_counter()
        out = [s.output_ids for s in eng.generate(ps, SamplingParams(max_tokens=max_tokens, temperature=0))]
        return out, time.perf_counter() - t0

    configs = [(0, None)] + configs
    run(configs[-1], prompts[:1])  # warm up
    tot = [[0, 0.0] for _ in configs]
    for n, i in enumerate(tqdm(range(0, len(prompts), batch), desc=f"timed, batch {batch}")):
        ps, ref = prompts[i:i + batch], None
        for c in range(len(configs)) if n % 2 == 0 else reversed(range(len(configs))):
            out, dt = run(configs[c], ps)
            if ref is not None and out != ref:
                raise AssertionError(f"{label(configs[c])}: output differs from the other configurations")
            ref = out
            tot[c][0] += sum(map(len, out))
            tot[c][1] += dt
    return [n / t for n, t in tot]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--lookups", default="4,8", help="lookup_k values")
    ap.add_argument("--corpus", help="also continue lookups from this corpus (a path or a shipped name; "
                                     "several, comma-separated, are compared in one run)")
    ap.add_argument("--prompts", default="tasks,everyday", help=f"question sets, of {sorted(PROMPT_SETS)}")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="batch of the answers' generation")
    ap.add_argument("--timed-batches", default="", help="also time lookups in process at these batch sizes")
    add_target_args(ap)
    a = ap.parse_args()
    tok, model, dtype = load_demo_target(a)
    sets = a.prompts.split(",")
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for s in sets for q in PROMPT_SETS[s]]
    temps = [float(t) for t in a.temperatures.split(",")]
    corpora = [NgramCorpus.load(resolve_corpus(c)) for c in a.corpus.split(",")] if a.corpus else []
    if len(corpora) > 1:
        NAMES.update({id(c): f"corpus {name}" for c, name in zip(corpora, a.corpus.split(","))})
    configs = [(int(k), c) for c in [None, *corpora] for k in a.lookups.split(",")]
    rows = []
    for t in tqdm(temps, desc="answers per temperature"):
        eng = LLMEngine(TargetWorker(model, a.batch, 2048), None, tok,
                        EngineConfig(max_batch_size=a.batch, max_model_len=2048, speculate=False))
        seqs = eng.generate(prompts, [SamplingParams(max_tokens=a.max_tokens, temperature=t, seed=i)
                                      for i in range(len(prompts))])
        out = sum(s.num_output for s in seqs)
        rows.append((t, out, [out / sum(forwards(s.tokens, s.prompt_len, *cfg) for s in seqs) for cfg in configs]))
    print(f"\nlookups, tokens per target forward, {len(prompts)} questions ({', '.join(sets)}), "
          f"up to {a.max_tokens} tokens at EOS, {dtype}")
    print("| temperature | answer tokens | " + " | ".join(map(label, configs)) + " |")
    print("|---|---|" + "---|" * len(configs))
    for t, out, ys in rows:
        print(f"| {t:g} | {out} | " + " | ".join(f"{y:.3f}" for y in ys) + " |")
    if a.timed_batches:
        timed_prompts = prompts + ([encode_chat(tok, [{"role": "user", "content": q}]) for q in CODING]
                                   if "coding" not in sets else [])
        print(f"\nplain 8-step rounds with lookups, in process, greedy, {len(timed_prompts)} questions "
              f"({', '.join(sets + (['coding'] if 'coding' not in sets else []))}), up to {a.max_tokens} tokens at EOS, {dtype}")
        print("| batch | no lookup tok/s | " + " | ".join(map(label, configs)) + " |")
        print("|---|---|" + "---|" * len(configs))
        for b in map(int, a.timed_batches.split(",")):
            tps = timed(model, tok, timed_prompts, configs, b, a.max_tokens)
            print(f"| {b} | {tps[0]:.1f} | " + " | ".join(f"{x:.1f} ({x / tps[0]:.2f}x)" for x in tps[1:]) + " |")


if __name__ == "__main__":
    main()
