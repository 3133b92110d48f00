"""Adaptive k: acceptance estimates, batch-size-aware costs, switching off and probing."""
import pytest

from specdec.adaptive import AdaptiveConfig, AdaptiveK, CostModel, expected_tokens, speedup_bound


def test_expected_tokens_and_bound():
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9
    assert abs(speedup_bound(0.5, 2, 0.1) - 1.75 / 1.2) < 1e-9


def test_verify_cost_depends_on_batch_size():
    cost = CostModel()
    for _ in range(5):
        cost.observe(0, 0.0, 0, 0.060, batch=1)
        cost.observe(2, 0.0, 0, 0.070, batch=1)  # memory-bound: verifying 3 positions is cheap
        cost.observe(0, 0.0, 0, 0.075, batch=8)
        cost.observe(2, 0.0, 0, 0.150, batch=8)  # compute-bound: 24 positions cost double
    assert abs(cost.verify_cost(2, 1) - 70 / 60) < 1e-6
    assert abs(cost.verify_cost(4, 8) - 2.0) < 1e-6  # unmeasured: no dearer than the measured K=2
    assert abs(cost.verify_cost(1, 8) - 1.5) < 1e-6  # below the shortest measured: linear from K=0
    ak = AdaptiveK(AdaptiveConfig(k_max=4, prior_acceptance=0.3))
    assert ak.choose(cost, has_model=False, batch=1) > 0  # n-gram at batch 1: worth it
    assert ak.choose(cost, has_model=False, batch=8) == 0  # at batch 8: not worth it


def test_a_cheaper_longer_verify_behind_a_kernel_cliff_is_found():
    """float32 at batch 1 on a 2-core EPYC: verifying 2 positions costs 1.42 plain steps, 4
    positions 1.26 (GEMM kernels change with the row count). Priced by extrapolating from k = 1,
    k = 3 would look dear (2.3) and never be tried; priced optimistically it is tried once,
    measured, and kept."""
    step, true = 0.060, {0: 1.0, 1: 1.42, 2: 1.58, 3: 1.26}
    cost = CostModel()
    ak = AdaptiveK(AdaptiveConfig(k_max=3, prior_acceptance=0.6, prior_weight=1e6))  # a = 0.6 throughout
    cost.observe(0, 0.0, 0, step)
    cost.observe(1, 0.005, 1, step * true[1])
    ks = []
    for _ in range(5):
        k = ak.choose(cost)
        ks.append(k)
        cost.observe(k, 0.005 * k, k, step * true[k])
    assert ks[0] == 3 and ks[-1] == 3, ks
    assert abs(cost.verify_cost(3) - 1.26) < 1e-6
    # (extrapolated from k = 1, k = 3 would score 2.18 / (3 c + 2.26) = 0.87 against k = 1's 1.06)


def test_a_verify_measured_faster_than_a_plain_round_costs_one():
    """Noise can make a verify look cheaper than a plain round: it is priced as one, never below
    (below, speculation would look better than free)."""
    c = CostModel()
    c.observe(0, 0, 0, 0.060)
    c.observe(2, 0, 0, 0.050)
    assert c.verify_cost(2) == 1.0


def test_the_workload_prior_counts_one_rejection_per_round_and_waits_for_evidence():
    """A round that accepts a of its drafts and rejects the next is a + 1 trials (tokens after the
    first rejection were never judged): accepting 1 of 4 every round is a per-token acceptance of
    0.5, not 0.25; and one round is not evidence (the default until min_trials)."""
    c = CostModel()
    c.observe_acceptance(4, 1)
    assert c.acceptance_prior(0.6) == 0.6
    for _ in range(9):
        c.observe_acceptance(4, 1)
    assert c.acceptance_prior(0.6) == pytest.approx(0.5)

def test_plain_round_recalibration():
    cost = CostModel(recalibrate_every=3, throughput_min_rows=0)  # (the safeguard's own plain rounds: below)
    assert cost.needs_plain_round(4)
    cost.observe(0, 0.0, 0, 0.05, batch=4)
    assert not cost.needs_plain_round(4)
    for _ in range(3):
        cost.observe(2, 0.0, 0, 0.06, batch=4)
    assert cost.needs_plain_round(4)


