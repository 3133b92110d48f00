"""One speculative round, written once (Leviathan et al. 2023; the loop of gpt-fast's
`speculative_decode` and of vLLM's propose / verify / accept):

    plan   = scheduler.plan()                          # who runs, k per row, uniforms
    draft  = propose(plan)                             # the proposer (none called when no row drafts)
    verify = verify(plan, draft)                       # the target: one forward + rejection sampler
    scheduler.commit(plan, draft, verify, times)       # append, stops, adaptive k, stats

`round_steps` is the round as a sans-IO generator: it yields the two calls it needs and receives
their results. The in-process engine drives it with plain calls (`run_round`); the Ray Serve
router drives it with awaited deployment-handle calls that add pinning, retries and tracing
(`run_round_async`). Neither repeats the round.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Generator, Union

from specdec.metadata import DraftOutput, VerifyOutput
from specdec.scheduler import RoundPlan, Scheduler


@dataclass
class Propose:
    """The round asks for drafts of `plan.draft_batch`; answer (DraftOutput, drafted), where
    drafted says a proposer was called (with no row to draft for, answer an empty one, False)."""
    plan: RoundPlan


@dataclass
class Verify:
    """The round asks the target to verify `draft`; answer a VerifyOutput, or None to abandon the
    round (the caller gave up on it and failed its sequences)."""
    plan: RoundPlan
    draft: DraftOutput


@dataclass
class RoundResult:
    plan: RoundPlan
    draft: DraftOutput
    verify: VerifyOutput
    drafted: bool  # a proposer was called (its rows' offsets advanced)
    plan_s: float  # scheduler.plan()
    draft_s: float  # from the round's start to the drafts (plan included), as the cost model sees it
    target_s: float  # the verify call
    round_s: float  # plan + calls: the wall time the throughput safeguard compares

    @property
    def emitted(self) -> list[int]:
        return [len(t) for t in self.verify.tokens]

    @property
    def judged_drafts(self) -> list[int]:
        """Draft tokens per row that the target verified (0 for rows it did not hold: `unknown`)."""
        unknown = set(self.verify.unknown)
        return [0 if i in unknown else n for i, n in enumerate(self.draft.num_draft)]


Call = Union[Propose, Verify]
Steps = Generator[Call, object, "RoundResult | None"]


def round_steps(scheduler: Scheduler) -> Steps:
    t0 = time.perf_counter()
    plan = scheduler.plan()
    if plan is None:
        return None
    tp = time.perf_counter()
    draft, drafted = yield Propose(plan)  # (a proposer side with nothing to draft answers at once)
    t1 = time.perf_counter()
    verify = yield Verify(plan, draft)
    if verify is None:
        return None
    t2 = time.perf_counter()
    scheduler.commit(plan, draft, verify, t1 - t0, t2 - t1, t2 - t0, drafted)
    return RoundResult(plan, draft, verify, drafted, tp - t0, t1 - t0, t2 - t1, t2 - t0)


def run_round(scheduler: Scheduler, propose: Callable[[RoundPlan], tuple[DraftOutput, bool]],
              verify: Callable[[RoundPlan, DraftOutput], VerifyOutput | None]) -> RoundResult | None:
    """One round with synchronous calls."""
    steps = round_steps(scheduler)
    try:
        call = next(steps)
    except StopIteration as done:
        return done.value
    while True:
        answer = propose(call.plan) if isinstance(call, Propose) else verify(call.plan, call.draft)
        try:  # (only the round's own end: a StopIteration out of a call is that call's error)
            call = steps.send(answer)
        except StopIteration as done:
            return done.value


async def run_round_async(steps: Steps, first: Call,
                          propose: Callable[[RoundPlan], Awaitable[tuple[DraftOutput, bool]]],
                          verify: Callable[[RoundPlan, DraftOutput], Awaitable[VerifyOutput | None]]
                          ) -> RoundResult | None:
    """The rest of a round whose first call (`next(steps)`) the caller already took, so that it
    could open a span over the planned batch; the calls are awaited."""
    call = first
    while True:
        answer = await (propose(call.plan) if isinstance(call, Propose) else verify(call.plan, call.draft))
        try:  # (only the round's own end: a StopIteration out of a call is that call's error)
            call = steps.send(answer)
        except StopIteration as done:
            return done.value
