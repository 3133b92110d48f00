"""The verifier: speculative rejection sampling as pure functions over a batched round.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and Chen et
al. 2023 ("Accelerating LLM Decoding with Speculative Sampling"): the draft proposes x ~ q; the
target, in one forward pass over the k draft tokens, gives p at every position. Draft token j is
accepted with probability min(1, p(x_j) / q(x_j)); at the first rejection the target's token is
drawn from normalize(max(0, p - q)); if all k are accepted a further token is drawn from p. The
emitted tokens are then distributed exactly as if sampled from the target one by one.

Words used everywhere in this project (and only in these senses):
- **accepted**: draft tokens the target kept (0..k per round);
- **recovered** token: the target's token sampled at the first rejected position;
- **bonus** token: the target's token after all k drafts were accepted;
- a round therefore emits accepted + 1 tokens (the last is recovered or bonus), and the
  **mean accepted length** is (accepted + 1) averaged over rounds (see `stats.SpecStats`).

Greedy rows (temperature 0) accept while draft == argmax(target) and then emit the argmax.
A draft without probabilities (n-gram) has a one-hot q. Prompt lookup inside multi-step plain
rounds, and every draft of a seeded sampled row, is checked by `coupled_verify` instead: the
target's own draws, one uniform per position, so that the sampled output is plain decoding's
token for token (a seeded request reproduces whatever is drafted). There, the in-target draft's chains
of unseeded sampled rows are drawn and checked by the exponential race (`sampling.race_sample`):
draft and target race with the same noise, an exact draw that the draft matches often. A draft with a reduced vocabulary has q
zero outside it; the residual max(0, p - q) then still covers every token the target can emit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.sampling import logits_to_probs, race_sample, sample_from_probs
from specdec.wire import Wire


@dataclass
class DraftProbs(Wire):
    """Sparse draft distributions: q[b, j] is `vals[b, j]` on token ids `ids[b, j]` (zero elsewhere).

    An id may repeat within a row (padding columns of a one-hot q carry the token with value 0):
    `dense` adds the values of repeated ids, so padding never overwrites a probability.
    """

    ids: Tensor  # [B, K, J] long
    vals: Tensor  # [B, K, J] float

    def dense(self, vocab_size: int) -> Tensor:
        B, K, _ = self.ids.shape
        q = torch.zeros(B, K, vocab_size, dtype=torch.float32, device=self.ids.device)
        return q.scatter_add_(2, self.ids, self.vals.float())  # [B, K, V]


def accepted_prefix(accept: Tensor) -> Tensor:
    """Length of the leading run of True per row. accept: [B, K] -> [B]."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def greedy_verify(target_logits: Tensor, draft_tokens: Tensor, num_draft: Tensor) -> tuple[Tensor, Tensor]:
    """target_logits [B, K+1, V], draft_tokens [B, K], num_draft [B] -> (num_accepted [B], final [B])."""
    K = draft_tokens.shape[1]
    argmax = target_logits.argmax(-1)  # [B, K+1]
    valid = torch.arange(K, device=draft_tokens.device)[None, :] < num_draft[:, None]
    n_acc = accepted_prefix((draft_tokens == argmax[:, :K]) & valid)
    final = argmax.gather(1, n_acc[:, None]).squeeze(1)
    return n_acc, final


def random_verify(target_probs: Tensor, draft_tokens: Tensor, num_draft: Tensor, draft_q: Tensor,
                  u_accept: Tensor, u_sample: Tensor) -> tuple[Tensor, Tensor]:
    """Lossless rejection sampling.

    target_probs [B, K+1, V] (after temperature/top-k/top-p), draft_tokens [B, K], num_draft [B],
    draft_q [B, K, V] (the distributions the drafts were sampled from), u_accept/u_sample [B, K+1]
    uniforms. Returns (num_accepted [B], final token [B]: recovered or bonus).
    """
    B, K = draft_tokens.shape
    if K > 0:
        p_x = target_probs[:, :K].gather(2, draft_tokens[:, :, None]).squeeze(2)  # [B, K]
        q_x = draft_q.gather(2, draft_tokens[:, :, None]).squeeze(2)  # [B, K]
        valid = torch.arange(K, device=draft_tokens.device)[None, :] < num_draft[:, None]
        # accept with probability min(1, p(x) / q(x)): u < p/q  <=>  u * q < p
        n_acc = accepted_prefix((u_accept[:, :K] * q_x < p_x) & valid)
    else:
        n_acc = torch.zeros(B, dtype=torch.long, device=draft_tokens.device)
    rows = torch.arange(B, device=draft_tokens.device)
    p_final = target_probs[rows, n_acc]  # [B, V]
    if K > 0:
        rejected = n_acc < num_draft
        q_final = draft_q[rows, n_acc.clamp(max=K - 1)] * rejected[:, None]  # zero for bonus rows
        residual = (p_final - q_final).clamp(min=0)  # [B, V]
        empty = residual.sum(-1) <= 0  # p == q exactly: cannot be rejected, guard rounding only
        dist = torch.where(empty[:, None], p_final, residual)
    else:
        dist = p_final
    final = sample_from_probs(dist, u_sample[rows, n_acc])
    return n_acc, final


