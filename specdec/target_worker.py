"""The target side of a round: one forward pass over every row's new tokens and drafts, then the
rejection sampler. Holds the target's KV cache (one slot per sequence).

Per row the forward feeds the confirmed tokens the cache lacks (the whole prompt for a new
sequence, otherwise the last emitted token) followed by the k draft tokens, and keeps logits at
the last k+1 positions. After sampling, the cache is valid up to the last accepted draft: the
rejected positions are rolled back by lowering `cached`, nothing is copied.
"""
from __future__ import annotations

import time

import torch

from specdec import runner
from specdec.corpus import NgramCorpus
from specdec.metadata import DraftOutput, SpecBatch, VerifyOutput
from specdec.proposers.base import Proposer
from specdec.proposers.ngram import ngram_lookup
from specdec.rejection_sampler import DraftProbs, rejection_sample
from specdec.runner import SHORT_ROW, CacheFullError, SlotTable, run_ragged
from specdec.sampling import RaceNoise, race_noise, race_noise_over


PENDING_FEATURES = 512  # positions of features kept per sequence for the in-target drafter (older: dropped)
LOOKUP_NGRAM = (2, 4)  # prompt lookup in multi-step plain rounds: suffix n-grams of 2 to 4 tokens


def lookup_draft(tokens: list[int], k: int, corpus: NgramCorpus | None = None) -> list[int]:
    """Up to k lookup tokens after `tokens`: prompt lookup in the sequence itself, continued from
    the corpus where that ends short (or finds nothing)."""
    draft = ngram_lookup(tokens, k, *LOOKUP_NGRAM)
    if corpus is not None and len(draft) < k:
        draft += corpus.draft(tokens[-corpus.max_n:] + draft, k - len(draft))
    return draft