def test_speculation_switches_off_and_probes():
    cfg = AdaptiveConfig(k_max=4, prior_acceptance=0.6, probe_interval=4)
    ak, cost = AdaptiveK(cfg), CostModel(prior_c=0.2)
    assert ak.choose(cost) > 0
    for _ in range(10):  # every draft rejected
        k = ak.choose(cost)
        ak.update(k, k, 0)
    assert ak.acceptance < 0.35  # it stopped proposing once speculation no longer paid
    ks = []
    for _ in range(8):
        k = ak.choose(cost)
        ks.append(k)
        ak.update(k, k, 0)
    assert ks.count(0) >= 6 and any(k > 0 for k in ks)  # mostly off, with periodic probes


# ---- the scheduler's use of the policy: mixed batches, live k_max ------------------------------
import torch  # noqa: E402

from specdec.metadata import DraftOutput, VerifyOutput  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from specdec.sequence import Sequence  # noqa: E402


def _run_rounds(sched: Scheduler, rounds: int, step_s: float = 0.05) -> list[dict[int, int]]:
    """Simulate rounds in which every draft is accepted; a round costs step_s * (1 + 0.05 K).
    Returns each round's k per sequence id."""
    history = []
    for _ in range(rounds):
        plan = sched.plan()
        if plan is None:
            break
        ks = plan.draft_batch.num_draft
        draft = DraftOutput(torch.full((len(ks), max(ks, default=0)), 7), list(ks), draft_steps=max(ks, default=0))
        sched.target_batch(plan, draft)  # as the engine does (marks prefill rounds)
        verify = VerifyOutput([[7] * (k + 1) for k in ks], list(ks))
        t = step_s * (1 + 0.05 * max(ks, default=0))
        sched.commit(plan, draft, verify, 0.002 * max(ks, default=0), t, t)
        history.append(dict(zip(plan.draft_batch.seq_ids, ks)))
    return history


def _seq(**params) -> Sequence:
    return Sequence([1, 2, 3], SamplingParams(**{"max_tokens": 10_000, "ignore_eos": True, **params}))


def test_pinned_row_does_not_starve_adaptive_rows():
    """A request's fixed k (or a seeded sampled row) shares the batch: calibration must not keep
    every adaptive row at k = 0 while it runs."""
    for pinned in ({"temperature": 1.0, "seed": 3}, {"temperature": 0, "num_speculative_tokens": 2}):
        sched = Scheduler(SchedulerConfig(max_batch_size=4, k_max=4))
        free, pin = sched.add(_seq(temperature=0)), sched.add(_seq(**pinned))
        ks = [h[free.seq_id] for h in _run_rounds(sched, 30)]
        assert sum(k > 0 for k in ks[5:]) >= 20, (pinned, ks)  # at 100% acceptance it speculates
        assert pin.num_output > 0


def test_rows_draft_along_in_a_round_that_drafts_anyway():
    """A row whose own k would be 0 (acceptance estimate 0.05) shares a batch with a row that
    drafts 3 where verifying is nearly free: the round verifies 4 positions for both, so the first
    row drafts 3 too. A request's own k is kept."""
    sched = Scheduler(SchedulerConfig(max_batch_size=4, k_max=3))
    sched.cost.prior_slope = 0.02  # a position more costs 2% of a plain round (batch 1-3 in bf16)
    good, poor = sched.add(_seq(temperature=0)), sched.add(_seq(temperature=0))
    pinned = sched.add(_seq(temperature=0, num_speculative_tokens=1))
    good.adaptive.succ, good.adaptive.trials = 95.0, 100.0
    poor.adaptive.succ, poor.adaptive.trials = 5.0, 100.0
    assert poor.adaptive.choose(sched.cost, batch=3) == 0
    for s in (good, poor, pinned):
        s.adaptive.off_rounds = 0  # (no probe due)
        s.target_offset = len(s.tokens)  # prefilled
    sched.cost.needs_plain_round = lambda batch: False
    batch = sched.plan().draft_batch
    ks = dict(zip(batch.seq_ids, batch.num_draft))
    assert ks == {good.seq_id: 3, poor.seq_id: 3, pinned.seq_id: 1}, ks