def coupled_verify(target_probs: Tensor, draft_tokens: Tensor, num_draft: Tensor,
                   u_sample: Tensor, race: list | None = None) -> tuple[Tensor, Tensor]:
    """Deterministic drafts (prompt lookup) checked against the target's own draws: at every
    position the target draws its token by inverse CDF with that position's uniform, exactly as a
    plain step would, and a draft is accepted while it equals the draw. The tokens emitted are
    therefore the plain path's for the same uniforms, token for token (so their distribution is
    the target's), and draft x is accepted with probability p(x), as `random_verify` with a
    one-hot q would. Needs one uniform per *position* of the sequence, never reused.

    race[b] ([n, V], a `sampling.RaceNoise` of n positions, or None): row b draws its first n
    positions by the exponential race with that noise (`sampling.race_sample`, the noise its drafts
    were raced with) instead of by inverse CDF:
    an exact draw from the target as well, which the draft matches far more often.

    target_probs [B, K+1, V], draft_tokens [B, K], num_draft [B], u_sample [B, K+1]
    -> (num_accepted [B], final token [B]: the draw at the first mismatch, or the bonus)."""
    B, K = draft_tokens.shape
    draws = sample_from_probs(target_probs.reshape(B * (K + 1), -1), u_sample[:, : K + 1].reshape(-1))
    draws = draws.view(B, K + 1)  # [B, K+1]: what plain decoding draws at each position
    for b, noise in enumerate(race or []):
        if noise is not None:
            draws[b, : len(noise)] = race_sample(target_probs[b, : len(noise)], noise.to(target_probs.device))
    valid = torch.arange(K, device=draft_tokens.device)[None, :] < num_draft[:, None]
    n_acc = accepted_prefix((draft_tokens == draws[:, :K]) & valid)
    return n_acc, draws.gather(1, n_acc[:, None]).squeeze(1)


def rejection_sample(target_logits: Tensor, draft_tokens: Tensor, num_draft: Tensor,
                     draft_probs: DraftProbs | None, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                     uniforms: Tensor, coupled: bool | Tensor = False,
                     race: list | None = None) -> tuple[Tensor, Tensor]:
    """Verify one batched round.

    target_logits [B, K+1, V]; draft_tokens [B, K] (rows padded past num_draft [B]);
    draft_probs: sparse q or None (then q is one-hot on the draft tokens);
    temperature/top_k/top_p [B]; uniforms [B, 2, K+1] (accept tests, recovered/bonus draws);
    coupled (all rows, or a [B] bool mask): those sampled rows check their drafts with
    `coupled_verify`, where uniforms[:, 1, j] belongs to the j-th position (no accept tests are
    drawn; their q is not needed); `race`: per row, the noise of positions a sampled row draws by
    the exponential race (see `coupled_verify`).
    Returns (output_tokens [B, K+1] with -1 after each row's end, num_accepted [B]).
    """
    B, K1, V = target_logits.shape
    K = K1 - 1
    greedy = temperature == 0
    n_acc, final = greedy_verify(target_logits, draft_tokens, num_draft)
    if not bool(greedy.all()):
        n_acc, final = n_acc.clone(), final.clone()
        mask = torch.as_tensor(coupled, device=greedy.device).expand(B)
        r = (~greedy).nonzero().squeeze(1)  # rows that sample
        p = logits_to_probs(target_logits[r].reshape(-1, V), temperature[r].repeat_interleave(K1),
                            top_k[r].repeat_interleave(K1), top_p[r].repeat_interleave(K1)).view(-1, K1, V)
        c = mask[r]  # of the sampling rows: coupled ones
        if bool(c.any()):
            rc = r[c]
            n_acc[rc], final[rc] = coupled_verify(p[c], draft_tokens[rc], num_draft[rc], uniforms[rc, 1],
                                                  None if race is None else [race[i] for i in rc.tolist()])
        if not bool(c.all()):
            rr = r[~c]
            if draft_probs is None:
                q = torch.zeros(len(rr), K, V, device=p.device).scatter_(2, draft_tokens[rr, :, None], 1.0)
            else:
                q = DraftProbs(draft_probs.ids[rr], draft_probs.vals[rr]).dense(V)
            n_acc[rr], final[rr] = random_verify(p[~c], draft_tokens[rr], num_draft[rr], q, uniforms[rr, 0],
                                                 uniforms[rr, 1])
    pos = torch.arange(K1, device=target_logits.device)[None, :]  # [1, K+1]
    padded = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)  # [B, K+1]
    out = torch.where(pos < n_acc[:, None], padded, torch.full_like(padded, -1))
    out[torch.arange(B), n_acc] = final
    return out, n_acc

