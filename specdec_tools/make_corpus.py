"""`specdec-corpus`: a lookup corpus (specdec.corpus) from the target's own answers.

    specdec-corpus --answers WORK_DIR --target smollm2 --out specdec/drafts/smollm2-corpus/corpus.npz

Reads every `*.jsonl` of answers in WORK_DIR (as the distillation writes them: rows with
`prompt`, `output` and `temperature`, e.g. `specdec-distill --arch eagle`'s work directory),
keeps the answers sampled at `--temperatures`, and writes each as the last `--prompt-tail`
tokens of its prompt (the chat template's assistant header: what an answer starts after)
followed by the answer. Only training prompts belong there: a corpus made from the answers to
the questions you evaluate on measures nothing.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tqdm import tqdm

from specdec.corpus import NgramCorpus
from specdec_tools.distill.answers import iter_jsonl


def read_answers(work: Path, temperatures: set[float], prompt_tail: int) -> list[list[int]]:
    answers = []
    for f in sorted(work.glob("*.jsonl")):
        for r in tqdm(iter_jsonl(f), desc=f.name, unit=" rows"):  # a partial last line (a cut write) is skipped
            if "output" in r and "prompt" in r and float(r.get("temperature", 0.0)) in temperatures:
                answers.append(r["prompt"][-prompt_tail:] + r["output"] if prompt_tail else r["output"])
    return answers


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="specdec-corpus", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--answers", required=True, type=Path, help="directory of answer .jsonl files")
    ap.add_argument("--target", default="smollm2", help="the target that wrote them (for its vocabulary size)")
    ap.add_argument("--out", required=True, type=Path, help="corpus .npz to write")
    ap.add_argument("--temperatures", default="0,0.7", help="keep answers sampled at these temperatures")
    ap.add_argument("--prompt-tail", type=int, default=6, help="prompt tokens kept before each answer")
    a = ap.parse_args(argv)
    from specdec.loader import materialize, resolve
    from specdec.model import ModelArgs
    from transformers import AutoConfig

    vocab = ModelArgs.from_hf_config(AutoConfig.from_pretrained(materialize(resolve(a.target)).path)).vocab_size
    answers = read_answers(a.answers, {float(t) for t in a.temperatures.split(",")}, a.prompt_tail)
    if not answers:
        raise SystemExit(f"no answers at temperatures {a.temperatures} in {a.answers}/*.jsonl")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    NgramCorpus.save(a.out, answers, vocab)
    c = NgramCorpus.load(a.out)
    print(f"{a.out}: {len(answers)} answers, {c.num_tokens} tokens, {len(c)} contexts, "
          f"{a.out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