@pytest.mark.parametrize("slope, expected", [(0.25, 1), (0.0, 3)])
def test_the_round_k_is_the_batch_optimum_not_the_longest_wish(slope, expected):
    """Every row pays the verify of the longest k in the round, so the round's k maximizes the
    batch's expected tokens per round cost: one row at acceptance 0.95 among fifteen at 0.5 would
    draft 3 for itself, but where a verified position costs a quarter of a plain round (16 rows on
    a 2-core CPU) the batch gets more from 1 (and where positions are free, from 3)."""
    sched = Scheduler(SchedulerConfig(max_batch_size=16, k_max=3))
    sched.cost.prior_slope = slope
    rows = [sched.add(_seq(temperature=0)) for _ in range(16)]
    for i, s in enumerate(rows):
        s.adaptive.succ, s.adaptive.trials, s.adaptive.off_rounds = (95.0 if i == 0 else 50.0), 100.0, 0
        s.target_offset = len(s.tokens)  # prefilled
    sched.cost.needs_plain_round = lambda batch: False
    assert rows[0].adaptive.choose(sched.cost, batch=16) == 3  # its own wish, whatever the slope
    ks = sched.plan().draft_batch.num_draft
    assert ks == [expected] * 16, ks

    def per_cost(K):
        return sum(expected_tokens(s.adaptive.acceptance, K) for s in rows) / sched.cost.round_cost(K, True, 16)
    assert per_cost(expected) == max(per_cost(K) for K in (1, 2, 3))


def _run_catch_up_rounds(verify_s: float, rounds: int = 300) -> list[int]:
    """16 rows whose drafts are all accepted (k_max 1): a plain round takes 45 ms; a drafting one
    `verify_s` in the target plus a draft call of 5 ms, 5 ms more per plain round since the last
    drafting one and 50 ms more in the first (the draft catches up on those rounds' tokens and on
    the prompts, as an EAGLE draft does on their features). Returns each round's K."""
    sched = Scheduler(SchedulerConfig(max_batch_size=16, k_max=1))
    for _ in range(16):
        sched.add(_seq(temperature=0))
    history, since = [], 0
    for _ in range(rounds):
        plan = sched.plan()
        ks = plan.draft_batch.num_draft
        K = max(ks)
        draft = DraftOutput(torch.full((16, K), 7), list(ks), draft_steps=K)
        sched.target_batch(plan, draft)
        draft_s = 0.005 * (1 + since) + (0.05 if K and not any(history) else 0.0) if K else 0.0
        since = 0 if K else since + 1
        target_s = verify_s if K else 0.045
        verify = VerifyOutput([[7] * (k + 1) for k in ks], list(ks))
        sched.commit(plan, draft, verify, draft_s, target_s, draft_s + target_s)
        history.append(K)
    return history


def test_probes_are_not_charged_the_drafts_catch_up():
    """Speculating every round yields 32 tokens in 60 ms against a plain round's 16 in 45 ms, but a
    drafting round after n plain ones pays the draft's catch-up on their tokens (5 ms each here;
    measured with 16 rows: 55-75 ms against 4-6 ms). Charged to speculation, the first drafting
    rounds lose, the safeguard throttles, every probe is again a catch-up, and speculation stays off
    where it wins; priced at the steady draft cost, it stays on. Where the verify itself loses
    (100 ms), the safeguard still keeps rows plain."""
    wins = _run_catch_up_rounds(verify_s=0.055)[100:]
    assert sum(K > 0 for K in wins) >= 0.9 * len(wins), wins
    loses = _run_catch_up_rounds(verify_s=0.1)[100:]
    assert sum(K > 0 for K in loses) <= 0.15 * len(loses), loses


def test_rows_draft_nothing_in_their_prefill_round():
    """A row the target has not prefilled yet drafts nothing (no features for a model draft, and a
    Draft call would delay its prefill), nor rides along in a round that drafts anyway; a running
    row beside it keeps its k, and so does a request's own k."""
    sched = Scheduler(SchedulerConfig(max_batch_size=4, k_max=3))
    sched.cost.prior_slope = 0.0  # verified positions free: the running row's k of 3 is the batch's too
    running, new = sched.add(_seq(temperature=0)), sched.add(_seq(temperature=0))
    pinned = sched.add(_seq(temperature=0, num_speculative_tokens=2))
    for s in (running, new):
        s.adaptive.succ, s.adaptive.trials, s.adaptive.off_rounds = 95.0, 100.0, 0
    running.target_offset = len(running.tokens)
    sched.cost.needs_plain_round = lambda batch: False
    batch = sched.plan().draft_batch
    assert dict(zip(batch.seq_ids, batch.num_draft)) == {running.seq_id: 3, new.seq_id: 0, pinned.seq_id: 2}
    running.target_offset = 0  # all three new: only the request's own k drafts
    batch = sched.plan().draft_batch
    assert dict(zip(batch.seq_ids, batch.num_draft)) == {running.seq_id: 0, new.seq_id: 0, pinned.seq_id: 2}


