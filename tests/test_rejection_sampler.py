"""The verifier: greedy rules, and a statistical proof that sampling is lossless.

The lossless test samples 200k sequences of three tokens from a context-dependent target (a
random Markov chain: p(x_t | x_{t-1})) through speculative rounds with a deliberately different
draft, then compares the empirical joint distribution of (x1, x2, x3) with the target's exact
one by a chi-square test at a fixed significance. The same harness must *reject* two broken
samplers, so the test can fail.
"""
import math

import pytest
import torch
from scipy.stats import chisquare

from specdec.rejection_sampler import DraftProbs, greedy_verify, rejection_sample
from specdec.sampling import apply_top_k_top_p, logits_to_probs, sample_from_probs

V, N, STEPS = 6, 200_000, 3
ALPHA = 1e-3  # significance of the chi-square tests


def test_greedy_accepts_matching_prefix_then_target_token():
    logits = torch.full((2, 4, 5), -10.0)
    target = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0]])  # argmax per position
    logits.scatter_(2, target[:, :, None], 10.0)
    drafts = torch.tensor([[1, 2, 0], [0, 0, 0]])
    n_acc, final = greedy_verify(logits, drafts, torch.tensor([3, 2]))
    assert n_acc.tolist() == [2, 2]  # row 0 rejects at j=2; row 1 accepts both (only 2 proposed)
    assert final.tolist() == [3, 0]  # recovered token / bonus token


def test_rejection_sample_output_layout():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = logits[0, 1, 1] = logits[0, 2, 3] = 5.0
    out, n = rejection_sample(logits, torch.tensor([[2, 1]]), torch.tensor([2]), None,
                              torch.tensor([0.0]), torch.tensor([0]), torch.tensor([1.0]), torch.zeros(1, 2, 3))
    assert n.tolist() == [2] and out.tolist() == [[2, 1, 3]]


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))[0, 2:]).all()
    kept = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.7]))[0]
    assert torch.isfinite(kept[:2]).all() and torch.isinf(kept[2:]).all()  # 0.5 + 0.3 reaches 0.7


def test_top_k_keeps_every_token_tied_with_the_kth():
    """As vLLM and transformers do: [2, 1, 1, 1, 0] at top_k 2 keeps the three 1s (bf16 logits tie
    often); a positional cut kept one of them, whichever the sort put first."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    probs = logits_to_probs(logits, torch.ones(1), torch.tensor([2]), torch.ones(1))[0]
    assert torch.allclose(probs, torch.softmax(torch.tensor([2.0, 1.0, 1.0, 1.0, float("-inf")]), -1))


def test_a_temperature_that_is_not_finite_is_refused():
    from specdec.sampling import SamplingParams
    for t in (float("nan"), float("inf")):  # (NaN sampled at 1; inf uniformly, or a masked token)
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=t)
    for bad in ({"max_tokens": 0}, {"top_p": 0.0}, {"top_k": -1}, {"num_speculative_tokens": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):  # (the engine's own check, under the API's)
            SamplingParams(**bad)


def test_a_row_without_top_k_is_not_masked_by_its_batch():
    """top_k 0 (off) keeps every token also when another row of the batch uses top-k."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(2, 1)
    probs = logits_to_probs(logits, torch.ones(2), torch.tensor([2, 0]), torch.ones(2))
    assert bool((probs[0, 2:] == 0).all()) and torch.allclose(probs[1], logits[1].softmax(-1))


def test_a_row_without_top_p_is_not_masked_by_its_batch():
    """A peaked row (its float32 cumulative mass reaches 1.0 before the tail) keeps its tail at
    top_p = 1, whether or not another row of the batch uses top-p."""
    logits = torch.tensor([[20.0] + [0.0] * 7])
    alone = logits_to_probs(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1))
    batch = logits_to_probs(logits.repeat(2, 1), torch.ones(2), torch.zeros(2, dtype=torch.long),
                            torch.tensor([1.0, 0.5]))
    assert bool((alone[0, 1:] > 0).all())
    assert torch.equal(batch[0], alone[0]) and bool((batch[1, 1:] == 0).all())


