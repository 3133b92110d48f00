"""How often the target's next token is among an EAGLE draft's top-n at its first draft step.

    python bench/draft_topk.py                                # the shipped draft, 64 tokens per question
    python bench/draft_topk.py --draft /path/to/eagle --max-tokens 128

The target decodes each question of bench/http_bench.py greedily (float32); one teacher-forced pass
of the draft over the target's features then gives, at every generated position, the draft's
first-step distribution. Top-1 is first-step greedy acceptance; top-2 and top-3 bound what a tree
with that many siblings at depth 1 (one target pass over all of them, SpecInfer / EAGLE-2) could
accept there.

With `--temperatures`, the target samples each continuation at temperature T instead (seeded) and
the table gives the draft's expected first-step acceptance under sampling, sum_x min(p(x), q(x)),
with q the draft's distribution at T truncated to its top J tokens and renormalized, as sampled
drafting uses it (`specdec.proposers.base.TOP_J`): what a wider q is worth.
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
    ap.add_argument("--temperatures", help="e.g. 0.7,1.0: expected sampled acceptance by q's width instead")
    ap.add_argument("--top-j", default="1,32,128,512,8192", help="q widths for --temperatures")
    ap.add_argument("--draft-scales", default="1.0",
                    help="with --temperatures: the draft samples at T x each scale (q sharper below 1, flatter above)")
    ap.add_argument("--questions", type=int, default=0, help="first n questions of each set (0: all)")
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
    sets = {name: qs[: a.questions or None] for name, qs in PROMPT_SETS.items()}

    def first_steps(question: str, i: int, temperature: float):
        """The target's continuation x, the prompt's length, its logits and the draft's first-step
        logits: g[p] drafts x[p + 2], which the target's logits at p + 1 judge."""
        prompt = encode_chat(tok, [{"role": "user", "content": question}])
        out = eng.generate([prompt], SamplingParams(max_tokens=a.max_tokens, temperature=temperature, seed=i,
                                                    ignore_eos=True))
        x = prompt + out[0].output_ids
        target.setup_cache(1, max_len)
        with torch.inference_mode():
            logits, hidden = run_ragged(target, [x], [0], [0], [len(x)], return_hidden=True, n_hidden=[len(x)])
            g, _ = draft.forward_train(hidden[0][None, :-1].float(), torch.tensor(x[1:])[None])
            return x, len(prompt), logits[0].float(), draft.lm_head(g[0]).float()  # [len, V], [len - 1, V_draft]

    if a.temperatures:
        return sampled_overlap(a, sets, first_steps, draft.token_map)
    rows = []
    for name, questions in sets.items():
        hits, n = torch.zeros(3), 0
        for i, q in enumerate(tqdm(questions, desc=name)):
            x, n_prompt, _, d_logits = first_steps(q, i, 0.0)
            top = draft.token_map[d_logits.topk(3, -1).indices]  # [len - 1, 3]
            for p in range(n_prompt - 1, len(x) - 2):
                hits += torch.tensor([x[p + 2] in top[p, :j + 1].tolist() for j in range(3)], dtype=torch.float)
                n += 1
        rows.append((name, len(questions), *(hits / max(1, n)).tolist(), n))
    print(f"\nfirst draft step of {a.draft} against {a.target}'s greedy continuation, {a.max_tokens} tokens")
    print("| questions | top-1 | top-2 | top-3 | positions |")
    print("|---|---|---|---|---|")
    for name, nq, t1, t2, t3, n in rows:
        print(f"| {name} ({nq}) | {t1:.3f} | {t2:.3f} | {t3:.3f} | {n} |")


def sampled_overlap(a, sets, first_steps, token_map):
    """Expected first-step acceptance of sampled drafting, sum_x min(p, q_J), by q's width J."""
    widths = [int(j) for j in a.top_j.split(",")]
    scales = [float(v) for v in a.draft_scales.split(",")]
    rows = []
    for t in (float(v) for v in a.temperatures.split(",")):
        for name, questions in sets.items():
            acc, n = torch.zeros(len(scales), len(widths)), 0
            for i, q in enumerate(tqdm(questions, desc=f"{name} T={t}")):
                x, n_prompt, logits, d_logits = first_steps(q, i, t)
                for p in range(n_prompt - 1, len(x) - 2):
                    p_target = torch.softmax(logits[p + 1] / t, -1)  # [V]
                    for s, scale in enumerate(scales):
                        q_draft = torch.softmax(d_logits[p] / (t * scale), -1)  # [V_draft]
                        vals, ids = q_draft.topk(min(max(widths), len(q_draft)))  # sorted: each width a prefix
                        for j, width in enumerate(widths):
                            v = vals[:width]
                            acc[s, j] += torch.minimum(p_target[token_map[ids[:width]]], v / v.sum()).sum()
                    n += 1
            for s, scale in enumerate(scales):
                rows.append((t, scale, name, len(questions), *(acc[s] / max(1, n)).tolist(), n))
    print(f"\nexpected first-step acceptance of {a.draft}'s sampled drafts against {a.target}, by q's width J "
          f"and the draft's temperature scale (the target's sampled continuation, {a.max_tokens} tokens)")
    print("| T | draft at T x | questions | " + " | ".join(f"J = {w}" for w in widths) + " | positions |")
    print("|---|---|---|" + "---|" * len(widths) + "---|")
    for t, scale, name, nq, *vals, n in rows:
        print(f"| {t} | {scale} | {name} ({nq}) | " + " | ".join(f"{v:.3f}" for v in vals) + f" | {n} |")


if __name__ == "__main__":
    main()