def test_calibration_waits_for_a_round_without_prefill():
    """Calibration rounds are measured only without a prefill; new sequences arriving every round
    must neither block calibration forever nor keep the others at k = 0."""
    sched = Scheduler(SchedulerConfig(max_batch_size=64, k_max=4))
    first = sched.add(_seq(temperature=0))
    _run_rounds(sched, 1)
    ks = []
    for _ in range(30):
        sched.add(_seq(temperature=0, max_tokens=4))  # a prefill in every round (batch stays 2-3)
        ks.append(_run_rounds(sched, 1)[0][first.seq_id])
    assert sum(k > 0 for k in ks[3:]) >= 20, ks


def _run_rejected_rounds(sched: Scheduler, rounds: int, join: dict[int, int],
                         verify_slope: float = 0.05) -> list[list[int]]:
    """Rounds in which every draft is rejected (drafts and longer verifies cost more: a verify of
    K drafts costs 1 + verify_slope * K plain steps), with the throughput safeguard out of the
    way, so that only the rows' own probes bring drafts; `join[r]` rows join before round r.
    Returns each round's k per row."""
    sched.cost.speculation_wins = sched.cost.throttle = lambda batch: False
    history = []
    for r in range(rounds):
        for _ in range(join.get(r, 0)):
            sched.add(_seq(temperature=0))
        plan = sched.plan()
        ks = plan.draft_batch.num_draft
        K = max(ks)
        draft = DraftOutput(torch.full((len(ks), K), 7), list(ks), draft_steps=K)
        sched.target_batch(plan, draft)
        t = 0.05 * (1 + verify_slope * K)
        sched.commit(plan, draft, VerifyOutput([[7]] * len(ks), [0] * len(ks)), 0.002 * K, t, t)
        history.append(list(ks))
    return history


def test_rows_of_a_batch_probe_together():
    """Rows whose speculation is off probe every `probe_interval` rounds; in a batch one probing
    row makes every row's verify longer (and breaks multi-step plain rounds), so rows that joined
    at different times must probe in the same rounds, not one row per round."""
    sched = Scheduler(SchedulerConfig(max_batch_size=4, k_max=4))
    interval = sched.adaptive_cfg.probe_interval
    history = _run_rejected_rounds(sched, 40 + 8 * interval, join={0: 1, 3: 1, 6: 1, 9: 1})
    late = history[40:]  # every row long off: only probes draft
    drafting = [ks for ks in late if max(ks) > 0]
    assert 0 < len(drafting) <= len(late) // interval + 1, late
    assert sum(k > 0 for ks in drafting for k in ks) >= 3 * len(drafting), drafting  # together
    single = Scheduler(SchedulerConfig(max_batch_size=1, k_max=4))  # batch 1: probes as before
    alone = _run_rejected_rounds(single, 40 + 8 * interval, join={0: 1})[40:]
    assert sum(max(ks) > 0 for ks in alone) == len(alone) // interval, alone


def test_no_probes_where_no_k_could_pay():
    """16 rows on a 2-core CPU: a verify costs about the positions it computes (K drafts: 1 + K
    plain steps), so no k pays even at acceptance 0.9 and a probe only costs a dear round. Once
    that is measured (and one whole speculative round yielded less than plain ones), adaptive rows
    stay plain but for one re-measuring probe every `recheck_every` rounds; where verifying is
    cheap, probes go on as before."""
    dear = Scheduler(SchedulerConfig(max_batch_size=16, k_max=4))
    history = _run_rejected_rounds(dear, 400, join={0: 16}, verify_slope=1.0)
    spec = [r for r, ks in enumerate(history) if max(ks) > 0]
    assert dear.cost.cannot_pay(16, 4)
    # the first probes measure (at most one per k never measured, see CostModel.verify_cost); then
    # one more probe after recheck_every (256) rounds
    assert len(spec) <= 1 + dear.cfg.k_max and sum(r > 64 for r in spec) <= 1, spec
    assert any(r > 256 for r in spec), spec
    cheap = Scheduler(SchedulerConfig(max_batch_size=16, k_max=4))
    history = _run_rejected_rounds(cheap, 400, join={0: 16})
    assert not cheap.cost.cannot_pay(16, 4)
    assert sum(max(ks) > 0 for ks in history) >= 400 // cheap.adaptive_cfg.probe_interval - 2


