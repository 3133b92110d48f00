"""`specdec-corpus`: a lookup corpus (specdec.corpus) from the target's own answers.

    specdec-corpus --answers WORK_DIR --target smollm2 --out specdec/drafts/smollm2-corpus/corpus.npz
    specdec-corpus --packed OLD_CORPUS.npz distill_data/smollm2/*.npz --exclude-prompts QUESTIONS.txt ...

Reads every `*.jsonl` of answers in WORK_DIR (as the distillation writes them: rows with
`prompt`, `output` and `temperature`, e.g. `specdec-distill --arch eagle`'s work directory) and
every `--packed` file (distillation data packed by `--pack-data`, or a corpus, whose segments are
taken whole), keeps the answers sampled at `--temperatures`, and writes each as the last
`--prompt-tail` tokens of its prompt (the chat template's assistant header: what an answer starts
after) followed by the answer, each distinct segment once. Only training prompts belong there: a
corpus made from the answers to the questions you evaluate on measures nothing, so packed answers
whose prompt names a held-out topic of the distillation's split (as its training drops them) or
contains a line of `--exclude-prompts` (case-insensitive) are dropped.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tqdm import tqdm

from specdec.corpus import NgramCorpus
from specdec_tools.distill.answers import iter_jsonl


def segment(answer: dict, prompt_tail: int) -> list[int]:
    """What the corpus holds of an answer: its prompt's last `prompt_tail` tokens, then the answer."""
    return answer["prompt"][-prompt_tail:] + answer["output"] if prompt_tail else answer["output"]


def read_answers(work: Path, temperatures: set[float], prompt_tail: int) -> list[list[int]]:
    answers = []
    for f in sorted(work.glob("*.jsonl")):
        for r in tqdm(iter_jsonl(f), desc=f.name, unit=" rows"):  # a partial last line (a cut write) is skipped
            if "output" in r and "prompt" in r and float(r.get("temperature", 0.0)) in temperatures:
                answers.append(segment(r, prompt_tail))
    return answers


def read_packed(paths: list[Path], temperatures: set[float], prompt_tail: int, tokenizer,
                excluded: list[str], heldout_chat_pct: int = 15) -> list[list[int]]:
    """Segments of packed files (specdec_tools.distill.packed): a corpus's whole, the answers'
    at `temperatures` after their prompts' tails, less those whose prompt holds an `excluded` text
    or names a held-out chat topic (`heldout_chat_pct`: the distillation's split)."""
    from specdec_tools.distill.eagle_cli import held_out_free
    from specdec_tools.distill.packed import unpack
    answers = []
    for path in paths:
        records = unpack(path)
        records = [r for r in records if r["kind"] == "corpus"] + held_out_free(
            [r for r in records if r["kind"] != "corpus"], tokenizer, heldout_chat_pct)
        for r in tqdm(records, desc=path.name, unit=" answers"):
            if r["kind"] == "corpus":  # (already a segment, prompt tail included)
                answers.append(r["output"])
            elif float(r["temperature"]) in temperatures:
                prompt = tokenizer.decode(r["prompt"]).lower() if excluded else ""
                if not any(q in prompt for q in excluded):
                    answers.append(segment(r, prompt_tail))
    return answers


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="specdec-corpus", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--answers", type=Path, help="directory of answer .jsonl files")
    ap.add_argument("--packed", type=Path, nargs="+", default=[],
                    help="packed answer files (specdec-distill --pack-data) or corpora to include")
    ap.add_argument("--exclude-prompts", type=Path,
                    help="text file, one question per line: drop packed answers whose prompt contains one")
    ap.add_argument("--target", default="smollm2", help="the target that wrote them (for its vocabulary size)")
    ap.add_argument("--out", required=True, type=Path, help="corpus .npz to write")
    ap.add_argument("--temperatures", default="0,0.7", help="keep answers sampled at these temperatures")
    ap.add_argument("--prompt-tail", type=int, default=6, help="prompt tokens kept before each answer")
    a = ap.parse_args(argv)
    if a.answers is None and not a.packed:
        ap.error("give --answers and/or --packed")
    from specdec.loader import materialize, resolve
    from specdec.model import ModelArgs
    from transformers import AutoConfig

    vocab = ModelArgs.from_hf_config(AutoConfig.from_pretrained(materialize(resolve(a.target)).path)).vocab_size
    temps = {float(t) for t in a.temperatures.split(",")}
    answers = read_answers(a.answers, temps, a.prompt_tail) if a.answers else []
    if a.packed:
        from specdec.loader import load_tokenizer
        excluded = ([q.strip().lower() for q in a.exclude_prompts.read_text(encoding="utf-8").splitlines() if q.strip()]
                    if a.exclude_prompts else [])
        answers += read_packed(a.packed, temps, a.prompt_tail, load_tokenizer(a.target), excluded)
    answers = list(dict.fromkeys(map(tuple, answers)))  # each distinct segment once, in order
    if not answers:
        raise SystemExit(f"no answers at temperatures {a.temperatures} in {a.answers or a.packed}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    NgramCorpus.save(a.out, answers, vocab)
    c = NgramCorpus.load(a.out)
    print(f"{a.out}: {len(answers)} answers, {c.num_tokens} tokens, {len(c)} contexts, "
          f"{a.out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
