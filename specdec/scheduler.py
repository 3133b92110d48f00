"""Continuous batching of speculative rounds: who runs, with which k, and what each side is sent.

`plan()` admits waiting sequences (up to `max_batch_size`), picks each row's k (fixed by the
request, or adaptive), draws the row's uniforms (keyed by its seed and position) and builds the round's
`SpecBatch` for the proposer. `target_batch()` builds the target's view once the drafts are known,
and `commit()` appends what the target emitted (stop conditions included), updates offsets,
adaptive state and stats, and retires finished sequences. Sequences join and leave between rounds.

The round that calls proposer and target is `specdec.round` (driven in process by
`engine.LLMEngine.step` and against deployment handles by the Ray Serve router).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields, replace

import torch

from specdec import runner
from specdec.adaptive import AdaptiveConfig, AdaptiveK, CostModel, expected_tokens
from specdec.metadata import DraftOutput, SpecBatch, VerifyOutput
from specdec.sampling import position_uniforms, round_uniforms
from specdec.sequence import FINISH_STOP, Sequence
from specdec.stats import SpecStats


@dataclass
class SchedulerConfig:
    max_batch_size: int = 8
    max_model_len: int = 2048
    k_max: int = 4  # cap for adaptive k and for a request's num_speculative_tokens
    speculate: bool = True  # False: plain decoding (k = 0 for every row)
    adaptive: bool = True  # False: every row uses k_max unless the request says otherwise
    features: bool = False  # pass the target's features to the proposer (EAGLE-style drafts)
    plain_steps: int = 1  # a round where no row drafts decodes up to this many tokens per row in
    # one target call (the service: the call's hops paid once for all of them), the same tokens
    # as that many plain rounds
    siblings_max_batch: int = 0  # rounds of at most this many rows verify, beside each greedy
    # row's chain, a sibling of its first draft (SpecBatch.siblings); 0: chains only
    lookup_k: int = 0  # multi-step plain rounds of at most `lookup_max_batch` rows: every row may
    lookup_max_batch: int = 0  # verify up to lookup_k prompt-lookup tokens per step (SpecBatch.lookup)
    ngram_k: int = 0  # rounds of one row: a greedy row's drafts found by prompt lookup may run this
    # long (SpecBatch.ngram_k; they cost no draft forward), and so may a plain round's lookups
    max_prefill_tokens: int = 0  # a row feeds the target at most about this many tokens of a long
    # prompt per round, the rest in later rounds while the other rows decode (`target_end`); 0: all at once


def scheduler_config(cfg, **overrides) -> SchedulerConfig:
    """A SchedulerConfig from any config object holding its fields by name (the engine's, the
    router's), `num_speculative_tokens` as k_max; `overrides` win."""
    names = {f.name for f in fields(SchedulerConfig)}
    found = {n: getattr(cfg, n) for n in names if hasattr(cfg, n)}
    return SchedulerConfig(**{**found, "k_max": cfg.num_speculative_tokens, **overrides})


@dataclass
class RoundPlan:
    seqs: list[Sequence]
    draft_batch: SpecBatch
    prefill: bool = False  # some row brings a prompt (or a resent context): timings are not a step's
    catch_up: bool = False  # a drafting round after plain ones (or a row's restarted draft context): the draft catches up
    kept: list[int] = field(default_factory=list)  # (commit) tokens each row's sequence kept: after its stop, 0 if aborted or unknown
    target_ends: list[int] = field(default_factory=list)  # (target_batch) where each row's feed to the target ends


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, tokenizer=None, eos_token_ids=(), proposer_has_model: bool = True,
                 adaptive_cfg: AdaptiveConfig | None = None, cost: CostModel | None = None,
                 stats: SpecStats | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.proposer_has_model = proposer_has_model
        self.adaptive_cfg = adaptive_cfg or AdaptiveConfig(k_max=cfg.k_max)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.to_release: list[int] = []
        self.cost = cost or CostModel()  # may be shared by several schedulers (the router's lanes)
        self.plain_run = 0  # rounds in a row in which no row drafted (the batch's probe clock)
        self.stats = stats if stats is not None else SpecStats()  # may be shared too (the router's lanes)

    # ---- membership -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> Sequence:
        seq.eos_token_ids = seq.eos_token_ids or self.eos_token_ids
        seq.max_model_len = min(seq.max_model_len, self.cfg.max_model_len)
        prior = self.cost.acceptance_prior(self.adaptive_cfg.prior_acceptance)
        seq.adaptive = AdaptiveK(replace(self.adaptive_cfg, prior_acceptance=prior))
        self.waiting.append(seq)
        return seq

    def abort(self, seq_id: int) -> Sequence | None:
        for q in (self.waiting, self.running):
            for s in q:
                if s.seq_id == seq_id:
                    s.abort()
                    q.remove(s)
                    if q is self.running:
                        self.to_release.append(seq_id)
                    return s
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_releases(self) -> list[int]:
        out, self.to_release = self.to_release, []
        return out

    # ---- planning ---------------------------------------------------------------------------
    def set_config(self, cfg: SchedulerConfig) -> None:
        """Replace the live configuration (the router's user_config): k_max applies at once,
        to running sequences too."""
        self.cfg = cfg
        self.adaptive_cfg = replace(self.adaptive_cfg, k_max=cfg.k_max)

    def pinned_k(self, seq: Sequence) -> bool:
        """The row's k is the request's own (num_speculative_tokens), not the adaptive policy's."""
        return seq.params.num_speculative_tokens is not None

    @staticmethod
    def coupled(seq: Sequence) -> bool:
        """A seeded sampled row: its speculative rounds are verified against plain decoding's own
        draws (`coupled_verify`, uniforms keyed by position), so that its output is plain
        decoding's for its seed whatever the drafts, k, round structure, batch or failed calls (a
        draft replica down, no free draft slot): reproducible. Its drafts are then accepted with
        probability p(x) rather than min(1, p/q)."""
        return seq.params.seed is not None and not seq.params.greedy

    def choose_k(self, seq: Sequence, batch: int = 1, calibrate: bool = False, throttle: bool = False,
                 probe: bool = True) -> int:
        """k for this row's next round, at most the live k_max and what the row may still emit.
        `calibrate` / `throttle`: adaptive rows run plain. `probe`: an adaptive row due for a
        probing round may draft."""
        req = seq.params.num_speculative_tokens
        if not self.cfg.speculate or self.target_end(seq) < len(seq.tokens):  # (drafts follow a whole prompt)
            k = 0
        elif req is not None:
            k = req
        elif self.cfg.adaptive:
            if calibrate or throttle or self.prefilling(seq):
                return 0  # calibration: measures t(B, 0); throttle: speculation measurably loses here; `prefilling`
            wins = self.cost.speculation_wins(batch)
            k = seq.adaptive.choose(self.cost, self.proposer_has_model, batch, k_max=self.cfg.k_max, measured_win=wins,
                                    probe=probe, win_floor=self.cost.win_floor(batch) if wins else 1.0)
        else:
            k = self.cfg.k_max
        return max(0, min(k, self.cfg.k_max, seq.remaining - 1))

    @staticmethod
    def prefilling(seq: Sequence) -> bool:
        """The target lacks some of the row's context (a new prompt, a resent one). Such a row of
        the adaptive policy drafts nothing in that round: a model draft that reads the target's
        features has none for it yet, and the Draft call delays its prefill (through HTTP, lanes of
        4 new rows at temperature 1: a speculative prefill round took 190 ms for 3.2 tokens, 26 ms
        of it the Draft call; prefill rounds feed no cost model, so the adaptive policy could not
        learn it; BENCHMARKS.md "Prefill rounds draft nothing")."""
        return seq.target_offset < len(seq.tokens)

    def target_end(self, seq: Sequence) -> int:
        """Where the row's feed to the target ends this round: at its last token, or, for a long
        prompt (more than `max_prefill_tokens` tokens to go), at a multiple of the runner's prefill
        chunk about that far on (chunked prefill across rounds, as vLLM's: a long prompt no longer
        holds the lane's other rows, and the other lanes of its target replica, for its whole
        prefill). The cuts depend on positions only, as the runner's own cuts within a call do, so
        the prompt's keys and values are the same with and without speculation."""
        n, at, budget = len(seq.tokens), seq.target_offset, self.cfg.max_prefill_tokens
        if not budget or n - at <= budget:
            return n
        size = runner.PREFILL_CHUNK
        return min(n, max((at + budget) // size, at // size + 1) * size)

    def plan(self) -> RoundPlan | None:
        while self.waiting and len(self.running) < self.cfg.max_batch_size:
            self.running.append(self.waiting.popleft())
        if not self.running:
            return None
        seqs = list(self.running)
        B = len(seqs)
        prefill = any(map(self.prefilling, seqs))
        # A calibration round is plain for every row, so that it measures t(B, 0): only when no
        # row's k is pinned, and without a prefill (whose time would not be a step's). Until
        # such a round comes, rows choose from the costs measured so far, never stuck at k = 0.
        calibrate = (self.cfg.speculate and self.cfg.adaptive and not prefill and self.cost.needs_plain_round(B)
                     and not any(self.pinned_k(s) for s in seqs))
        throttle = self.cfg.speculate and self.cfg.adaptive and not calibrate and (
            self.cost.cannot_pay(B, self.cfg.k_max, self.proposer_has_model) or self.cost.throttle(B))
        ks = self._choose_ks(seqs, calibrate, throttle)
        K = max(ks)
        # (a row whose draft context restarts, after a Draft outage or an unknown row, sends it whole)
        catch_up = K > 0 and (self.plain_run > 0 or any(s.draft_offset == 0 for s in seqs))
        self.plain_run = 0 if K else self.plain_run + 1
        steps = self._plain_steps(seqs, prefill) if K == 0 else None
        small = B <= self.cfg.lookup_max_batch  # prompt lookup pays in small rounds only
        ngram_k = [self._ngram_k(s, k) for s, k in zip(seqs, ks)] if K and B == 1 and small else None
        lookup = self._lookups(seqs) if steps and small else None
        # a multi-step round's row emits up to steps * (1 + lookup) tokens, each drawing as a plain round would
        draws = [min(s.remaining, n * (1 + (lookup[i] if lookup else 0))) for i, (s, n) in enumerate(zip(seqs, steps))] \
            if steps else None
        uniforms = torch.zeros(len(seqs), 3, max(draws or [max(ngram_k or [K]) + 1]), dtype=torch.float64)
        coupled = [self.coupled(s) for s in seqs] if not steps else None
        for i, (s, k) in enumerate(zip(seqs, ks)):
            if s.params.greedy:
                continue
            if steps or coupled[i]:  # the row's j-th token draws as the plain round at position len + j would
                n = draws[i] if steps else k + 1
                uniforms[i, :, :n] = position_uniforms(s.base_seed, len(s.tokens), n)
            else:  # keyed by (seed, position, k): independent of batch and retries
                uniforms[i, :, : k + 1] = round_uniforms(s.base_seed, len(s.tokens), k)
        batch = SpecBatch(
            seq_ids=[s.seq_id for s in seqs],
            offsets=[s.draft_offset for s in seqs],
            new_tokens=[s.tokens[s.draft_offset:] for s in seqs],
            num_draft=ks,
            temperature=torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32),
            top_k=torch.tensor([s.params.top_k for s in seqs], dtype=torch.long),
            top_p=torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32),
            uniforms=uniforms,
            release=self.take_releases(),
            # the draft's features: only when it is called (K > 0); they stay queued meanwhile
            features=[s.pending_features() for s in seqs] if self.cfg.features and K > 0 else None,
            steps=steps,
            lookup=lookup,
            budget=[s.remaining for s in seqs] if steps else None,
            stop_ids=[s.stop_token_set() for s in seqs] if steps else None,
            siblings=K > 0 and len(seqs) <= self.cfg.siblings_max_batch,
            ngram_k=ngram_k,
            coupled=coupled if coupled and any(coupled) else None,
            race=[not s.params.greedy and s.params.seed is None for s in seqs] if lookup else None,
        )
        return RoundPlan(seqs, batch, prefill, catch_up)

    def _choose_ks(self, seqs: list[Sequence], calibrate: bool, throttle: bool) -> list[int]:
        """Each row's k. In a batch, rows due for a probe wait for a round that drafts anyway or
        for the batch's own probing round (one in `probe_interval`), and then probe together: a
        lone probing row would cost every row a (k+1)-position verify or a multi-step plain round."""
        B = len(seqs)
        ks = [self.choose_k(s, B, calibrate, throttle, probe=B == 1) for s in seqs]
        if B > 1 and (max(ks) > 0 or self.plain_run + 1 >= self.adaptive_cfg.probe_interval):
            ks = [k or self.choose_k(s, B, calibrate, throttle) for s, k in zip(seqs, ks)]
        if B > 1 and max(ks) > 0:  # the round drafts K steps and verifies K + 1 positions for every row anyway
            K = self._batch_k(seqs, ks)
            ks = [min(K, s.remaining - 1) if self._rides_along(s) else k for s, k in zip(seqs, ks)]
        return ks

    def _batch_k(self, seqs: list[Sequence], ks: list[int]) -> int:
        """The round's K, at most the longest k a row chose: every row rides along (pinned and
        prefilling rows keep theirs) and every row pays the (K + 1)-position verify, so K is the
        length that maximizes the whole batch's expected tokens per round cost, not the longest
        any row wants for itself. At 16 rows on a 2-core CPU a verify costs about the positions it
        computes, and rounds at one eager row's K = 3 lost to plain decoding where K = 1 gives
        1.10x (bf16, chat)."""
        fixed = [not self._rides_along(s) for s in seqs]
        floor = max((k for k, f in zip(ks, fixed) if f), default=0)

        def score(K: int) -> float:
            tokens = sum(expected_tokens(s.adaptive.acceptance, k if f else min(K, s.remaining - 1))
                         for s, k, f in zip(seqs, ks, fixed))
            return tokens / self.cost.round_cost(K, self.proposer_has_model, len(seqs))
        return max(range(max(1, floor), max(ks) + 1), key=score)

    def _rides_along(self, seq: Sequence) -> bool:
        """In a round that drafts K tokens (`_batch_k`), an adaptive row drafts K whatever its own k:
        drafts beyond its own k fill positions the batch's verify computes anyway (rows are padded
        to K + 1) and ride on draft steps taken anyway, so they cost nearly nothing and whatever
        they get accepted is gained. Pinned rows keep their k, prefilling rows draft nothing."""
        return self.cfg.speculate and self.cfg.adaptive and not self.pinned_k(seq) and not self.prefilling(seq)

    def _plain_steps(self, seqs: list[Sequence], prefill: bool) -> list[int] | None:
        """Tokens per row of a multi-step plain round, or None for one step: not while a prompt
        is prefilled (its first token comes back at once) or sequences wait to join the batch."""
        n = self.cfg.plain_steps
        if n <= 1 or prefill or self.waiting:
            return None
        steps = [max(1, min(n, s.remaining)) for s in seqs]
        return steps if max(steps) > 1 else None

    @staticmethod
    def _request_cap(seq: Sequence, limit: int) -> int:
        """`limit`, at most the request's own num_speculative_tokens (prompt lookup counts as
        speculation: a request's k caps it, 0 turns it off)."""
        req = seq.params.num_speculative_tokens
        return limit if req is None else min(req, limit)

    def _lookup_k(self, seq: Sequence, batch: int) -> int:
        """Prompt-lookup tokens a row may verify per step of a multi-step plain round (greedy and
        sampled rows) of a speculating scheduler: `lookup_k`, or up to `ngram_k` in a round of one
        row (where longer lookups cost little), capped by the request (`_request_cap`)."""
        if not (self.cfg.speculate and self.cfg.lookup_k):
            return 0
        return self._request_cap(seq, max(self.cfg.lookup_k, self.cfg.ngram_k) if batch == 1 else self.cfg.lookup_k)

    def _lookups(self, seqs: list[Sequence]) -> list[int] | None:
        """Each row's lookup tokens per forward in this multi-step plain round, or None: with the
        adaptive policy, the round carries lookups only where their measured gain pays for the
        wider forwards (`CostModel.lookups`, a LookupGate)."""
        B = len(seqs)
        ks = [self._lookup_k(s, B) for s in seqs]
        if not (any(ks) and self.cfg.adaptive):
            return ks
        gate = self.cost.lookups
        return ks if gate.use(B, [gate.gain(s.lookup_hits, s.lookup_forwards) for s in seqs]) else None

    def _ngram_k(self, seq: Sequence, k: int) -> int:
        """How long a greedy drafting row's prompt-lookup drafts may run: `ngram_k`, capped by the
        request (`_request_cap`) and what the row may still emit (k: no longer than that)."""
        if not (k and seq.params.greedy):
            return k
        return max(k, min(self._request_cap(seq, self.cfg.ngram_k), seq.remaining - 1))

    def _observe_lookups(self, seq: Sequence, forwards: int, hits: int, decay: float = 0.9) -> None:
        """A row's lookups in a multi-step round: its decayed gain evidence and the workload's."""
        if forwards:
            seq.lookup_hits = decay * seq.lookup_hits + hits
            seq.lookup_forwards = decay * seq.lookup_forwards + forwards
            self.cost.lookups.observe_row(forwards, hits)

    @staticmethod
    def _full_rows(plan: RoundPlan, verify: VerifyOutput) -> list[int]:
        """Forwards taken by the rows of a multi-step round with lookups that had the round's whole
        token budget and did not stop at a stop token: where they differ, lookups made them differ
        (LookupGate.straggle)."""
        b = plan.draft_batch
        budgets = [b.row_budget(i) for i in range(len(b))]
        full = max(budgets)
        return [f for (f, _), s, n in zip(verify.lookup_rows, plan.seqs, budgets)
                if f and n == full and s.finish_reason != FINISH_STOP]

    def target_batch(self, plan: RoundPlan, draft: DraftOutput) -> SpecBatch:
        seqs = plan.seqs
        plan.prefill = plan.prefill or any(map(self.prefilling, seqs))
        plan.target_ends = [self.target_end(s) for s in seqs]
        partial = [e < len(s.tokens) for s, e in zip(seqs, plan.target_ends)]
        return plan.draft_batch.with_side(
            [s.target_offset for s in seqs], [s.tokens[s.target_offset:e] for s, e in zip(seqs, plan.target_ends)],
            num_draft=list(draft.num_draft), features=None,  # features are the draft's, not the target's
            partial=partial if any(partial) else None,
            prompt_len=[len(s.prompt_ids) for s in seqs] if plan.prefill else None)

    # ---- commit -----------------------------------------------------------------------------
    def commit(self, plan: RoundPlan, draft: DraftOutput, verify: VerifyOutput, draft_time: float,
               target_time: float, round_time: float, drafted: bool = True) -> list[Sequence]:
        """Apply a round's results. Returns the sequences that changed (finished ones included)."""
        seqs = plan.seqs
        unknown_t, unknown_d = set(verify.unknown), set(draft.unknown)
        plan.kept = [0] * len(seqs)
        for i, s in enumerate(seqs):
            if s.finished:  # aborted while the round ran
                continue
            lost = drafted and i in unknown_d  # the draft side no longer holds this sequence
            if drafted:
                s.draft_offset = 0 if lost else len(plan.draft_batch.new_tokens[i]) + plan.draft_batch.offsets[i]
                sent = plan.draft_batch.features[i] if plan.draft_batch.features else None
                if sent is not None and s.feat_start == sent[0]:
                    s.drop_features(len(sent[1]))
            if verify.hidden is not None and verify.hidden[i] is not None and self.cfg.features:
                s.add_features(verify.hidden_start[i], verify.hidden[i])
            if i in unknown_t:
                s.target_offset = 0  # resend the whole context next round
                continue
            if plan.target_ends and plan.target_ends[i] < len(s.tokens):  # a part of its prompt went in
                s.target_offset = plan.target_ends[i]
                continue
            emitted, m, k = verify.tokens[i], verify.num_accepted[i], draft.num_draft[i]
            kept = plan.kept[i] = s.append(emitted, self.tokenizer)
            # a draft that reads features and lost the sequence needs them for the whole context,
            # which only the target has: it re-prefills (else the draft's context restarts here)
            s.target_offset = 0 if lost and self.cfg.features else len(s.tokens)
            s.proposed += k  # the request's usage counts proposer drafts: lookups of plain rounds go to SpecStats.lookup_*
            s.accepted += min(m, kept) if k else 0  # (drafts accepted past a stop are not returned)
            s.rounds += 1 if k or len(emitted) <= 1 else len(emitted) - m  # target forwards (a multi-step round: each)
            if verify.lookup_rows is not None and plan.draft_batch.lookup:
                self._observe_lookups(s, *verify.lookup_rows[i])
            if k == 0 and len(emitted) > 1:  # a multi-step plain round: one plain round per token
                for _ in emitted:
                    s.adaptive.update(0, 0, 0)
                    self.stats.observe_row(0, 0, 1)
                continue
            s.adaptive.update(plan.draft_batch.num_draft[i], k, m)
            self.cost.observe_acceptance(k, m)
            self.stats.observe_row(k, m, len(emitted))
        self.stats.observe_round(len(seqs), draft_time, target_time, round_time)
        self.stats.sibling_accepted += verify.sibling_accepted
        self.stats.lookup_proposed += verify.lookup_proposed
        self.stats.lookup_accepted += verify.lookup_accepted
        self.stats.target_drafted += verify.target_drafted
        self.stats.target_draft_accepted += verify.target_draft_accepted
        # wall times as the loop paid them (in the service they include the deployment hops)
        if not plan.prefill and not unknown_t and plan.draft_batch.steps and verify.steps > 1:
            on = bool(plan.draft_batch.lookup) and any(plan.draft_batch.lookup)
            self.cost.lookups.observe(len(seqs), on, target_time / verify.steps,
                                      self._full_rows(plan, verify) if on and verify.lookup_rows else None)
        # A prompt's prefill would inflate the per-step costs. A round that drafts after plain
        # rounds pays the draft's catch-up on their tokens (at 16 rows, 55-75 ms against 4-6 ms of
        # a drafting round after a drafting one): a cost of switching, not of speculating, so the
        # draft's step cost skips it and the safeguard prices its draft steps at the steady cost.
        if not plan.prefill and not unknown_t:  # (rows the target did not hold cost it nothing and emit nothing)
            B = len(seqs)
            if draft.draft_steps and not plan.catch_up:
                self.stats.draft_steps += draft.draft_steps
                self.stats.draft_step_time += draft_time
            self.cost.observe(max(draft.num_draft, default=0), draft_time, draft.draft_steps,
                              target_time / verify.steps, B, catch_up=plan.catch_up)  # t(B, K): per forward
            seconds = round_time
            if plan.catch_up:
                seconds += self.cost.draft_seconds(B, draft.draft_steps) - draft_time
            self.cost.observe_throughput(B, drafted and any(draft.num_draft), sum(len(t) for t in verify.tokens),
                                         seconds, verify.steps)
        done = [s for s in seqs if s.finished]
        for s in done:
            if s in self.running:
                self.running.remove(s)
                self.to_release.append(s.seq_id)
        return seqs