def test_a_verify_no_round_picks_does_not_keep_probes_alive():
    """Verifies of 1 and 2 drafts measured dear (2x and 3x a plain round) and speculation losing:
    longer ones were never measured, because probes at low acceptance pick short k. Choosing k
    still prices them optimistically (one round would measure them), but the decision to stop
    probing prices them on the measured line (4x, 5x), so it is taken."""
    cost = CostModel()
    for k, t in ((0, 0.05), (1, 0.10), (2, 0.15)):
        for _ in range(4):
            cost.observe(k, 0.001 * k, k, t, batch=16)
            cost.observe_throughput(16, k > 0, 16, t)
    assert cost.verify_cost(4, 16) == pytest.approx(3.0)  # optimistic: as the longest measured below
    assert cost.verify_cost(4, 16, optimistic=False) == pytest.approx(5.0)
    assert cost.cannot_pay(16, 4)


def test_rounds_at_other_batch_sizes_do_not_bring_a_hopeless_probe_back():
    """The re-measuring probe of a bucket where no k can pay comes after `recheck_every` rounds of
    that bucket, not of any: a service alternating between 16 rows and single requests would
    otherwise probe again at 16 after every stretch of single requests."""
    cost = CostModel()
    for _ in range(4):
        cost.observe(0, 0.0, 0, 0.080, batch=16)
        cost.observe_throughput(16, False, 16, 0.080)
    cost.observe(1, 0.120, 1, 0.160, batch=16)  # a draft step dearer than a plain step
    cost.observe_throughput(16, True, 20, 0.280)
    assert cost.cannot_pay(16, 4)
    for _ in range(300):
        cost.observe(0, 0.0, 0, 0.040, batch=1)
    assert cost.cannot_pay(16, 4)
    for _ in range(cost.recheck_every):
        cost.observe(0, 0.0, 0, 0.080, batch=16)
    assert not cost.cannot_pay(16, 4)


def test_lowering_k_max_applies_to_running_sequences():
    sched = Scheduler(SchedulerConfig(max_batch_size=2, k_max=4))
    seq = sched.add(_seq(temperature=0))
    assert max(h[seq.seq_id] for h in _run_rounds(sched, 10)) > 1
    sched.set_config(SchedulerConfig(max_batch_size=2, k_max=1))
    assert max(h[seq.seq_id] for h in _run_rounds(sched, 10)) == 1
    late = sched.add(_seq(temperature=0))
    assert sched.adaptive_cfg.k_max == 1 and late.adaptive.cfg.k_max == 1


# ---- the measured safeguard: speculative vs plain tokens per second ----------------------------
def _trace(sched: Scheduler, rounds: int, hidden_s, step_s: float = 0.05, draft_step_s: float = 0.002) -> list[int]:
    """Rounds at 100% acceptance whose draft/target times look cheap to the cost model, while the
    round's wall time adds `hidden_s(round)` when it speculates (a hop the model does not see).
    Returns k per round of the single sequence."""
    ks = []
    for r in range(rounds):
        plan = sched.plan()
        k = plan.draft_batch.num_draft[0]
        draft = DraftOutput(torch.full((1, k), 7), [k], draft_steps=k)
        sched.target_batch(plan, draft)
        steps = plan.draft_batch.steps[0] if plan.draft_batch.steps else 1  # a multi-step plain round: steps forwards
        verify = VerifyOutput([[7] * (k + 1 if k else steps)], [k])
        verify.steps = steps
        t = step_s * (1 + 0.05 * k) * steps
        sched.commit(plan, draft, verify, draft_step_s * k, t, t + 0.002 * k + (hidden_s(r) if k else 0.0),
                     drafted=k > 0)
        ks.append(k)
    return ks


def test_throughput_safeguard_turns_speculation_off_when_it_loses():
    sched = Scheduler(SchedulerConfig(max_batch_size=1, k_max=4))
    sched.add(_seq(temperature=0))
    ks = _trace(sched, 200, lambda r: 1.0)  # 5 tokens per 1.06 s vs 1 token per 0.05 s: loses 4x
    assert sched.cost.measured_speedup(1) < 0.5
    tail = ks[100:]
    assert sum(k > 0 for k in tail) <= len(tail) // 16 + 1  # only the safeguard's probes speculate
    assert any(k > 0 for k in tail)  # ... and they do, so it can recover


