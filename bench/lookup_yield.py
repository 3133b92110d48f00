"""How many tokens a target forward yields from prompt lookup, exactly, on the target's own answers.

    python bench/lookup_yield.py [--temperatures 0,0.7,1.0] [--lookups 4,8] [--max-tokens 256]

Prompt lookup inside multi-step plain rounds keeps a lookup token only where it equals the
target's own token at that position (greedy: the argmax; sampled: its draw with that position's
uniform, `coupled_verify`), so the answer is plain decoding's, and the lookups a forward keeps are
exactly the leading lookup tokens that equal the answer's next tokens. This script generates plain
answers (bf16, seeded, stopping at EOS) to the HTTP benchmark's everyday and tasks questions and
replays them: tokens per forward = answer tokens / forwards, for each temperature and `lookup_k`
(no timing: what lookups can give before their extra positions are paid).
"""
from __future__ import annotations

import argparse
import os
import sys

from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from http_bench import QUESTIONS, TASKS  # noqa: E402

from specdec.engine import EngineConfig, LLMEngine  # noqa: E402
from specdec.prompts import encode_chat  # noqa: E402
from specdec.proposers.ngram import ngram_lookup  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--lookups", default="4,8", help="lookup_k values")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
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


if __name__ == "__main__":
    main()