def test_inverse_cdf_sampling_never_picks_zero_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).repeat(1000, 1)
    idx = sample_from_probs(probs, torch.rand(1000))
    assert set(idx.tolist()) <= {1, 3}


# ---- statistical losslessness ------------------------------------------------------------------

def _chain(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * 1.5  # logits of x_t given x_{t-1}


def _speculate(P, Q, temp, top_k, top_p, k, broken=None, seed=0, ragged=False, onehot=False):
    """Generate STEPS tokens for N sequences (context x0 = 0) with speculative rounds. `ragged`:
    each row verifies its own number of drafts, 0..k, in the batch's [B, k] tensors (as rows of a
    real batch do); `onehot`: the drafts are Q's argmax, a deterministic proposal whose q is
    one-hot (prompt lookup, the hybrid's n-gram rows: draft_probs None)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((N, STEPS), -1, dtype=torch.long)
    length = torch.zeros(N, dtype=torch.long)
    last = torch.zeros(N, dtype=torch.long)
    T = torch.full((N,), temp)
    TK, TP = torch.full((N,), top_k, dtype=torch.long), torch.full((N,), top_p)
    while bool((length < STEPS).any()):
        rows = (length < STEPS).nonzero().squeeze(1)
        B = len(rows)
        u = torch.rand(B, 3, k + 1, generator=g, dtype=torch.float64)
        # draft: k autoregressive samples from Q (with the same temperature), q kept exactly
        ctx, drafts, qs = last[rows], [], []
        for j in range(k):
            q = logits_to_probs(Q[ctx], T[rows], TK[rows] * 0, TP[rows] * 0 + 1)  # draft ignores top-k/p
            x = q.argmax(-1) if onehot else sample_from_probs(q, u[:, 0, j])
            drafts.append(x)
            qs.append(q)
            ctx = x
        drafts = torch.stack(drafts, 1)  # [B, k]
        q = torch.stack(qs, 1)  # [B, k, V]
        # target logits at each position given the draft prefix: [B, k+1, V]
        ctxs = torch.cat([last[rows, None], drafts], 1)
        tlogits = P[ctxs]
        num_draft = torch.randint(0, k + 1, (B,), generator=g) if ragged else torch.full((B,), k)
        if broken is None:
            probs = None if onehot else DraftProbs(torch.arange(V).expand(B, k, V), q)
            toks, n_acc = rejection_sample(tlogits, drafts, num_draft, probs, T[rows], TK[rows], TP[rows], u[:, 1:])
        else:
            toks, n_acc = broken(tlogits, drafts, q, T[rows], TK[rows], TP[rows], u)
        for r in range(k + 1):  # append emitted tokens, up to STEPS
            tok = toks[:, r]
            ok = (tok >= 0) & (length[rows] < STEPS)
            idx = rows[ok]
            out[idx, length[idx]] = tok[ok]
            length[idx] += 1
            last[idx] = tok[ok]
    return out


def _reference_probs(logits, temp, top_k, top_p):
    """The target's distribution written out here, not through specdec.sampling (a reference built
    from the code under test could not see a wrong temperature): softmax(logits / T) over the k
    largest (ties with the k-th kept), then the smallest prefix whose mass reaches top_p."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for i, row in enumerate(logits.double() / temp):
        order = row.argsort(descending=True).tolist()
        if top_k:
            order = [t for t in order if row[t] >= row[order[top_k - 1]]]
        probs = row[order].softmax(0)
        keep, mass = [], 0.0
        for t, pr in zip(order, probs.tolist()):
            keep.append(t)
            mass += pr
            if mass >= top_p - 1e-12:
                break
        out[i, keep] = row[keep].softmax(0)
    return out


def _exact_joint(P, temp, top_k, top_p):
    p = _reference_probs(P, temp, top_k, top_p)  # [V, V] rows: context
    joint = p[0][:, None, None] * p[:, :, None] * p[None, :, :]  # p(a|0) p(b|a) p(c|b)
    return joint.flatten().double()