def test_throughput_safeguard_keeps_speculation_that_wins_and_recovers():
    wins = Scheduler(SchedulerConfig(max_batch_size=1, k_max=4))
    wins.add(_seq(temperature=0))
    ks = _trace(wins, 200, lambda r: 0.01)  # a small hop: speculation still gains ~4x
    assert wins.cost.measured_speedup(1) > 2
    assert sum(k > 0 for k in ks[100:]) >= 90  # (calibration rounds are plain)
    # a hop that goes away (e.g. contention ends): probes re-measure and speculation comes back
    back = Scheduler(SchedulerConfig(max_batch_size=1, k_max=4))
    back.add(_seq(temperature=0))
    ks = _trace(back, 400, lambda r: 1.0 if r < 150 else 0.0)
    assert sum(k > 0 for k in ks[100:150]) <= 5
    assert sum(k > 0 for k in ks[300:]) >= 90


@pytest.mark.parametrize("plain_steps", [1, 8])
def test_measured_win_overrides_a_pessimistic_model(plain_steps):
    """The model sees drafting as dear (a draft step reported at 4 target steps) while whole rounds
    show speculation yielding more tokens/s than plain: rows speculate, not only the model's probes.
    Also beside multi-step plain rounds (the service's plain_steps 8), which emit more tokens per
    round than any speculative round, though not per forward."""
    sched = Scheduler(SchedulerConfig(max_batch_size=1, k_max=4, plain_steps=plain_steps))
    sched.add(_seq(temperature=0))
    ks = _trace(sched, 200, lambda r: 0.0, draft_step_s=0.2)
    assert sched.cost.measured_speedup(1) > 1.5  # (the model's best k >= 1 is short: drafts look dear)
    assert sum(k > 0 for k in ks[100:]) >= 90
    off = Scheduler(SchedulerConfig(max_batch_size=1, k_max=4))  # without the override: probes only
    off.cost.win_margin = float("inf")
    off.add(_seq(temperature=0))
    assert sum(k > 0 for k in _trace(off, 200, lambda r: 0.0, draft_step_s=0.2)[100:]) <= 20


def test_throughput_safeguard_leaves_pinned_rows_alone():
    """A request's own k never depends on timings."""
    sched = Scheduler(SchedulerConfig(max_batch_size=1, k_max=4))
    sched.add(_seq(temperature=0, num_speculative_tokens=3))
    assert set(_trace(sched, 120, lambda r: 1.0)) == {3}


def test_safeguard_measures_plain_rounds_first():
    cost = CostModel(throughput_min_rows=2)
    assert cost.needs_plain_round(1)
    for _ in range(2):
        cost.observe(0, 0.0, 0, 0.05, batch=1)
        cost.observe_throughput(1, False, 1, 0.05)
    assert not cost.needs_plain_round(1) and cost.measured_speedup(1) is None  # no speculative rounds yet


@pytest.mark.parametrize("spec_tokens, wins", [(1, False), (3, True)])
def test_a_measured_win_needs_more_tokens_per_round(spec_tokens, wins):
    """Plain rounds that stalled (a GC pause, a neighbour's burst) make speculative rounds look
    5x faster; with a useless draft they emit no more tokens per round than plain ones, so that
    "win" is noise and must not override the model (CI saw a random draft speculate 59% of rounds)."""
    cost = CostModel(throughput_min_rows=2)
    for _ in range(4):
        cost.observe_throughput(1, False, 1, 0.05)
        cost.observe_throughput(1, True, spec_tokens, 0.01)
    assert cost.measured_speedup(1) > 1.5
    assert cost.speculation_wins(1) is wins


def test_a_dip_of_acceptance_does_not_turn_a_winning_draft_off():
    """Speculative rounds yield 4, 4, 1, 1, 1, 1 tokens over and over (2 on average) at 1.5x a plain
    round's time: 1.33x the plain rounds' tokens/s. Tokens averaged over a few rounds only would read
    each run of rejections as a loss and throttle; the safeguard averages them over more."""
    cost = CostModel()
    pattern = [4, 4, 1, 1, 1, 1]
    loses = []
    for r in range(120):
        cost.observe_throughput(1, False, 1, 0.060)
        cost.observe_throughput(1, True, pattern[r % len(pattern)], 0.090)
        loses.append(cost.speculation_loses(1))
    assert not any(loses[12:])
    assert 1.1 < cost.measured_speedup(1) < 1.6


