"""specdec.round: the round written once, driven synchronously and asynchronously."""
from __future__ import annotations

import pytest

import torch

from specdec.metadata import DraftOutput, VerifyOutput
from specdec.round import Propose, Verify, round_steps, run_round, run_round_async
from specdec.sampling import SamplingParams
from specdec.scheduler import Scheduler, SchedulerConfig
from specdec.sequence import Sequence


def _sched() -> Scheduler:
    s = Scheduler(SchedulerConfig(max_batch_size=2, k_max=2, adaptive=False))
    for _ in range(2):
        s.add(Sequence([1, 2, 3], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)))
    return s


def _propose(plan):
    ks = plan.draft_batch.num_draft
    return DraftOutput(torch.full((len(ks), max(ks)), 7), list(ks), draft_steps=max(ks)), True


def _verify(plan, draft):
    return VerifyOutput([[7] * (k + 1) for k in draft.num_draft], list(draft.num_draft))


def test_one_round_asks_for_drafts_then_verification_and_commits_once():
    sched = _sched()
    steps = round_steps(sched)
    call = next(steps)
    assert isinstance(call, Propose) and call.plan.draft_batch.num_draft == [2, 2]
    call = steps.send(_propose(call.plan))
    assert isinstance(call, Verify) and call.draft.num_draft == [2, 2]
    try:
        steps.send(_verify(call.plan, call.draft))
    except StopIteration as done:
        r = done.value
    assert r.emitted == [3, 3] and r.drafted and sched.stats.rounds == 1
    assert [s.num_output for s in sched.running] == [3, 3]


@pytest.mark.asyncio
async def test_sync_and_async_drivers_give_the_same_rounds():
    async def propose(plan):
        return _propose(plan)

    async def verify(plan, draft):
        return _verify(plan, draft)

    a, b = _sched(), _sched()
    for _ in range(5):
        ra = run_round(a, _propose, _verify)
        steps = round_steps(b)
        rb = await run_round_async(steps, next(steps), propose, verify)
        assert ra.emitted == rb.emitted
    assert [s.output_ids for s in a.running] == [s.output_ids for s in b.running]
    assert a.stats.emitted == b.stats.emitted == 30


def test_an_abandoned_verification_commits_nothing():
    sched = _sched()
    assert run_round(sched, _propose, lambda plan, draft: None) is None
    assert sched.stats.rounds == 0 and all(s.num_output == 0 for s in sched.running)


def test_no_plan_no_round():
    assert run_round(Scheduler(SchedulerConfig()), _propose, _verify) is None


@pytest.mark.asyncio
async def test_a_call_that_raises_stop_iteration_fails_the_round_not_ends_it():
    """A StopIteration out of a call (a bug in it) is its error: the drivers took it for the
    round's own end, returned nothing as if the target had abandoned the round, and a loop of such
    rounds never progressed (a hang, no error)."""
    def broken(plan, draft):
        raise StopIteration

    async def broken_async(plan, draft):
        raise StopIteration

    async def propose(plan):
        return _propose(plan)
    with pytest.raises(StopIteration):
        run_round(_sched(), _propose, broken)
    steps = round_steps(_sched())
    with pytest.raises((StopIteration, RuntimeError)):  # (a coroutine turns it into RuntimeError)
        await run_round_async(steps, next(steps), propose, broken_async)


def test_a_sampled_rows_rounds_draw_fresh_uniforms_keyed_by_its_position():
    """An unseeded sampled row's round draws its accept tests and recovered/bonus tokens from
    uniforms keyed by (its seed, the position the round starts at, k): fresh in every round (a
    round reusing an earlier round's draws correlates the tokens of the two, a bias no per-round
    check sees) and the same when a failed call makes the round run again."""
    from specdec.sampling import round_uniforms
    sched = Scheduler(SchedulerConfig(max_batch_size=1, k_max=2, adaptive=False))
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=50, temperature=1.0, ignore_eos=True))
    sched.add(seq)
    seen = []

    def propose(plan):
        seen.append((len(seq.tokens), plan.draft_batch.uniforms[0, :, :3].clone()))
        return _propose(plan)
    for _ in range(3):
        run_round(sched, propose, _verify)
    assert [pos for pos, _ in seen] == [3, 6, 9]
    for pos, u in seen:
        assert torch.equal(u, round_uniforms(seq.base_seed, pos, 2))
    assert not any(torch.equal(a, b) for (_, a), (_, b) in zip(seen, seen[1:]))