def _pvalue(samples, exact):
    codes = samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2]
    counts = torch.bincount(codes, minlength=V ** 3).double()
    keep = exact * N > 5  # chi-square needs expected counts >= 5; pool the rest
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([exact[keep] * N, (exact[~keep].sum() * N)[None]])
    if exp[-1] < 5:  # merge a tiny pooled cell into the largest
        obs, exp = obs[:-1], exp[:-1]
        obs[obs.argmax()] += counts[~keep].sum()
    exp = exp * obs.sum() / exp.sum()
    return chisquare(obs.numpy(), exp.numpy()).pvalue


CASES = [  # temperature, top_k, top_p, k
    (1.0, 0, 1.0, 2),
    (0.7, 0, 1.0, 3),
    (1.3, 3, 1.0, 2),
    (1.0, 0, 0.8, 3),
    (0.8, 4, 0.9, 1),
]


@pytest.mark.parametrize("temp,top_k,top_p,k", CASES)
def test_sampling_is_lossless(temp, top_k, top_p, k):
    P, Q = _chain(1), _chain(2)  # the draft is a different chain
    samples = _speculate(P, Q, temp, top_k, top_p, k, seed=hash((temp, top_k, top_p, k)) % 1000)
    assert (samples >= 0).all()
    assert _pvalue(samples, _exact_joint(P, temp, top_k, top_p)) > ALPHA


@pytest.mark.parametrize("onehot", [False, True], ids=["sampled-drafts", "one-hot-drafts"])
def test_sampling_is_lossless_with_ragged_rows(onehot):
    """Rows of one batch verify different numbers of drafts (0..k; the rest of their row is
    padding), and deterministic drafts arrive without q (one-hot: prompt lookup)."""
    P, Q = _chain(1), _chain(2)
    samples = _speculate(P, Q, 0.9, 0, 1.0, 3, seed=11, ragged=True, onehot=onehot)
    assert (samples >= 0).all()
    assert _pvalue(samples, _exact_joint(P, 0.9, 0, 1.0)) > ALPHA


def test_the_reference_distribution_is_not_the_code_under_test():
    """The exact joint comes from `_reference_probs`; it and specdec.sampling agree (so a test that
    passes checks the sampler, and one that fails is not the reference's fault)."""
    P = _chain(3)
    for temp, top_k, top_p in [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.7, 2, 1.0), (0.8, 0, 0.7), (1.2, 3, 0.6)]:
        ours = logits_to_probs(P, torch.full((V,), temp), torch.full((V,), top_k, dtype=torch.long),
                               torch.full((V,), top_p)).double()
        assert torch.allclose(ours, _reference_probs(P, temp, top_k, top_p), atol=1e-6), (temp, top_k, top_p)


def _blog_rule(tlogits, drafts, q, T, TK, TP, u):
    """The widely copied bug: accept with min(1, p(draft)/p(sampled)) using the target's own
    sample instead of q, then emit the target's sample on rejection."""
    B, k = drafts.shape
    p = logits_to_probs(tlogits.reshape(-1, V), T.repeat_interleave(k + 1), TK.repeat_interleave(k + 1),
                        TP.repeat_interleave(k + 1)).view(B, k + 1, V)
    sampled = torch.stack([sample_from_probs(p[:, j], u[:, 2, j]) for j in range(k + 1)], 1)
    pd = p[:, :k].gather(2, drafts[:, :, None]).squeeze(2)
    ps = p[:, :k].gather(2, sampled[:, :k, None]).squeeze(2)
    acc = (u[:, 1, :k] < (pd / ps).clamp(max=1)).long().cumprod(1)
    n = acc.sum(1)
    out = torch.full((B, k + 1), -1, dtype=torch.long)
    for b in range(B):
        m = int(n[b])
        out[b, :m] = drafts[b, :m]
        out[b, m] = sampled[b, m]
    return out, n