class TargetWorker:
    def __init__(self, model, num_slots: int, max_model_len: int, return_hidden: bool = False,
                 corpus: NgramCorpus | None = None, drafter: Proposer | None = None, draft_k: int = 2,
                 greedy_draft_k: int | None = None, compile: bool = False):
        if corpus is not None and corpus.vocab_size > model.args.vocab_size:
            raise ValueError(f"the lookup corpus's vocabulary ({corpus.vocab_size}) is larger than the target's "
                             f"({model.args.vocab_size}): it was made for another model")
        window = model.args.sliding_window
        if window and max_model_len > window:
            raise ValueError(f"max_model_len {max_model_len} exceeds the target's sliding-window span of {window} "
                             "positions (sliding-window attention is not implemented)")
        if max_model_len > model.args.max_position_embeddings:  # (past it, logits differ: e.g. dynamic or LongRoPE scaling)
            raise ValueError(f"max_model_len {max_model_len} exceeds the {model.args.max_position_embeddings} positions "
                             "the target computes exactly")
        self.model = model
        self.corpus = corpus  # lookups continue from the target's answers to other questions
        self.max_model_len = max_model_len
        model.setup_cache(num_slots, max_model_len)
        self.table = SlotTable(num_slots, max_model_len, on_evict=lambda sid: self.release([sid]))
        self.return_hidden = return_hidden
        # An EAGLE-style proposer in this process (`drafter`): in a multi-step round, a row whose own
        # context repeats nothing is drafted `draft_k` tokens per step (a greedy row `greedy_draft_k`:
        # it accepts more of a chain) from the features the last forward computed here (no Draft
        # call, no transfer).
        # `_fed`: confirmed tokens the drafter holds per sequence; `_pending`: (first position,
        # [[n, hidden] chunks], positions in them) features of confirmed positions it has not been
        # sent yet, the last PENDING_FEATURES at most (a drafter that lost older ones restarts its
        # context there).
        self.drafter, self.draft_k = drafter, draft_k
        self.greedy_draft_k = draft_k if greedy_draft_k is None else greedy_draft_k
        if drafter is not None:
            model.feature_layers = tuple(drafter.feature_layers)  # the taps an EAGLE-3 draft fuses
        self._fed: dict[int, int] = {}
        self._pending: dict[int, tuple[int, list[torch.Tensor], int]] = {}
        if compile:
            model.compile_layers()
            self.warm_up()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run one forward of each shape class a round can bring (one or several rows, one or
        several positions, a prompt longer than runner.SHORT_ROW, one of two chunks), so that a compiled target
        (`Transformer.compile_layers`) compiles them now and not in a request's round. The
        writes land in free slots at positions that any sequence writes before it reads them."""
        want_hidden = self.return_hidden or self.drafter is not None
        slots = min(2, self.model.num_slots)
        # (query rows per key head a multiple of 4 or not is another graph: T = 4 and 5)
        for rows, T in [(1, 1), (1, 4), (1, 5), (1, SHORT_ROW + 8), (slots, 1), (slots, 4), (slots, 5)]:
            run_ragged(self.model, [[0] * T] * rows, list(range(rows)), [0] * rows, [1] * rows,
                       return_hidden=want_hidden)
        T = runner.PREFILL_CHUNK + 8  # a prompt of two chunks: the first attends with SDPA (run_ragged)
        if T <= self.max_model_len:
            run_ragged(self.model, [[0] * T], [0], [0], [1], return_hidden=want_hidden, prompt_lens=[T])

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    def release(self, seq_ids) -> None:
        for s in seq_ids:
            self.table.release(s)
            if self.drafter is not None:
                self._forget_drafts(s)

    @torch.inference_mode()
    def verify(self, batch: SpecBatch, draft: DraftOutput, move_in: int | None = None) -> VerifyOutput:
        """One round. `move_in`: the rows of a lane that moves here from a replica short of slots,
        taken only if this replica has room for all of them now (else every row is refused, and
        nothing changes here); its rows that ran elsewhere keep their place in line for their resend."""
        t0 = time.perf_counter()
        self.release(batch.release)
        B = len(batch)
        if move_in is not None and self.table.room() < move_in:  # (routing stats lag: another lane came first)
            return VerifyOutput.refusal(B, self.return_hidden)
        rows, states, unknown, refused = [], [], [], []
        for i in range(B):
            if batch.offsets[i] == 0 and self.drafter is not None:  # a new (or resent) sequence
                self._forget_drafts(batch.seq_ids[i])
            try:
                st = self.table.sync(batch.seq_ids[i], batch.offsets[i], batch.new_tokens[i])
            except CacheFullError:  # no free slot now: the row waits (reported unknown, resent later)
                st = None
                refused.append(i)
            if st is None and move_in is not None:
                self.table.hold(batch.seq_ids[i])
            if st is None or not st.tokens:
                unknown.append(i)
            else:
                rows.append(i)
                states.append(st)
        out = VerifyOutput([[] for _ in range(B)], [0] * B, unknown, 0.0,
                           [None] * B if self.return_hidden else None, [0] * B, refused=refused)
        if rows:
            K = draft.tokens.shape[1]
            num_draft = [draft.num_draft[i] for i in rows]
            drafts = [draft.tokens[i, : num_draft[r]].tolist() for r, i in enumerate(rows)]
            idx = torch.tensor(rows)
            probs = None if draft.probs is None else DraftProbs(draft.probs.ids[idx], draft.probs.vals[idx])
            sib = None
            if draft.sibling is not None:  # greedy rows with drafts only (a sampled row keeps its chain)
                sib = [int(draft.sibling[i]) if num_draft[r] and float(batch.temperature[i]) == 0 else -1
                       for r, i in enumerate(rows)]
            if batch.steps is None:
                u = batch.uniforms[idx][:, 1:, : K + 1]
                coupled = torch.tensor([batch.coupled[i] for i in rows]) if batch.coupled else False
                self._pass(batch, rows, states, drafts, draft.tokens[idx], probs, K, u, out, sib, coupled)
            else:
                self._multi_step(batch, rows, states, out)
        out.target_time = time.perf_counter() - t0
        return out

    def _multi_step(self, batch: SpecBatch, rows: list[int], states: list, out: VerifyOutput) -> None:
        """A multi-step plain round: row i runs `steps[i]` forwards, fewer after a stop token. With
        `batch.lookup`, each forward of a row also verifies up to lookup[i] tokens found by prompt
        lookup in its own context (Saxena 2023): more than one token per forward where the text
        repeats itself (at most budget[i] in the round), and no proposer call; with a corpus, rows
        of a batch fill the step's padding positions (`_fill`). The row's e-th token
        of the round is drawn with the uniforms of column e (its position's, as a plain round
        would), and lookups are checked against those draws (`coupled_verify`; argmax for greedy
        rows): the tokens are plain decoding's, greedy or sampled, token for token. With a
        `drafter`, rows that lookups find nothing for are drafted by it (`_step_drafts`), checked
        the same way."""
        go, j = list(zip(rows, states)), 0
        lookups = out.lookup_rows = [(0, 0)] * len(batch)  # per row: (forwards with lookups, accepted)
        while go:
            rooms = [self._room(batch, i, st, len(out.tokens[i])) for i, st in go]
            drafts, drafted, race = self._step_drafts(batch, go, rooms, [len(out.tokens[i]) for i, _ in go])
            K = max(map(len, drafts))
            own = {r: len(drafts[r]) for r in drafted}  # the drafter's tokens (before corpus fill)
            if K and self.corpus is not None and len(go) > 1:
                drafts = self._fill([st for _, st in go], drafts, [min(K, room) for room in rooms])
            tokens = torch.zeros(len(go), K, dtype=torch.long)  # [b, K]
            for r, d in enumerate(drafts):
                tokens[r, : len(d)] = torch.tensor(d, dtype=torch.long)
            u = torch.zeros(len(go), 2, K + 1, dtype=batch.uniforms.dtype)  # [b, 2, K+1]
            for r, (i, _) in enumerate(go):
                cols = self._draws(batch, i, len(out.tokens[i]), K + 1)
                u[r, :, : cols.shape[1]] = cols
            before = list(out.num_accepted)
            self._pass(batch, [i for i, _ in go], [st for _, st in go], drafts, tokens, None, K, u, out,
                       coupled=True, race=race)
            out.lookup_proposed += sum(map(len, drafts))
            out.lookup_accepted += sum(out.num_accepted) - sum(before)
            for r in drafted:
                i = go[r][0]
                out.target_drafted += own[r]
                out.target_draft_accepted += min(own[r], out.num_accepted[i] - before[i])
            for i, _ in go:  # a forward of a round with lookups counts, whether or not the row found some
                if batch.lookup and batch.lookup[i]:
                    f, h = lookups[i]
                    lookups[i] = (f + 1, h + out.num_accepted[i] - before[i])
            j += 1
            go = [(i, st) for i, st in go if j < batch.steps[i] and len(out.tokens[i]) < batch.row_budget(i)
                  and not any(t in batch.stop_ids[i] for t in out.tokens[i])]
        out.steps = j

    def _step_drafts(self, batch: SpecBatch, go: list, rooms: list[int], emitted: list[int]
                     ) -> tuple[list[list[int]], list[int], list[torch.Tensor | RaceNoise | None] | None]:
        """Each row's tokens to verify in this step of a multi-step round, which rows (indices into
        `go`) the drafter drafted, and per row the race noise of its chain's positions (or None):
        lookups (`lookup_draft`), except that with a drafter, a row whose own context repeats
        nothing (no prompt-lookup match) gets the drafter's chain of up to `draft_k` tokens instead
        (`greedy_draft_k` for a greedy row).

        A greedy or seeded row's chain is the draft's greedy one, kept where it equals the row's own
        draw: drafts depend on the context only, never on the round's draws, so the coupled check
        emits plain decoding's tokens (a seeded row's output must reproduce). A row of `batch.race`
        (sampled, unseeded) draws its chain's positions by the exponential race instead, with noise
        keyed by those positions' uniforms (emitted[r]: the row's tokens so far in this round), and
        its chain is raced with the same noise (`sampling.race_sample`): every draw is still exactly
        the target's, and the chain matches it with probability close to sum min(p, q) instead of
        p(argmax q) (measured offline on everyday questions: 0.43 vs 0.32 at T = 1, 0.48 vs 0.42 at
        T = 0.7). Which positions race is fixed before any of their noise is read."""
        mine = [r for r, ((_, st), room) in enumerate(zip(go, rooms))
                if room > 0 and not ngram_lookup(st.tokens, 1, *LOOKUP_NGRAM)] if self.drafter is not None else []
        ks = [min(self.greedy_draft_k if batch.temperature[go[r][0]] == 0 else self.draft_k, rooms[r]) for r in mine]
        noise = [self._race_noise(batch, go[r][0], emitted[r], k) for r, k in zip(mine, ks)]
        chains = dict(zip(mine, self._draft_chains(batch, [go[r] for r in mine], ks, noise))) if mine else {}
        drafts = [chains[r] if r in chains else lookup_draft(st.tokens, room, self.corpus) if room > 0 else []
                  for r, ((_, st), room) in enumerate(zip(go, rooms))]
        race = [None] * len(go)
        for r, n in zip(mine, noise):
            race[r] = None if n is None else n[: len(drafts[r])]
        return drafts, mine, race if any(n is not None for n in race) else None

    def _race_noise(self, batch: SpecBatch, i: int, e: int, k: int) -> torch.Tensor | RaceNoise | None:
        """Exp(1) noise of row i's draws e .. e+k-1 in this round, for a row of `batch.race` (None
        for other rows): one vector per position, keyed by its draw's uniform; [k, vocab], or over
        the drafter's reduced vocabulary only, the other tokens merged (`sampling.RaceNoise`: the
        same draws in distribution, a sixth of the noise for the shipped draft)."""
        if not (batch.race and batch.race[i]) or k == 0:
            return None
        u = self._draws(batch, i, e, k)[1]
        tmap = getattr(self.drafter, "token_map", None)
        return race_noise(u, self.vocab_size) if tmap is None else race_noise_over(u, self.vocab_size, tmap)

    def _draft_chains(self, batch: SpecBatch, go: list, ks: list[int],
                      noise: list[torch.Tensor | RaceNoise | None]) -> list[list[int]]:
        """The drafter's chains for rows `go` ((batch index, slot state)), up to ks[r] tokens: greedy,
        or raced with noise[r] at the row's temperature, top-k and top-p. The drafter is sent the
        confirmed tokens and features it lacks, as a Draft replica would be."""
        sids = [batch.seq_ids[i] for i, _ in go]
        offsets = [self._fed.get(s, 0) for s in sids]
        n = len(go)
        raced = torch.tensor([x is not None for x in noise])
        idx = torch.tensor([i for i, _ in go])
        mini = SpecBatch(sids, offsets, [st.tokens[o:] for (_, st), o in zip(go, offsets)], ks,
                         torch.where(raced, batch.temperature[idx], 0.0), batch.top_k[idx], batch.top_p[idx],
                         torch.zeros(n, 3, max(ks) + 1, dtype=torch.float64),
                         features=[self._take_features(s) for s in sids], race_noise=noise)
        out = self.drafter.propose(mini)
        for r, ((_, st), s) in enumerate(zip(go, sids)):
            if r in out.unknown:  # no free slot there: whole context again next time
                self._forget_drafts(s)
            else:
                self._fed[s] = len(st.tokens)
        return [out.tokens[r, : out.num_draft[r]].tolist() for r in range(n)]

    def _keep_features(self, sid: int, start: int, h: torch.Tensor) -> None:
        """Features of confirmed positions from `start` on, for the drafter's next call: appended
        as a chunk (a copy: no view keeps the forward's whole hidden state alive); a row that has
        not been drafted for long keeps only its last PENDING_FEATURES positions."""
        first, chunks, n = self._pending.get(sid, (start, [], 0))
        if start < first + n and chunks:  # re-fed positions (rare): keep what precedes them
            kept = torch.cat(chunks)[: max(0, start - first)]
            chunks, n = ([kept] if len(kept) else []), len(kept)
        elif start > first + n:  # a gap: the drafter restarts its context here
            chunks, n = [], 0
        if not chunks:
            first = start
        chunks.append(h.clone())
        n += len(h)
        while len(chunks) > 1 and n - len(chunks[0]) >= PENDING_FEATURES:  # (n kept: no re-summing per step)
            dropped = len(chunks.pop(0))
            first, n = first + dropped, n - dropped
        self._pending[sid] = (first, chunks, n)

    def _take_features(self, sid: int) -> tuple[int, torch.Tensor] | None:
        """The pending features of `sid` as one (first position, [n, hidden]) block, now sent."""
        got = self._pending.pop(sid, None)
        return None if got is None else (got[0], torch.cat(got[1]))

    def _forget_drafts(self, sid: int) -> None:
        self.drafter.release([sid])
        self._fed.pop(sid, None)
        self._pending.pop(sid, None)

    def _room(self, batch: SpecBatch, i: int, st, emitted: int) -> int:
        """Lookup tokens row i may verify in this step of a multi-step round (prompt lookup in its
        own context, continued from the corpus where that ends short): `batch.lookup[i]`, within
        what the row may still emit this round and its cache's room."""
        if not batch.lookup or not batch.lookup[i]:
            return 0
        return min(batch.lookup[i], batch.row_budget(i) - emitted - 1, self.max_model_len - len(st.tokens))

    def _fill(self, states: list, drafts: list[list[int]], sizes: list[int]) -> list[list[int]]:
        """The step's forward computes K + 1 positions for every row anyway (padding): rows whose
        confident lookups end short of their size (K, within their room) continue with the
        corpus's likeliest tokens, which costs nothing and is verified like any lookup."""
        return [d + self.corpus.draft(st.tokens[-self.corpus.max_n:] + d, n - len(d), min_ratio=0.0) if n > len(d) else d
                for st, d, n in zip(states, drafts, sizes)]

    @staticmethod
    def _draws(batch: SpecBatch, i: int, e: int, n: int) -> torch.Tensor:
        """[2, <= n]: accept tests and draws of row i's tokens e .. e+n-1 of a multi-step round (one
        column per token: never one uniform for two positions)."""
        return batch.uniforms[i, 1:, e: e + n]

    def _pass(self, batch: SpecBatch, rows: list[int], states: list, drafts: list[list[int]], draft_tokens,
              probs: DraftProbs | None, K: int, uniforms, out: VerifyOutput, sib: list[int] | None = None,
              coupled: bool | torch.Tensor = False,
              race: list[torch.Tensor | RaceNoise | None] | None = None) -> None:
        """One target forward over `rows` (batch indices; their slot states, drafts) and the
        rejection sampler with `uniforms` ([b, 2, K+1]: accept tests, recovered/bonus draws;
        `coupled`, `race`: see `rejection_sample`); appends to `out`.

        sib[r] >= 0: a sibling of row r's first draft (a greedy row), fed after the chain at the
        first draft's position without seeing the chain. When the chain's first draft is rejected
        and the target's token there is the sibling, the sibling is accepted and the target's
        token after it (from the sibling's own logits) is the bonus: two tokens instead of one,
        the same two that plain greedy decoding emits. Its keys sit after the chain, so the cache
        keeps only the tokens before it; the next round feeds the sibling again."""
        sib = sib or [-1] * len(rows)
        for st in states:  # always feed at least the last confirmed token
            st.cached = min(st.cached, len(st.tokens) - 1)
        feeds = [st.tokens[st.cached:] + d + ([s] if s >= 0 else []) for st, d, s in zip(states, drafts, sib)]
        starts = [st.cached for st in states]
        for st, f, i in zip(states, feeds, rows):
            if st.cached + len(f) > self.max_model_len:
                raise CacheFullError(f"sequence {batch.seq_ids[i]} exceeds max_model_len {self.max_model_len}")
        has_sib = [s >= 0 for s in sib]
        n_conf = [len(f) - len(d) - h for f, d, h in zip(feeds, drafts, has_sib)]  # confirmed tokens fed per row
        num_draft = [len(d) for d in drafts]
        want_hidden = self.return_hidden or self.drafter is not None
        res = run_ragged(self.model, feeds, [st.slot for st in states], starts,
                         [n + 1 + h for n, h in zip(num_draft, has_sib)], return_hidden=want_hidden,
                         n_hidden=[len(f) for f in feeds], siblings=[n if h else 0 for n, h in zip(num_draft, has_sib)],
                         prompt_lens=[batch.prompt_len[i] for i in rows] if batch.prompt_len else None)
        logits_rows, hidden_rows = res if want_hidden else (res, None)
        logits = torch.zeros(len(rows), K + 1, self.vocab_size)  # [b, K+1, vocab]
        for r, lg in enumerate(logits_rows):
            logits[r, : num_draft[r] + 1] = lg[: num_draft[r] + 1]
        idx = torch.tensor(rows)
        tokens, n_acc = rejection_sample(
            logits, draft_tokens, torch.tensor(num_draft), probs, batch.temperature[idx],
            batch.top_k[idx], batch.top_p[idx], uniforms, coupled, race)
        part = batch.partial or [False] * len(batch)
        for r, (i, st) in enumerate(zip(rows, states)):
            m = int(n_acc[r])  # (0 for a part of a prompt: it has no drafts, Scheduler.choose_k)
            emitted = [] if part[i] else tokens[r, : m + 1].tolist()  # (part of a prompt: cached only)
            taken = has_sib[r] and m == 0 and emitted[0] == sib[r]  # the sibling is the target's token
            st.cached = len(st.tokens) + m  # valid: old tokens + accepted drafts (not a sibling)
            if taken:  # two tokens, but no accepted draft: the chain's first was rejected (m stays 0)
                emitted.append(int(logits_rows[r][-1].argmax()))
                out.sibling_accepted += 1
            st.tokens.extend(emitted)
            st.confirmed = len(st.tokens)  # (the target's own tokens: confirmed)
            out.tokens[i] += emitted
            out.num_accepted[i] += m
            if hidden_rows is not None:  # features of every position now confirmed but the last
                hr = hidden_rows[r]  # a taken sibling's feature (the last) in place of the first draft's
                h = torch.cat([hr[: n_conf[r]], hr[-1:]]) if taken else hr[: n_conf[r] + m]
                if self.drafter is not None:
                    self._keep_features(batch.seq_ids[i], starts[r], h)
                if not self.return_hidden:
                    continue
                h = h.cpu()  # crosses processes: host memory
                if out.hidden[i] is None:  # the call's first forward for this row
                    out.hidden[i], out.hidden_start[i] = h, starts[r]
                else:
                    out.hidden[i] = torch.cat([out.hidden[i], h])