def test_a_requests_k_is_capped_by_the_deployment_and_by_what_it_may_still_emit():
    """num_speculative_tokens above k_max drafts k_max (the deployment's cap: its buffers and cost
    model stop there); a row drafts at most remaining - 1 tokens (a round also emits one of its own)."""
    sched = Scheduler(SchedulerConfig(max_batch_size=2, k_max=2, adaptive=False))
    for n in (50, 2):
        sched.add(Sequence([1, 2, 3], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                     num_speculative_tokens=5)))
    asked = []
    run_round(sched, lambda plan: (asked.append(list(plan.draft_batch.num_draft)), _propose(plan))[1], _verify)
    assert asked == [[2, 1]]


def test_a_sequence_aborted_while_its_round_ran_takes_nothing_from_it():
    """A client that leaves while its row's round runs (the call is in flight): the commit skips the
    row, so neither its sequence nor the statistics count the round's tokens for it."""
    sched = _sched()
    run_round(sched, _propose, _verify)
    gone = sched.running[0]
    before = (gone.num_output, gone.proposed, gone.rounds, sched.stats.emitted, sched.stats.proposed)
    steps = round_steps(sched)
    call = steps.send(_propose(next(steps).plan))
    sched.abort(gone.seq_id)
    try:
        steps.send(_verify(call.plan, call.draft))
    except StopIteration as done:
        r = done.value
    assert r.plan.kept == [0, 3]
    assert (gone.num_output, gone.proposed, gone.rounds) == before[:3]
    assert (sched.stats.emitted, sched.stats.proposed) == (before[3] + 3, before[4] + 2)


def test_a_row_the_target_did_not_hold_resends_its_whole_context():
    """A row the target reports unknown (a restarted or new replica, a slot it could not give)
    emits nothing, and the next round sends its whole context from position 0 (without it the row
    would be unknown forever, and its request would hang)."""
    sched = _sched()
    run_round(sched, _propose, _verify)
    lost = sched.running[0]
    sent = []

    def verify(plan, draft):
        sent.append(sched.target_batch(plan, draft))
        out = _verify(plan, draft)
        if len(sent) == 1:
            out.tokens[0], out.num_accepted[0], out.unknown = [], 0, [0]
        return out
    before = list(lost.tokens)
    run_round(sched, _propose, verify)
    assert lost.tokens == before
    run_round(sched, _propose, verify)
    assert sent[1].offsets[0] == 0 and sent[1].new_tokens[0] == before and sent[0].offsets[0] == len(before)


def _commit(sched, drafts: list[int], emitted: list[int], accepted: int, unknown_d=(), planned=None):
    """Commit one planned round of one row: `drafts` proposed, the target emitting `emitted`."""
    plan = planned or sched.plan()
    tokens = torch.tensor([drafts], dtype=torch.long) if drafts else torch.zeros(1, 0, dtype=torch.long)
    sched.commit(plan, DraftOutput(tokens, [len(drafts)], unknown=list(unknown_d)),
                 VerifyOutput([emitted], [accepted]), 0.0, 0.01, 0.01)
    return plan


def test_a_multi_step_round_stops_a_row_at_its_end_token_inside_the_target():
    """The stop ids a multi-step plain round sends hold the end-of-sequence ids beside the
    request's stop_token_ids (without them the target decoded past the end, tokens thrown away)."""
    sched = Scheduler(SchedulerConfig(k_max=0, speculate=False, plain_steps=8), eos_token_ids=[2])
    for params in (SamplingParams(max_tokens=50, temperature=0), SamplingParams(max_tokens=50, temperature=0, stop_token_ids=[9]),
                   SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, stop_token_ids=[9])):
        seq = sched.add(Sequence([5, 6], params))
        seq.target_offset = len(seq.tokens)  # prefilled: the round runs multi-step
    b = sched.plan().draft_batch
    assert b.steps == [8, 8, 8] and b.stop_ids == [[2], [2, 9], [9]]