def _no_residual(tlogits, drafts, q, T, TK, TP, u):
    """Correct acceptance test, but the recovered token sampled from p instead of max(0, p - q)."""
    B, k = drafts.shape
    p = logits_to_probs(tlogits.reshape(-1, V), T.repeat_interleave(k + 1), TK.repeat_interleave(k + 1),
                        TP.repeat_interleave(k + 1)).view(B, k + 1, V)
    pd = p[:, :k].gather(2, drafts[:, :, None]).squeeze(2)
    qd = q.gather(2, drafts[:, :, None]).squeeze(2)
    n = (u[:, 1, :k] * qd < pd).long().cumprod(1).sum(1)
    rows = torch.arange(B)
    final = sample_from_probs(p[rows, n], u[rows, 2, n])
    out = torch.where(torch.arange(k + 1)[None] < n[:, None], torch.cat([drafts, drafts[:, :1]], 1), -1)
    out[rows, n] = final
    return out, n


@pytest.mark.parametrize("broken", [_no_residual, _blog_rule])
def test_harness_detects_broken_samplers(broken):
    P, Q = _chain(1), _chain(2)
    samples = _speculate(P, Q, 1.0, 0, 1.0, 2, broken=broken, seed=5)
    assert _pvalue(samples, _exact_joint(P, 1.0, 0, 1.0)) < ALPHA


@pytest.mark.parametrize("temp,k", [(1.0, 2), (0.7, 3)])
def test_reduced_vocabulary_draft_is_lossless(temp, k):
    """A draft head over part of the vocabulary (FR-Spec; the EAGLE and distilled drafts): q is zero
    outside it, and the residual max(0, p - q) gives the target's other tokens their full mass."""
    P, Q = _chain(1), _chain(2).clone()
    Q[:, V // 2:] = float("-inf")  # the draft can only propose the first half of the vocabulary
    samples = _speculate(P, Q, temp, 0, 1.0, k, seed=17 + k)
    assert (samples >= V // 2).any()  # tokens outside the draft's head do occur
    assert _pvalue(samples, _exact_joint(P, temp, 0, 1.0)) > ALPHA


def test_dense_adds_repeated_ids():
    """A one-hot q padded with its own id (value 0) keeps q(x) = 1 (scatter_ let the padding win)."""
    q = DraftProbs(torch.tensor([[[3, 3, 3]]]), torch.tensor([[[1.0, 0.0, 0.0]]])).dense(5)
    assert q[0, 0].tolist() == [0, 0, 0, 1.0, 0]


def test_tiny_temperature_is_greedy():
    from specdec.sampling import SamplingParams
    p = SamplingParams(temperature=1e-38)
    assert p.greedy and p.temperature == 0.0
    logits = torch.tensor([[[0.0, 3.0, 1.0, 0.5]]])
    out, _ = rejection_sample(logits, torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]), None,
                              torch.tensor([p.temperature]), torch.tensor([0]), torch.tensor([1.0]),
                              torch.rand(1, 2, 1))
    assert out.tolist() == [[1]]  # the argmax, not NaN probabilities' last token


def test_uniforms_use_every_bit_of_the_seed():
    from specdec.sampling import new_base_seed, round_uniforms
    a, b = (round_uniforms(new_base_seed(s), 7, 3) for s in (1, 1 + 2 ** 32))
    assert not torch.allclose(a, b)
    assert torch.equal(round_uniforms(new_base_seed(1), 7, 3), a)  # and stay reproducible
    assert new_base_seed(0) == 0 and new_base_seed(-1) == -1  # seed 0 is a seed, not "no seed"
    u = torch.cat([round_uniforms(s, 0, 15).flatten() for s in range(200)])
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.02


