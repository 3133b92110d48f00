"""`DraftModelProposer`: a smaller causal LM with the target's tokenizer proposes k tokens by k
autoregressive steps for the whole batch, keeping its own KV cache.

Cache sync: after proposing, the cache holds the confirmed tokens plus the drafts it fed
(d_1..d_{k-1}; d_k is never fed). Next round the confirmed tokens arrive; the cache stays valid
as far as they agree with the fed drafts, so the first step feeds one token after a rejection and
two (d_k and the bonus token) after a full acceptance. That first step is ragged and also
prefills new sequences; steps 2..k feed one token per row.

A reduced-vocabulary head (FR-Spec, Zhao et al. 2025) gives logits over `token_map` only: the
draft's q is zero elsewhere and the rejection sampler's residual covers the rest, so it stays
lossless. Sampled rows draw from the top-`top_j` truncation of the draft distribution; q is then
exactly that sparse distribution (`TOP_J`), which keeps what crosses processes small.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from specdec.metadata import U_DRAFT, DraftOutput, SpecBatch
from specdec.proposers.base import TOP_J, Proposer
from specdec.rejection_sampler import DraftProbs
from specdec.runner import CacheFullError, SlotTable, run_ragged
from specdec.sampling import logits_to_probs, noise_over, race_sample, sample_from_probs


class DraftModelProposer(Proposer):
    def __init__(self, model, num_slots: int, max_model_len: int, token_map: Tensor | None = None,
                 top_j: int = TOP_J, **_):
        self.model = model
        model.setup_cache(num_slots, max_model_len)
        self.table = SlotTable(num_slots, max_model_len, on_evict=lambda sid: self.release([sid]))
        # [V_draft] target ids of the draft head's outputs (host copy: drafts are indexed on the host)
        self.token_map = None if token_map is None else token_map.cpu()
        self.top_j = top_j

    @property
    def has_model(self) -> bool:
        return True

    @property
    def num_active(self) -> int:
        return len(self.table)

    def release(self, seq_ids) -> None:
        for s in seq_ids:
            self.table.release(s)

    def _choose(self, logits: Tensor, rows: list[int], batch: SpecBatch, step: int):
        """logits [n, V_draft] (on the model's device) -> (target ids [n], q ids [n, J], q vals [n, J]),
        on the host. The round's per-row tensors move to the logits' device first."""
        dev = logits.device
        idx = torch.tensor(rows)
        temp = batch.temperature[idx].to(dev)
        greedy = temp == 0
        local = logits.argmax(-1)  # [n]
        J = min(self.top_j, logits.shape[-1])
        q_ids = local[:, None].expand(-1, J).clone()  # greedy rows: one-hot q (padding ids carry 0)
        q_vals = torch.zeros(len(rows), J, device=dev)
        q_vals[:, 0] = 1.0
        if not bool(greedy.all()):
            probs = logits_to_probs(logits, temp, batch.top_k[idx].to(dev), batch.top_p[idx].to(dev))
            vals, ids = probs.topk(J, dim=-1)  # the draft samples from this truncation: q is exact
            vals = vals / vals.sum(-1, keepdim=True)
            pick = sample_from_probs(vals, batch.uniforms[idx, U_DRAFT, step].to(dev))
            sampled = ids.gather(1, pick[:, None]).squeeze(1)
            local = torch.where(greedy, local, sampled)
            q_ids = torch.where(greedy[:, None], q_ids, ids)
            q_vals = torch.where(greedy[:, None], q_vals, vals.float())
            if batch.race_noise is not None:
                local = self._race(probs, local, rows, batch, step)
        local, q_ids, q_vals = local.cpu(), q_ids.cpu(), q_vals.cpu()
        if self.token_map is not None:
            return self.token_map[local], self.token_map[q_ids], q_vals
        return local, q_ids, q_vals

    def _race(self, probs: Tensor, local: Tensor, rows: list[int], batch: SpecBatch, step: int) -> Tensor:
        """Rows sent race noise (TargetWorker's chains of unseeded sampled rows) take the token their
        q wins the exponential race with, using the noise of the target's draw at the position drafted
        (`sampling.race_sample`): that token is the target's own draw with probability close to
        sum min(p, q). probs: [n, V_draft] (this draft's q); local: [n] choices so far."""
        for r, i in enumerate(rows):
            noise = batch.race_noise[i]
            if noise is not None and step < len(noise):
                n = noise_over(noise, self.token_map)[step]  # [V_draft]: the noise of this head's tokens
                local[r] = race_sample(probs[r: r + 1], n[None].to(probs.device))[0]
        return local

    @torch.inference_mode()
    def propose(self, batch: SpecBatch) -> DraftOutput:
        """The k-step loop shared by draft-model proposers; `_sync` and `_step` are the variant's."""
        t0 = time.perf_counter()
        self.release(batch.release)
        B, K = len(batch), batch.max_draft
        tokens = torch.zeros(B, K, dtype=torch.long)
        J = min(self.top_j, self.model.args.vocab_size if self.token_map is None else len(self.token_map))  # as _choose
        q_ids = torch.zeros(B, K, J, dtype=torch.long)
        q_vals = torch.zeros(B, K, J)
        num, unknown, states = [0] * B, [], {}
        sibling = torch.full((B,), -1, dtype=torch.long)
        self._new_round()
        for i in range(B):
            try:
                st = self._sync(batch, i)
            except CacheFullError:  # no free slot: no drafts for this row until one frees
                st = None
            if st is None:
                unknown.append(i)
            elif batch.num_draft[i] > 0 and self._can_draft(i):
                states[i] = st
        steps = 0
        active = list(states)
        for j in range(K):
            active = [i for i in active if batch.num_draft[i] > j]
            if not active:
                break
            sts = [states[i] for i in active]
            logits = self._step(j, active, sts, batch)
            steps += 1
            step_logits = torch.cat(logits)  # [n, V_draft]
            ids, qi, qv = self._choose(step_logits, active, batch, j)
            if j == 0 and batch.siblings:  # greedy rows: the second choice, verified beside the chain
                self._siblings(step_logits, active, batch, sibling)
            for r, (i, st) in enumerate(zip(active, sts)):
                tokens[i, j], q_ids[i, j], q_vals[i, j] = ids[r], qi[r], qv[r]
                num[i] = j + 1
                if j + 1 < batch.num_draft[i]:
                    st.tokens.append(int(ids[r]))  # tentative: fed next step
        return DraftOutput(tokens, num, DraftProbs(q_ids, q_vals), unknown, time.perf_counter() - t0, steps,
                           sibling=sibling if batch.siblings else None)

    def _siblings(self, logits: Tensor, rows: list[int], batch: SpecBatch, out: Tensor) -> None:
        """out[i] = the draft's second most likely first token of each greedy row i (a sampled
        row's q must stay the distribution its chain was drawn from: no sibling)."""
        second = logits.topk(2, dim=-1).indices[:, 1].cpu()  # [n]
        if self.token_map is not None:
            second = self.token_map[second]
        for r, i in enumerate(rows):
            if float(batch.temperature[i]) == 0:
                out[i] = second[r]

    def _new_round(self) -> None:
        """Forget the previous round's per-row scratch state (variants that keep some)."""

    def _sync(self, batch: SpecBatch, i: int):
        """Apply row i's confirmed tokens; its state, or None when the row is unknown here."""
        st = self.table.sync(batch.seq_ids[i], batch.offsets[i], batch.new_tokens[i])
        return st if st is not None and st.tokens else None

    def _can_draft(self, i: int) -> bool:
        """Whether synced row i can be drafted from this round."""
        return True

    def _step(self, j: int, active: list[int], sts: list, batch: SpecBatch) -> list[Tensor]:
        """Draft step j for the active rows: their logits [1, V_draft] each."""
        if j == 0:  # catch up on confirmed tokens (prefill for new rows), ragged
            for st in sts:  # always feed at least the last token (rewriting its keys is harmless)
                st.cached = min(st.cached, len(st.tokens) - 1)
            feeds = [st.tokens[st.cached:] for st in sts]
            starts = [st.cached for st in sts]
        else:
            feeds = [[st.tokens[-1]] for st in sts]
            starts = [len(st.tokens) - 1 for st in sts]
        logits = run_ragged(self.model, feeds, [st.slot for st in sts], starts, [1] * len(sts))
        for st in sts:
            st.cached = len(st.tokens)
        return logits