def test_after_a_round_without_a_proposer_call_the_proposer_is_sent_what_it_missed():
    """A plain round calls no proposer: the next drafting round must send it the plain round's
    tokens too (with them booked as sent, the proposer never saw the sequence, called it unknown,
    and that round drafted nothing)."""
    from specdec.proposers.ngram import NgramProposer
    sched = Scheduler(SchedulerConfig(k_max=2, adaptive=False))
    seq = sched.add(Sequence([1, 2, 3, 1, 2], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True,
                                                             num_speculative_tokens=0)))
    run_round(sched, lambda plan: (DraftOutput.empty(1), False), lambda plan, d: VerifyOutput([[3]], [0]))
    seq.params.num_speculative_tokens = None
    plan = sched.plan()
    out = NgramProposer().propose(plan.draft_batch)
    assert plan.draft_batch.offsets == [0] and plan.draft_batch.new_tokens == [[1, 2, 3, 1, 2, 3]]
    assert out.unknown == [] and out.num_draft[0] > 0


def test_a_row_the_proposer_lost_resends_its_whole_context_to_it():
    """A Draft replica that no longer holds a row (restarted, evicted) reports it unknown; the next
    round sends the proposer the whole context (else it stayed unknown, and undrafted, for good)."""
    sched = Scheduler(SchedulerConfig(k_max=2, adaptive=False))
    seq = sched.add(Sequence([1, 2, 3], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)))
    _commit(sched, [], [8], 0, unknown_d=[0])
    b = sched.plan().draft_batch
    assert b.offsets == [0] and b.new_tokens == [seq.tokens] == [[1, 2, 3, 8]]


def test_committed_rounds_feed_the_workload_prior_and_the_rows_estimate_by_what_was_proposed():
    """New sequences start from the workload's recent acceptance: after rounds whose drafts were
    all rejected it is near 0. A round whose proposer found nothing (0 of the 3 planned drafts
    proposed) leaves a row's acceptance estimate alone: nothing it drafted was rejected."""
    sched = Scheduler(SchedulerConfig(k_max=3, adaptive=False))
    sched.add(Sequence([1, 2, 3], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)))
    for _ in range(20):
        plan = sched.plan()
        k = plan.draft_batch.num_draft[0]
        _commit(sched, [7] * k, [8], 0, planned=plan)
    assert sched.cost.acceptance_prior(0.6) < 0.1
    sched = Scheduler(SchedulerConfig(k_max=3, adaptive=False))
    seq = sched.add(Sequence([1, 2, 3], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)))
    before = seq.adaptive.acceptance
    for _ in range(10):
        _commit(sched, [], [8], 0)
    assert seq.adaptive.acceptance == pytest.approx(before) and sched.cost.acceptance_prior(0.6) == 0.6


def test_statistics_count_what_the_target_emitted_even_past_a_stop():
    """SpecStats' emitted is accepted + 1 per row-round (what a target forward yielded), also when
    the row stops inside the round and keeps fewer (the request's usage counts what it kept)."""
    sched = Scheduler(SchedulerConfig(k_max=2, adaptive=False))
    seq = sched.add(Sequence([1, 2, 3], SamplingParams(max_tokens=50, temperature=0, stop_token_ids=[7])))
    _commit(sched, [7, 8], [7, 8, 9], 2)
    assert (sched.stats.accepted, sched.stats.emitted, seq.output_ids) == (2, 3, [7])


def test_a_multi_step_round_with_lookups_may_emit_past_one_token_per_step():
    """Accepted lookups save target calls only if a row may emit more tokens than the round has
    forwards: its budget is what it may still emit (max_tokens left), not the step count."""
    sched = Scheduler(SchedulerConfig(k_max=0, plain_steps=4, lookup_k=3, lookup_max_batch=4, adaptive=False))
    seq = sched.add(Sequence([5, 6, 5, 6], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)))
    seq.target_offset = len(seq.tokens)
    b = sched.plan().draft_batch
    assert (b.steps, b.lookup, b.row_budget(0)) == ([4], [3], 50)


def test_drafts_of_rows_the_target_did_not_hold_were_not_judged():
    """The router's acceptance metrics count judged drafts: none for a row reported unknown."""
    from specdec.round import RoundResult
    r = RoundResult(None, DraftOutput(torch.zeros(2, 3, dtype=torch.long), [3, 3]),
                    VerifyOutput([[], [5, 6]], [0, 1], unknown=[0]), True, 0, 0, 0, 0)
    assert r.judged_drafts == [0, 3]
