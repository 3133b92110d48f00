"""How many tokens a target forward yields from prompt lookup, exactly, on the target's own answers.

    python bench/lookup_yield.py [--temperatures 0,0.7,1.0] [--lookups 4,8] [--max-tokens 256]
    python bench/lookup_yield.py --timed-batches 1,4      # also tokens/s in process, greedy

Prompt lookup inside multi-step plain rounds keeps a lookup token only where it equals the
target's own token at that position (greedy: the argmax; sampled: its draw with that position's
uniform, `coupled_verify`), so the answer is plain decoding's, and the lookups a forward keeps are
exactly the leading lookup tokens that equal the answer's next tokens. This script generates plain
answers (bf16, seeded, stopping at EOS) to the HTTP benchmark's everyday and tasks questions and
replays them: tokens per forward = answer tokens / forwards, for each temperature and `lookup_k`
(no timing: what lookups can give before their extra positions are paid). `--timed-batches`
then runs plain 8-step rounds with each `lookup_k` (and without lookups) on the same questions and
the coding ones, greedy, batch by batch with the configurations alternating, and prints tokens/s
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

from http_bench import CODING, QUESTIONS, TASKS  # noqa: E402

from specdec.engine import EngineConfig, LLMEngine  # noqa: E402
from specdec.prompts import encode_chat  # noqa: E402
from specdec.proposers.ngram import NgramProposer, ngram_lookup  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.target_worker import LOOKUP_NGRAM, TargetWorker  # noqa: E402
from specdec_tools.bench import add_target_args, load_demo_target  # noqa: E402


def forwards(tokens: list[int], prompt_len: int, lookup_k: int) -> int:
    """Target forwards that emit tokens[prompt_len:] when each verifies up to lookup_k lookups."""
    n, end, count = prompt_len, len(tokens), 0
    while n < end:
        drafts = ngram_lookup(tokens[:n], min(lookup_k, end - n - 1), *LOOKUP_NGRAM) if end - n > 1 else []
        kept = 0
        while kept < len(drafts) and tokens[n + kept] == drafts[kept]:
            kept += 1
        n, count = n + kept + 1, count + 1
    return count


def timed(model, tok, prompts, lookups: list[int], batch: int, max_tokens: int) -> dict[int, float]:
    """Greedy tokens/s of plain 8-step rounds with each lookup_k (0: none), alternating per batch."""
    def run(lookup_k, ps):
        eng = LLMEngine(TargetWorker(model, batch, 2048), NgramProposer(), tok,
                        EngineConfig(max_batch_size=batch, max_model_len=2048, num_speculative_tokens=0,
                                     plain_steps=8, lookup_k=lookup_k, lookup_max_batch=batch))
        t0 = time.perf_counter()
        out = [s.output_ids for s in eng.generate(ps, SamplingParams(max_tokens=max_tokens, temperature=0))]
        return out, time.perf_counter() - t0

    run(lookups[-1], prompts[:1])  # warm up
    tot = {k: [0, 0.0] for k in [0] + lookups}
    for n, i in enumerate(tqdm(range(0, len(prompts), batch), desc=f"timed, batch {batch}")):
        ps, ref = prompts[i:i + batch], None
        for k in list(tot) if n % 2 == 0 else list(tot)[::-1]:
            out, dt = run(k, ps)
            if ref is not None and out != ref:
                raise AssertionError(f"lookup_k {k}: output differs from the other configurations")
            ref = out
            tot[k][0] += sum(map(len, out))
            tot[k][1] += dt
    return {k: n / t for k, (n, t) in tot.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--lookups", default="4,8", help="lookup_k values")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="batch of the answers' generation")
    ap.add_argument("--timed-batches", default="", help="also time lookups in process at these batch sizes")
    add_target_args(ap)
    a = ap.parse_args()
    tok, model, dtype = load_demo_target(a)
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in TASKS + QUESTIONS]
    temps = [float(t) for t in a.temperatures.split(",")]
    ks = [int(k) for k in a.lookups.split(",")]
    rows = []
    for t in tqdm(temps, desc="answers per temperature"):
        eng = LLMEngine(TargetWorker(model, a.batch, 2048), None, tok,
                        EngineConfig(max_batch_size=a.batch, max_model_len=2048, speculate=False))
        seqs = eng.generate(prompts, [SamplingParams(max_tokens=a.max_tokens, temperature=t, seed=i)
                                      for i in range(len(prompts))])
        out = sum(s.num_output for s in seqs)
        rows.append((t, out, [out / sum(forwards(s.tokens, s.prompt_len, k) for s in seqs) for k in ks]))
    print(f"\nprompt lookup, tokens per target forward, {len(prompts)} questions (tasks + everyday), "
          f"up to {a.max_tokens} tokens at EOS, {dtype}")
    print("| temperature | answer tokens | " + " | ".join(f"lookup_k {k}" for k in ks) + " |")
    print("|---|---|" + "---|" * len(ks))
    for t, out, ys in rows:
        print(f"| {t:g} | {out} | " + " | ".join(f"{y:.3f}" for y in ys) + " |")
    if a.timed_batches:
        coding = [encode_chat(tok, [{"role": "user", "content": q}]) for q in CODING]
        print(f"\nplain 8-step rounds with prompt lookup, in process, greedy, {len(prompts) + len(coding)} questions "
              f"(tasks, everyday, coding), up to {a.max_tokens} tokens at EOS, {dtype}")
        print("| batch | no lookup tok/s | " + " | ".join(f"lookup_k {k}" for k in ks) + " |")
        print("|---|---|" + "---|" * len(ks))
        for b in map(int, a.timed_batches.split(",")):
            tps = timed(model, tok, prompts + coding, ks, b, a.max_tokens)
            print(f"| {b} | {tps[0]:.1f} | " + " | ".join(f"{tps[k]:.1f} ({tps[k] / tps[0]:.2f}x)" for k in ks) + " |")


if __name__ == "__main__":
    main()