def test_the_safeguard_weighs_a_round_by_its_rows():
    """A speculative round of 8 rows holds 8 rows' acceptance: one such round that yields a quarter
    of a plain round's tokens/s is evidence enough (a lane of 8 used to pay four losing rounds in
    the service before the safeguard judged); one round of a single row is not."""
    lane = CostModel()
    lane.observe_throughput(8, False, 64, 1.0)
    lane.observe_throughput(8, True, 10, 0.6)
    assert lane.speculation_loses(8)
    alone = CostModel()
    for _ in range(4):
        alone.observe_throughput(1, False, 1, 0.05)
    alone.observe_throughput(1, True, 1, 0.2)
    assert alone.measured_speedup(1) is None and not alone.speculation_loses(1)


def test_lookup_gate_measures_both_sides_then_weighs_gain_against_cost():
    """Lookups in multi-step plain rounds pay with accepted tokens per forward and cost wider
    forwards: a bucket first runs a round with them and one without (both times measured), then
    carries them only while the rows' mean gain exceeds the measured extra cost, re-measuring
    the other side every `remeasure_every` rounds; buckets are independent."""
    from specdec.adaptive import LookupGate
    g = LookupGate(remeasure_every=16, min_samples=2)
    sampled, greedy = [0.1] * 8, [0.6] * 8
    for _ in range(2):  # nothing measured: alternate, lookups first (the configured behaviour)
        assert g.use(8, sampled)
        g.observe(8, True, 0.140)
        assert not g.use(8, greedy)
        g.observe(8, False, 0.100)
    assert g.cost(8) == pytest.approx(1.4)
    assert not g.use(8, sampled)  # 1.1 tokens per forward for 1.4x the time: lookups lose
    assert g.use(8, greedy)  # 1.6 for 1.4: they pay
    assert not g.use(8, [0.6] * 4 + [0.1] * 4)  # the batch's mean, 0.35, does not pay 0.4
    assert g.use(8, [0.6] * 6 + [0.1] * 2)  # 0.475 does
    assert [g.use(8, sampled) for _ in range(8)] == [False] * 7 + [True]  # round 16 takes the other side
    assert g.gated == 11
    assert g.use(1, sampled)  # another bucket: its own measurements
    assert g.to_dict() == {"cost": {8: 1.4}, "straggle": {}, "rounds": 17, "rounds_without": 11}  # /stats


def test_lookup_gate_weighs_the_rows_that_finish_last():
    """A round with lookups lasts as long as its slowest row: the gate compares the rows' gain with
    the measured cost times `straggle`, a lookup round's forwards over its rows' mean forwards. With
    the same gain and cost, rows that finish unevenly turn lookups off; rows that finish together
    keep them (fake trace)."""
    from specdec.adaptive import LookupGate
    even, uneven = LookupGate(remeasure_every=1000, min_samples=2), LookupGate(remeasure_every=1000, min_samples=2)
    for g, forwards in ((even, [6, 6, 6, 6]), (uneven, [4, 5, 6, 9])):
        for _ in range(3):
            g.use(4, [0.5] * 4)
            g.observe(4, True, 0.120, forwards)
            g.use(4, [0.5] * 4)
            g.observe(4, False, 0.100)
    assert even.cost(4) == uneven.cost(4) == pytest.approx(1.2)
    assert even.to_dict()["straggle"] == {4: 1.0} and uneven.to_dict()["straggle"] == {4: 1.5}
    assert even.use(4, [0.5] * 4)  # 1.5 tokens per forward for 1.2x the time
    assert not uneven.use(4, [0.5] * 4)  # the round runs 1.5x its rows' mean forwards: 1.5 < 1.8
    assert uneven.use(4, [0.9] * 4)  # 1.9 pays for 1.8



def test_lookup_gain_leans_on_the_workload_until_a_row_has_its_own():
    from specdec.adaptive import LookupGate
    g = LookupGate(prior_gain=0.5, prior_weight=4)
    assert g.gain(0, 0) == pytest.approx(0.5)  # no evidence at all: optimistic
    g.observe_row(forwards=100, hits=10)
    assert g.gain(0, 0) == pytest.approx(0.1)  # a new row: the workload's recent gain
    assert g.gain(30, 36) == pytest.approx((30 + 0.4) / 40)  # a row with its own evidence


