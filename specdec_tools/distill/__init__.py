"""Distil a draft model for a target (`specdec-distill`, `python -m specdec_tools.distill`).

Token-level KL(p_target || q_draft) through batched target prefill, mixed with the target's own
greedy answers (sequence-level data), after DistillSpec (Zhou et al. 2023, "DistillSpec: Improving
Speculative Decoding via Knowledge Distillation"); a reduced draft head over the target's most
frequent output tokens, after FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary
Language Models via Frequency-Ranked Speculative Sampling"). The result is a plain Hugging Face
checkpoint plus `specdec.json` (draft_vocab, metrics) that `specdec.loader.load_model` and the
"draft" proposer load.

Modules: data (offline corpus, held-out split), teacher (prefill targets, vocabulary choice),
seqgen (cached target generations), student (draft model and export), train (loop, checkpoints),
evaluate (acceptance per k, cost ratio), cli (the command).
"""
from specdec_tools.distill.cli import build_parser, main

__all__ = ["build_parser", "main"]
