"""How often the shipped draft's first token matches the target's sampled token, by coupling.

    python bench/race_coupling.py [--temperatures 0.7,1.0] [--questions 10] [--noise 128]

The demo target in bf16 answers everyday questions by plain sampling (64 tokens, EOS ignored);
over those answers, at every position, the target's distribution p and the shipped EAGLE draft's
first-step distribution q (teacher forced on the target's features, at the same temperature) give:

- sum min(p, q): the acceptance of rejection sampling (Leviathan et al. 2023), the most any
  coupling of a draft token with the target's token reaches;
- p(argmax q): a deterministic draft (the draft's greedy token) checked against the target's own
  draw, as seeded rows' in-target chains are;
- race: draft and target each pick the winner of the exponential race with the same noise
  (`sampling.race_noise` keyed by a fresh uniform, `race_sample`), as unseeded rows' chains are;
  averaged over --noise uniforms per position.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from draft_in_target import make_engine  # noqa: E402
from http_bench import PROMPT_SETS  # noqa: E402
from lookup_gate import demo_target  # noqa: E402

from specdec.eagle_draft import load_eagle  # noqa: E402
from specdec.prompts import encode_chat  # noqa: E402
from specdec.sampling import SamplingParams, race_noise, race_sample  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--noise", type=int, default=128, help="race noise draws per position")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    tok, model, corpus = demo_target(a.threads)
    eagle = load_eagle("smollm2-eagle", model, torch.bfloat16)
    plain = make_engine(model, tok, corpus, eagle, "plain")
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in PROMPT_SETS["everyday"][: a.questions]]
    tmap, V = eagle.token_map, model.args.vocab_size
    gen = torch.Generator().manual_seed(0)
    print("| T | positions | sum min(p, q) | p(argmax q) | race |\n|---|---|---|---|---|")
    for t in (float(x) for x in a.temperatures.split(",")):
        tot = {"summin": 0.0, "argmax": 0.0, "race": 0.0}
        n = 0
        for i, p in enumerate(tqdm(prompts, desc=f"T={t}")):
            out = plain.generate([p], SamplingParams(max_tokens=64, temperature=t, seed=i, ignore_eos=True))[0].output_ids
            seq = torch.tensor([p + out])
            with torch.inference_mode():
                model.setup_cache(1, seq.shape[1] + 8)
                logits, f = model(seq, torch.tensor([0]), torch.tensor([0]), n_logits=seq.shape[1],
                                  n_hidden=seq.shape[1])
                g, _ = eagle.forward_train(f[:, :-1], seq[:, 1:])  # g at q drafts token q + 2
                ql = eagle.lm_head(g).float()[0]
            for pos in range(len(p) - 1, seq.shape[1] - 2):
                P = torch.softmax(logits[0, pos + 1] / t, -1)  # the target's token q + 2
                Q = torch.softmax(ql[pos] / t, -1)
                tot["summin"] += torch.minimum(P[tmap], Q).sum().item()
                tot["argmax"] += P[tmap[Q.argmax()]].item()
                E = race_noise(torch.rand(a.noise, dtype=torch.float64, generator=gen), V)  # [noise, V]
                tot["race"] += (race_sample(P.expand(a.noise, -1), E) == tmap[race_sample(Q.expand(a.noise, -1), E[:, tmap])]
                                ).float().mean().item()
                n += 1
        print(f"| {t} | {n} | {tot['summin'] / n:.3f} | {tot['argmax'] / n:.3f} | {tot['race'] / n:.3f} |")


if __name__ == "__main__":
    main()