def test_race_sample_draws_from_p_and_its_noise_is_keyed_by_each_uniform():
    """The exponential race with noise keyed by a uniform is an exact sample (chi-square), never
    a zero-probability token; a row's noise depends on its own uniform only (deterministic, whatever
    shares the call), and differs between uniforms."""
    from specdec.sampling import race_noise, race_sample
    p = torch.tensor([0.05, 0.0, 0.4, 0.25, 0.0, 0.3])
    u = torch.rand(40_000, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x = race_sample(p.expand(len(u), -1), race_noise(u, len(p)))
    counts = torch.bincount(x, minlength=len(p))
    assert counts[1] == counts[4] == 0
    keep = p > 0
    assert chisquare(counts[keep].numpy(), (p[keep] * len(u)).numpy()).pvalue > 1e-3
    assert torch.equal(race_noise(u[3:4], 50), race_noise(u[:8], 50)[3:4])
    assert not torch.equal(race_noise(u[:1], 50), race_noise(u[1:2], 50))


@pytest.mark.parametrize("merged", [True, False], ids=["exact", "broken-no-merged-clock"])
def test_race_over_a_reduced_vocabulary_is_exact(merged):
    """`RaceNoise`: the draft's tokens raced with their own noise (the values the full race gives
    them), the other tokens merged into one clock. Its draws follow p (chi-square, mass outside the
    draft's tokens included), never a zero-probability token. A broken variant without the merged
    clock (the draft's tokens only) must fail the same check."""
    from specdec.sampling import RaceNoise, noise_over, race_noise, race_noise_over, race_sample
    p = torch.tensor([0.05, 0.0, 0.3, 0.1, 0.2, 0.0, 0.15, 0.2])
    ids = torch.tensor([0, 2, 5, 7])  # a reduced head: tokens 3, 4 and 6 (0.45 of p) outside it
    u = torch.rand(40_000, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    rn = race_noise_over(u, len(p), ids)
    assert torch.equal(noise_over(rn, ids), race_noise(u, len(p))[:, ids])  # the same noise on ids
    if not merged:
        rn = RaceNoise(rn.ids, rn.noise, torch.full_like(rn.rest, float("inf")), rn.pick)
    x = race_sample(p.expand(len(u), -1), rn)
    counts = torch.bincount(x, minlength=len(p))
    assert counts[1] == counts[5] == 0
    keep = p > 0
    pvalue = chisquare(counts[keep].numpy(), (p[keep] * len(u)).numpy()).pvalue
    assert (pvalue > 1e-3) == merged, pvalue
    assert len(rn[:5]) == 5 and torch.equal(rn[1:3].noise, rn.noise[1:3])


def test_coupled_verify_races_the_positions_it_is_given_noise_for():
    """Positions with race noise are the race's draw from the target's probabilities (the draft
    accepted where it equals it); the others keep the inverse-CDF draw of their uniform."""
    from specdec.rejection_sampler import coupled_verify
    from specdec.sampling import race_noise, race_sample
    torch.manual_seed(2)
    p = torch.softmax(torch.randn(2, 3, 7), -1)  # [B, K+1, V]
    u = torch.rand(2, 3, dtype=torch.float64)
    noise = race_noise(u[0, :2], 7)
    raced = race_sample(p[0, :2], noise)
    drafts = torch.stack([raced, torch.tensor([0, 0])])  # row 0 drafts exactly the race's draws
    n_acc, final = coupled_verify(p, drafts, torch.tensor([2, 2]), u, race=[noise, None])
    assert int(n_acc[0]) == 2 and int(final[0]) == int(sample_from_probs(p[0, 2:], u[0, 2:])[0])
    plain = sample_from_probs(p[1], u[1])
    n1 = int(n_acc[1])
    assert int(final[1]) == int(plain[n1]) and all(int(plain[j]) == 0 for j in range(n1))


def test_race_noise_is_never_zero():
    """The largest 53-bit uniform would give Exp(1) noise 0 (-log 1): a token of probability 0
    then races to 0/0 = NaN, which argmax takes for the largest, and would be emitted."""
    from specdec.sampling import _exp, race_sample
    top = torch.tensor([-1], dtype=torch.int64)  # every bit set: the uniform 1 - 2^-53
    e = _exp(top)
    assert float(e) > 0
    noise = torch.cat([e, torch.ones(1)])[None]  # token 0 (probability 0) draws the zero noise
    assert int(race_sample(torch.tensor([[0.0, 1.0]]), noise)) == 1
