"""How often the target's next token is among an EAGLE draft's top-n at its first draft step.

    python bench/draft_topk.py                                # the shipped draft, 64 tokens per question
    python bench/draft_topk.py --draft /path/to/eagle --max-tokens 128

The target decodes each question of bench/http_bench.py greedily (float32); one teacher-forced pass
of the draft over the target's features then gives, at every generated position, the draft's
first-step distribution. Top-1 is first-step greedy acceptance; top-2 and top-3 bound what a tree
with that many siblings at depth 1 (one target pass over all of them, SpecInfer / EAGLE-2) could
accept there.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from http_bench import PROMPT_SETS  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default="smollm2-eagle")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    from specdec.eagle_draft import load_eagle
    from specdec.engine import EngineConfig, LLMEngine
    from specdec.loader import load_model, load_tokenizer
    from specdec.prompts import encode_chat
    from specdec.runner import run_ragged
    from specdec.sampling import SamplingParams
    from specdec.target_worker import TargetWorker
    torch.set_num_threads(a.threads)
    tok, target = load_tokenizer(a.target), load_model(a.target, dtype=torch.float32)
    draft = load_eagle(a.draft, target, dtype=torch.float32)
    target.feature_layers = draft.feature_layers  # an EAGLE-3 draft reads the taps of these layers too
    max_len = 1024
    eng = LLMEngine(TargetWorker(target, 1, max_len), None, tok,
                    EngineConfig(max_batch_size=1, max_model_len=max_len, speculate=False))
    rows = []
    for name, questions in PROMPT_SETS.items():
        hits, n = torch.zeros(3), 0
        for q in tqdm(questions, desc=name):
            prompt = encode_chat(tok, [{"role": "user", "content": q}])
            out = eng.generate([prompt], SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True))
            x = prompt + out[0].output_ids
            target.setup_cache(1, max_len)
            with torch.inference_mode():
                _, hidden = run_ragged(target, [x], [0], [0], [len(x)], return_hidden=True, n_hidden=[len(x)])
                g, _ = draft.forward_train(hidden[0][None, :-1].float(), torch.tensor(x[1:])[None])
                top = draft.token_map[draft.lm_head(g[0]).topk(3, -1).indices]  # [len - 1, 3]: g[p] drafts x[p + 2]
            for p in range(len(prompt) - 1, len(x) - 2):
                hits += torch.tensor([x[p + 2] in top[p, :j + 1].tolist() for j in range(3)], dtype=torch.float)
                n += 1
        rows.append((name, len(questions), *(hits / max(1, n)).tolist(), n))
    print(f"\nfirst draft step of {a.draft} against {a.target}'s greedy continuation, {a.max_tokens} tokens")
    print("| questions | top-1 | top-2 | top-3 | positions |")
    print("|---|---|---|---|---|")
    for name, nq, t1, t2, t3, n in rows:
        print(f"| {name} ({nq}) | {t1:.3f} | {t2:.3f} | {t3:.3f} | {n} |")


if __name__ == "__main__":
    main()
