"""`LLMEngine`: the speculative decoding loop in process. Each step is one round of
`specdec.round` (plan, propose, verify, commit) driven with plain calls to the proposer and the
target worker; the Ray Serve router drives the same round against deployment handles.

Plain autoregressive decoding is the k = 0 case of the same loop (the proposer is then skipped).
"""
from __future__ import annotations

from dataclasses import dataclass, field


from specdec.metadata import DraftOutput
from specdec.proposers.base import Proposer
from specdec.round import run_round
from specdec.sampling import SamplingParams
from specdec.scheduler import Scheduler, scheduler_config
from specdec.sequence import Sequence
from specdec.target_worker import TargetWorker


@dataclass
class EngineConfig:
    max_batch_size: int = 8
    max_model_len: int = 2048
    num_speculative_tokens: int = 4  # k_max
    adaptive: bool = True
    speculate: bool = True
    plain_steps: int = 1  # tokens per row of a round without drafts (see SchedulerConfig)
    siblings_max_batch: int = 0  # rounds of at most this many rows add a first-draft sibling (see SchedulerConfig)
    lookup_k: int = 0  # prompt-lookup tokens per step of multi-step plain rounds (see SchedulerConfig)
    lookup_max_batch: int = 0
    ngram_k: int = 0  # hybrid: prompt-lookup drafts of greedy rows may run this long (see SchedulerConfig)
    max_prefill_tokens: int = 256  # a long prompt's tokens per round (chunked prefill, see SchedulerConfig)


class LLMEngine:
    def __init__(self, target: TargetWorker, proposer: Proposer | None, tokenizer=None,
                 config: EngineConfig | None = None, eos_token_ids=None):
        self.cfg = config or EngineConfig()
        # the target's KV cache bounds every sequence: a longer max_model_len would overflow it
        self.max_model_len = min(self.cfg.max_model_len, target.max_model_len)
        self.target, self.proposer, self.tokenizer = target, proposer, tokenizer
        if eos_token_ids is None:
            eos_token_ids = eos_ids_of(tokenizer)
        features = proposer is not None and proposer.needs_features
        target.return_hidden = target.return_hidden or features  # an EAGLE draft reads the target's features
        taps = {tuple(p.feature_layers) for p in (proposer if features else None, target.drafter) if p is not None}
        if len(taps) > 1:
            raise ValueError(f"the proposer and the target's own drafter read different target layers: {sorted(taps)}")
        target.model.feature_layers = taps.pop() if taps else ()  # an EAGLE-3 draft's taps
        if features and getattr(target.model, "_compiled", None) is not None:
            target.warm_up()  # a compiled target's forwards with features are graphs of their own
        self.scheduler = Scheduler(
            scheduler_config(self.cfg, max_model_len=self.max_model_len, features=features,
                             speculate=self.cfg.speculate and proposer is not None),
            tokenizer, eos_token_ids, proposer_has_model=proposer is not None and proposer.has_model)

    @property
    def stats(self):
        return self.scheduler.stats

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request. Raises ValueError for a prompt that leaves no room to generate (it
        would otherwise overflow the KV cache of every batch it joins)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in max_model_len "
                             f"{self.max_model_len}")
        return self.scheduler.add(Sequence(list(prompt_ids), params))

    def abort(self, seq_id: int) -> None:
        self.scheduler.abort(seq_id)
        self._release(self.scheduler.take_releases())

    def _release(self, ids: list[int]) -> None:
        if ids:
            self.target.release(ids)
            if self.proposer is not None:
                self.proposer.release(ids)

    def step(self) -> list[Sequence]:
        """Run one speculative round over the running batch; returns the sequences it touched."""
        result = run_round(self.scheduler, self._propose, self._verify)
        self._release(self.scheduler.take_releases())
        return result.plan.seqs if result is not None else []

    def _propose(self, plan) -> tuple[DraftOutput, bool]:
        if self.proposer is None or plan.draft_batch.max_draft == 0:
            return DraftOutput.empty(len(plan.seqs)), False
        return self.proposer.propose(plan.draft_batch), True

    def _verify(self, plan, draft: DraftOutput):
        return self.target.verify(self.scheduler.target_batch(plan, draft), draft)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Run prompts to completion (continuous batching up to max_batch_size)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.scheduler.has_work:
            self.step()
        return seqs


def eos_ids_of(tokenizer) -> list[int]:
    """The tokenizer's EOS, the EOS ids its checkpoint's generation_config.json and config.json
    list (Llama 3.1's `<|eom_id|>`, say), and the chat turn terminators it knows (generation stops
    at any)."""
    if tokenizer is None:
        return []
    ids = set(_checkpoint_eos_ids(getattr(tokenizer, "name_or_path", "") or ""))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):  # chat turn terminators
        tid = tokenizer.convert_tokens_to_ids(name) if name in tokenizer.get_vocab() else None
        if tid is not None:
            ids.add(int(tid))
    return sorted(ids)


def _checkpoint_eos_ids(path: str) -> list[int]:
    """`eos_token_id` (an id or a list) of the checkpoint directory's generation and model configs."""
    import json
    import os
    ids = []
    for name in ("generation_config.json", "config.json"):
        f = os.path.join(path, name)
        if os.path.isfile(f):
            with open(f, encoding="utf-8") as fh:
                eos = json.load(fh).get("eos_token_id")
            ids += [int(e) for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
    return ids
