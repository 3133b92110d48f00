"""How much an EAGLE draft loses on topics it was not trained on.

    python bench/draft_topics.py                                    # the shipped draft
    python bench/draft_topics.py --drafts smollm2-eagle,/path/to/eagle --ks 1,3

Greedy acceptance through the engine (float32, fixed k, `specdec_tools.distill.evaluate.acceptance`)
on the same task templates (specdec_tools.distill.chat.TASKS) about three kinds of topic:

- *held-out, first list*: the held-out topics of TOPICS (the distillation card's "generic" set);
- *held-out, second list*: the held-out topics of MORE_TOPICS (no run trains on them either);
- *training topics, new tasks*: training topics of TOPICS with task prompts that no training seed
  (0-2) wrote, so the prompt is new and only the topic was seen.

The gap between the last and the first two is what an unseen topic costs; a draft trained on more
topics should close it without losing on the third.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def topic_sets(n: int) -> dict[str, list]:
    """n chat items per kind of topic (see the module docstring)."""
    from specdec_tools.distill import chat
    from specdec_tools.distill.evaluate import generic_prompts
    train = chat.split_topics(15)[0]
    seen = {str(it.messages) for seed in (0, 1, 2) for it in chat.seed_prompts(train, seed)}
    fresh = {str(it.messages): it for seed in (7, 8, 9) for it in chat.seed_prompts(train, seed)
             if it.kind == "task" and str(it.messages) not in seen}
    return {"held-out, first list": generic_prompts(n), "held-out, second list": generic_prompts(n, topic_set="more"),
            "training topics, new tasks": list(fresh.values())[:n]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafts", default="smollm2-eagle", help="comma-separated EAGLE drafts")
    ap.add_argument("--ks", default="1,3")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per kind of topic")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    from tqdm import tqdm

    from specdec.eagle_draft import load_eagle
    from specdec.loader import load_model, load_tokenizer
    from specdec.prompts import encode_chat
    from specdec_tools.distill.evaluate import acceptance
    torch.set_num_threads(a.threads)
    tok, target = load_tokenizer(a.target), load_model(a.target, dtype=torch.float32)
    sets = {name: [encode_chat(tok, list(it.messages)) for it in items] for name, items in topic_sets(a.prompts).items()}
    drafts, ks = a.drafts.split(","), [int(k) for k in a.ks.split(",")]
    rows = []
    bar = tqdm(total=len(drafts) * len(ks) * len(sets), desc="draft_topics", unit="run", dynamic_ncols=True)
    for d in drafts:
        draft = load_eagle(d, target, torch.float32)
        for k in ks:
            cells = []
            for prompts in sets.values():
                stats, _ = acceptance(target, draft, None, tok, prompts, k, a.max_tokens)
                cells.append(f"{stats.acceptance_rate:.3f} ({stats.mean_accepted_length:.2f})")
                bar.update()
            rows.append(f"| {d} | {k} | " + " | ".join(cells) + " |")
    bar.close()
    print(f"\nGreedy acceptance (mean accepted length), float32, {a.prompts} prompts per set, {a.max_tokens} tokens\n")
    print("| draft | k | " + " | ".join(sets) + " |")
    print("|---|---|" + "---|" * len(sets))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