def test_a_round_whose_rows_the_target_did_not_hold_measures_nothing():
    """Rows the target did not hold (out of slots, a restarted replica) come back at once with no
    tokens: such a round is no measurement of a forward's cost or of tokens/s (it priced a forward
    near zero and dragged the safeguard's tokens/s down)."""
    sched = Scheduler(SchedulerConfig(max_batch_size=1, k_max=4))
    sched.add(_seq(temperature=0))
    _trace(sched, 30, lambda r: 0.0)
    cost = sched.cost
    before = (dict(cost.target), {k: list(v) for k, v in cost.throughput.items()}, cost.rounds)
    plan = sched.plan()
    k = plan.draft_batch.num_draft[0]
    draft = DraftOutput(torch.full((1, k), 7), [k], draft_steps=k)
    sched.target_batch(plan, draft)
    verify = VerifyOutput([[]], [0])
    verify.unknown = [0]
    sched.commit(plan, draft, verify, 0.001 * k, 0.001, 0.003, drafted=k > 0)
    assert (dict(cost.target), {k: list(v) for k, v in cost.throughput.items()}, cost.rounds) == before


def test_a_measured_win_lifts_only_rows_whose_own_drafts_are_accepted():
    """Speculative rounds measurably win at this batch size (lanes share the measurement), yet a
    row whose drafts are never accepted does not share the win: it stays plain, while a row whose
    drafts are accepted speculates though the model prices drafting as dear. Before, the row with
    acceptance 0 drafted in every round (a lane of such rows beside a lane that wins: -28%)."""
    cost = CostModel(throughput_min_rows=2)
    for _ in range(4):
        cost.observe_throughput(1, False, 1, 0.05)
        cost.observe_throughput(1, True, 3, 0.01)
    cost.observe(0, 0.0, 0, 0.05)
    cost.observe(1, 0.2, 1, 0.05)  # a draft step priced at 4 target steps: the model says no
    assert cost.speculation_wins(1) and cost.win_floor(1) == pytest.approx(cost.win_margin)
    dead, live = (AdaptiveK(AdaptiveConfig(k_max=4)) for _ in range(2))
    dead.succ, dead.trials, live.succ, live.trials = 0.0, 10.0, 8.0, 10.0
    assert live.choose(cost, measured_win=False, probe=False) == 0  # the model alone: off
    assert live.choose(cost, measured_win=True, probe=False, win_floor=cost.win_floor(1)) >= 1
    assert dead.choose(cost, measured_win=True, probe=False, win_floor=cost.win_floor(1)) == 0


def test_a_draft_context_that_restarts_is_a_catch_up():
    """After a Draft outage (the Batcher resets every row's draft offset) or a row the Draft
    replica lost, the next drafting round sends whole contexts: its draft time is no step's. Before,
    it was charged as one (a 0.5 s re-read of 4 rows made a 3 ms step look like 31 ms) and kept
    speculation off for good after a 5 s outage."""
    sched = Scheduler(SchedulerConfig(max_batch_size=2, k_max=2, adaptive=False))
    for _ in range(2):
        sched.add(_seq(temperature=0))
    catch_ups = []
    for r in range(4):
        if r == 3:
            for s in sched.running:
                s.draft_offset = 0  # (deployments.batcher: a failed Draft call)
        plan = sched.plan()
        catch_ups.append(plan.catch_up)
        ks = plan.draft_batch.num_draft
        draft = DraftOutput(torch.full((2, max(ks)), 7), list(ks), draft_steps=max(ks))
        sched.target_batch(plan, draft)
        sched.commit(plan, draft, VerifyOutput([[7] * (k + 1) for k in ks], list(ks)), 0.01, 0.05, 0.06)
    assert catch_ups == [True, False, False, True]  # (the first round: new rows' whole prompts)


def test_the_draft_step_cost_counts_steady_drafting_rounds_only():
    """SpecStats.draft_steps / draft_step_time (what specdec-bench's c is computed from): the
    proposer forwards of drafting rounds, without the prompt's prefill round and without rounds
    whose draft caught up on plain rounds' tokens. c used to divide all draft time by k steps per
    round (rows near their budget draft fewer; a prefill is no step): 4-5% off."""
    sched = Scheduler(SchedulerConfig(max_batch_size=1, k_max=2, adaptive=False))
    sched.add(_seq(temperature=0))
    rounds = _run_rounds(sched, 6)  # the first is the prompt's prefill; draft time 0.002 s a step
    assert all(list(r.values()) == [2] for r in rounds)
    st = sched.stats
    assert st.draft_steps == 2 * 5 and st.draft_step_time == pytest.approx(0.004 * 5)
    assert st.draft_time == pytest.approx(0.004 * 6)  # (the prefill's draft time is not a step's)
