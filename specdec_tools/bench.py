"""Engine benchmark: plain decoding vs speculation (n-gram, self-draft, a draft checkpoint, EAGLE,
the n-gram/draft hybrid) on the demo target, at batch 1 and with 8 concurrent sequences, plus HF
transformers as the peer.

    specdec-bench [--dtype float32|bfloat16] [--max-tokens 128] [--draft PATH|smollm2-eagle]

Prompts are of two kinds: chat questions (chat template) and Python code completion taken from
the held-out modules of the standard library (never seen by `specdec-distill`). Greedy decoding of a fixed number of tokens (EOS ignored, so
every configuration does the same work); every speculative run's output is checked against plain
decoding in the same dtype. For each row the table gives tokens/s, acceptance rate
a, mean accepted length, the measured cost ratio c (draft step time / plain target step time),
the theoretical bound S = (1 - a^(k+1)) / ((1 - a)(k c + 1)), the measured speedup over plain
decoding at the same batch size and measured / bound.

The speedup is against plain decoding of the same prompts timed right before and right after the
row (plain, config, plain, config, ...: this 2-core machine's speed drifts by 20-30% within
minutes, which a single plain run at the start put on every ratio). Every engine first decodes
one warm-up wave of the same batch (half the tokens), as a server's engine has decoded earlier
requests: an adaptive engine starts measured, not from its priors.
"""
from __future__ import annotations

import argparse
import inspect
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from specdec.adaptive import speedup_bound
from specdec.engine import EngineConfig, LLMEngine
from specdec.corpus import NgramCorpus
from specdec.loader import fast_dtype, load_hf_model, load_model, load_tokenizer, parse_dtype, resolve_corpus
from specdec.prompts import encode_chat
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.sampling import SamplingParams
from specdec.stats import SpecStats
from specdec.target_worker import TargetWorker

CHAT = ["What is the capital of France?", "Explain what a hash table is in two sentences.",
        "Write a Python function that checks whether two strings are anagrams.", "What does the zip builtin do in Python?",
        "Give three tips for writing readable code.", "How do I read a file line by line in Python?",
        "What is the difference between a list and a tuple?", "Summarize what recursion is."]


def code_prompts(n: int = 8, max_tokens: int = 384, tokenizer=None) -> list[str]:
    """Openings of standard-library functions (signature + docstring) from the *held-out* modules
    of specdec_tools.distill.data, so that no distilled draft has seen them; the model continues."""
    from specdec_tools.distill.data import Corpus
    from specdec_tools.distill.data import code_prompts as heads
    out = []
    for h in heads(Corpus.build().heldout):
        if tokenizer is None or len(tokenizer(h).input_ids) <= max_tokens:
            out.append(h)
        if len(out) == n:
            break
    return out


@dataclass
class Row:
    name: str
    batch: int
    k: int
    tokens: int
    seconds: float
    acceptance: float = 0.0
    mean_len: float = 1.0
    c: float = 0.0
    identical: bool | None = None
    rounds: int = 0  # engine rounds, and their wall time split (summed seconds)
    draft_s: float = 0.0  # plan + proposer
    target_s: float = 0.0  # verify
    round_s: float = 0.0
    plain_s: float = 0.0  # plain decoding of the same prompts, the mean of the runs before and after this one
    stats: SpecStats | None = field(default=None, repr=False)  # the engine's counters (rates pool over prompts)

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds

    @property
    def speedup(self) -> float:
        """Over plain decoding timed beside it (the same tokens: fixed length)."""
        return self.plain_s / self.seconds if self.plain_s else float("nan")

    def split(self) -> str:
        """Per round, ms: whole round (plan + draft / verify / commit)."""
        if not self.rounds:
            return "-"
        ms = [x / self.rounds * 1e3 for x in (self.round_s, self.draft_s, self.target_s)]
        return f"{ms[0]:.1f} ({ms[1]:.1f} / {ms[2]:.1f} / {ms[0] - ms[1] - ms[2]:.1f})"


def max_len(model, cap: int = 2048) -> int:
    """The benchmark's sequence length: `cap`, or the positions the target computes exactly if fewer."""
    return min(cap, model.args.max_position_embeddings)


def run_engine(model, tok, prompts, proposer, k, batch, max_tokens, adaptive=False, warm=True, siblings=0,
               lookup=0, ngram_k=0, temperature=0.0, seed=None, corpus=None, warm_tokens=0):
    """`lookup` > 0: plain rounds of 8 steps whose rows verify that many lookup tokens per step
    (continued from `corpus` if given; with k = 0 the proposer only enables them). `temperature`
    > 0 samples (with `seed`). Before the timed run: `warm_tokens` > 0 decodes a wave of `prompts`
    that long (the engine's adaptive state then starts measured), else `warm` 4 tokens of one."""
    eng = LLMEngine(TargetWorker(model, batch, max_len(model), corpus=corpus), proposer, tok,
                    EngineConfig(max_batch_size=batch, num_speculative_tokens=k, adaptive=adaptive,
                                 speculate=proposer is not None and (k > 0 or lookup > 0), siblings_max_batch=siblings,
                                 plain_steps=8 if lookup else 1, lookup_k=lookup, lookup_max_batch=batch,
                                 ngram_k=ngram_k))
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                        ignore_eos=True)  # fixed length: fair tokens/s
    if warm_tokens:  # one wave first, as a server's engine has decoded earlier requests
        eng.generate(prompts, SamplingParams(max_tokens=warm_tokens, temperature=temperature, seed=seed,
                                             ignore_eos=True))
    elif warm:
        eng.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))
    eng.scheduler.stats = type(eng.stats)()
    t0 = time.perf_counter()
    seqs = eng.generate(prompts, sp)
    dt = time.perf_counter() - t0
    return [s.output_ids for s in seqs], dt, eng.stats


def _times(st) -> dict:
    return {"rounds": st.rounds, "draft_s": st.draft_time, "target_s": st.target_time, "round_s": st.round_time}


def cost_ratio(st: SpecStats, plain_step: float, per_round: bool = False) -> float:
    """c: a draft step's seconds over a plain target step's, from steady drafting rounds (no prompt
    prefill, no catch-up; SpecStats.draft_steps). `per_round`: a proposer without forwards (n-gram
    lookup), priced per drafting round."""
    if not plain_step:
        return 0.0
    if per_round:
        return st.draft_time / max(1, st.rounds) / plain_step
    return st.draft_step_time / st.draft_steps / plain_step if st.draft_steps else 0.0


def rates(st: SpecStats, k: int) -> tuple[float, float]:
    """(acceptance, mean accepted length) of a run's counters. k = 0 (plain rounds with lookups):
    of the lookup tokens, and tokens per target step with them."""
    if k == 0:
        return st.lookup_accepted / max(1, st.lookup_proposed), \
            1 + st.lookup_accepted / max(1, st.emitted - st.lookup_accepted)
    return st.acceptance_rate, st.mean_accepted_length


def engine_configs(drafts, ks, batch, lookup: int = 0, corpus=None, siblings: int = 0,
                   ngram_k: int = 0) -> list[tuple]:
    """bench_engine's configurations after plain decoding, in order: (name, k, proposer factory,
    run_engine options); k = -1 is adaptive. See bench_engine for the arguments."""
    runs = []
    for c in ([None, corpus] if corpus is not None else [None]) if lookup else []:
        runs.append((f"plain + lookup {lookup}" + (" + corpus" if c is not None else ""), 0,
                     NgramProposer, {"lookup": lookup, "corpus": c}))
    for name, make in [("ngram", NgramProposer)] + [(n, (lambda f=f: f(batch))) for n, f in drafts]:
        opts = {"siblings": siblings, "ngram_k": ngram_k}
        runs += [(name, k, make, opts) for k in ks] + [(f"{name} adaptive", -1, make, {**opts, "adaptive": True})]
        if lookup and corpus is not None and name != "ngram":
            runs.append((f"{name} adaptive + lookup {lookup} + corpus", -1, make,
                         {**opts, "adaptive": True, "lookup": lookup, "corpus": corpus}))
    return runs


def bench_engine(model, tok, prompts, drafts, ks, batch, max_tokens, bar, siblings: int = 0,
                 lookup: int = 0, ngram_k: int = 0, corpus=None) -> list[Row]:
    """drafts: (name, factory(batch) -> DraftModelProposer) pairs; n-gram is always measured;
    `lookup` > 0 adds plain decoding with prompt lookup inside 8-step rounds (and with `corpus`,
    that continued from the corpus, and each draft's adaptive rounds with those lookups in their
    plain rounds: the service's configuration); `ngram_k`: the hybrid's prompt-lookup rows may
    draft that long. Plain decoding runs before the first configuration and after each one, and
    each row's speedup is against the two plain runs beside it (`Row.plain_s`). `bar` advances once
    per row: 1 + len(engine_configs(...)) times."""
    runs = engine_configs(drafts, ks, batch, lookup, corpus, siblings, ngram_k)
    warm = max(4, max_tokens // 2)
    base, dt, st = run_engine(model, tok, prompts, None, 0, batch, max_tokens, warm_tokens=warm)
    plain_step = st.target_time / st.rounds
    plain_s = [dt]
    rows = [Row("plain", batch, 0, sum(map(len, base)), dt, **_times(st), stats=st)]
    bar.update()
    for name, k, make, opts in runs:
        out, dt, st = run_engine(model, tok, prompts, make(), max(ks) if k < 0 else k, batch, max_tokens,
                                 warm_tokens=warm, **opts)
        acc, mean_len = rates(st, k)
        c = cost_ratio(st, plain_step, per_round=name == "ngram") if k > 0 else 0.0
        rows.append(Row(name, batch, k, sum(map(len, out)), dt, acc, mean_len, c, out == base, **_times(st),
                        stats=st))
        plain_s.append(run_engine(model, tok, prompts, None, 0, batch, max_tokens, warm_tokens=warm)[1])
        bar.update()
    rows[0].plain_s = plain_s[0]
    for i, r in enumerate(rows[1:]):
        r.plain_s = (plain_s[i] + plain_s[i + 1]) / 2
    return rows


def hf_configs(ks, draft=None) -> list[tuple[str, dict]]:
    """bench_hf's configurations, in order: (name, generate kwargs); `draft` assists the last."""
    return [("HF plain", {})] + [("HF prompt lookup", {"prompt_lookup_num_tokens": k}) for k in ks] + [
        ("HF assisted (4-layer self-draft)", {"assistant_model": draft})]


def bench_hf(target: str, tok, prompts, max_tokens, dtype, ks, bar) -> list[Row]:
    """HF transformers generate at batch 1: plain, prompt lookup, assisted by a 4-layer self-draft."""
    hf = load_hf_model(target).to(dtype)
    draft = load_hf_model(target).to(dtype)
    draft.model.layers = draft.model.layers[:4]
    draft.config.num_hidden_layers = 4
    rows = []
    for name, kw in hf_configs(ks, draft):
        total, secs = 0, 0.0
        for p in prompts:
            ids = torch.tensor([p])
            hf.generate(ids, max_new_tokens=2, do_sample=False, **kw)
            t0 = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, **kw)
            secs += time.perf_counter() - t0
            total += out.shape[1] - ids.shape[1]
        rows.append(Row(name, 1, kw.get("prompt_lookup_num_tokens", 0), total, secs))
        bar.update()
    return rows


def print_table(rows: list[Row]) -> None:
    print(f"\n| config | batch | k | tokens/s | accept a | mean acc. len | c | bound S | speedup | measured/bound | "
          f"same output | round ms (plan+draft / verify / commit) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sp = r.speedup
        if r.k > 0 and r.acceptance < 1 and not r.name.startswith("HF"):
            bound = speedup_bound(r.acceptance, r.k, r.c)
            mb = f"{sp / bound:.2f}"
            bound_s = f"{bound:.2f}"
        else:
            bound_s, mb = "-", "-"
        k = "adapt" if r.k < 0 else str(r.k)
        same = "-" if r.identical is None else ("yes" if r.identical else "NO")
        hf = r.name.startswith("HF")  # (transformers' generate: no acceptance, round lengths or draft cost measured)
        acc = f"{r.acceptance:.2f}" if r.k != 0 and not hf else "-"
        mean_len, c = ("-", "-") if hf else (f"{r.mean_len:.2f}", f"{r.c:.3f}")
        print(f"| {r.name} | {r.batch} | {k} | {r.tps:.1f} | {acc} | {mean_len} | {c} | {bound_s} | "
              f"{sp:.2f}x | {mb} | {same} | {r.split()} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default=None, help="a draft checkpoint with the target's tokenizer")
    ap.add_argument("--self-draft-layers", type=int, default=4)
    ap.add_argument("--no-self", action="store_true", help="skip the self-draft rows")
    ap.add_argument("--hybrid-ngram-min", type=int, default=3, help="hybrid: shortest n-gram match taken")
    ap.add_argument("--dtype", default="auto", help="auto: specdec.loader.fast_dtype(device)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ks", default="2,4", help="fixed k values to measure")
    ap.add_argument("--kinds", default="chat,code")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per kind")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--lookup", type=int, default=0, help="also measure plain decoding with this many prompt-lookup "
                    "tokens per step verified inside 8-step plain rounds (0: not measured)")
    ap.add_argument("--corpus", help="with --lookup: also continue lookups from this corpus (a path or a shipped "
                    "name, e.g. smollm2-corpus), alone and in each draft's adaptive rounds")
    ap.add_argument("--ngram-k", type=int, default=0, help="at batch 1 (the service's lookup_max_batch): the "
                    "hybrid's prompt-lookup rows draft up to this many tokens (0: k)")
    ap.add_argument("--waves", type=int, default=1, help="at batch b > 1: decode waves x b sequences, b at a time "
                    "(continuous batching: a finished row's place goes to a waiting sequence)")
    ap.add_argument("--siblings", type=int, default=0, help="siblings_max_batch: batches up to this size also "
                    "verify a sibling of each first draft (0: chains only)")
    ap.add_argument("--compile", action="store_true", help="compile the target's layer stack "
                    "(Transformer.compile_layers; compiled before the timed runs, minutes the first time)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.dtype == "auto":
        a.dtype = fast_dtype(a.device)
    dtype = parse_dtype(a.dtype)
    tok = load_tokenizer(a.target)
    model = load_model(a.target, dtype=dtype, device=a.device)
    batches = [int(x) for x in a.batches.split(",")]
    if a.compile:
        t0 = time.perf_counter()
        for b in batches:  # each batch size's cache is another compiled graph (with features: LLMEngine warms them)
            TargetWorker(model, b, max_len(model), compile=True)
        print(f"compiled the target's layers in {time.perf_counter() - t0:.0f} s")
    drafts = []
    if not a.no_self:
        self_draft = model.first_layers(a.self_draft_layers)
        drafts.append((f"self{a.self_draft_layers}", lambda b: DraftModelProposer(self_draft, b, max_len(model))))
    if a.draft:
        drafts += draft_factories(a.draft, model, dtype, a.hybrid_ngram_min)
    ks = [int(x) for x in a.ks.split(",")]
    kinds = prompt_kinds(tok, a.prompts)
    corpus = NgramCorpus.load(resolve_corpus(a.corpus)) if a.corpus and a.lookup else None
    per_batch = 1 + len(engine_configs(drafts, ks, 1, a.lookup, corpus))  # the plain row and each configuration
    total = len(a.kinds.split(",")) * (len(batches) * per_batch + (0 if a.no_hf else len(hf_configs(ks))))
    bar = tqdm(total=total, desc="benchmark")
    print(f"target={a.target} dtype={a.dtype} device={a.device} max_tokens={a.max_tokens} threads={torch.get_num_threads()}"
          f" siblings_max_batch={a.siblings} ngram_k={a.ngram_k} (batch 1)"
          + (f" gpu={torch.cuda.get_device_name()}" if a.device == "cuda" else ""))
    for kind in a.kinds.split(","):
        prompts = kinds[kind]
        rows = []
        for b in batches:
            if b == 1:  # batch 1: the prompts one after another
                rs = [bench_engine(model, tok, [p], drafts, ks, 1, a.max_tokens, _Null(), a.siblings, a.lookup, a.ngram_k,
                                   corpus)
                      for p in prompts]
                merged = [_merge([r[i] for r in rs]) for i in range(len(rs[0]))]
                bar.update(per_batch)
            else:
                # b concurrent sequences, `waves` x b in all (prompts reused if fewer): rows that finish
                # are replaced by waiting ones (continuous batching), so the batch stays full until the last wave
                batch_prompts = (prompts * b * a.waves)[:b * a.waves]
                merged = bench_engine(model, tok, batch_prompts, drafts, ks, b, a.max_tokens, bar, a.siblings, a.lookup,
                                      corpus=corpus)
            rows += merged
        if not a.no_hf:
            hf = bench_hf(a.target, tok, prompts, a.max_tokens, dtype, ks, bar)
            for r in hf:  # the same prompts and tokens as the engine's plain row at batch 1
                r.plain_s = next((p.seconds for p in rows if p.name == "plain" and p.batch == 1), 0.0)
            rows += hf
        print(f"\n### {kind} prompts ({len(prompts)}), greedy, {a.max_tokens} new tokens, {a.dtype}")
        print_table(rows)
    bar.close()


def prompt_kinds(tok, n: int) -> dict[str, list[list[int]]]:
    """The benchmark's prompts as token ids: n chat questions (chat template) and n held-out code
    openings."""
    return {"chat": [encode_chat(tok, [{"role": "user", "content": q}]) for q in CHAT[:n]],
            "code": [tok(p).input_ids for p in code_prompts(n, tokenizer=tok)]}


def add_target_args(ap) -> None:
    """--dtype and --threads of the in-process benchmarks (bench/*.py)."""
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU runs it fast, else float32")
    ap.add_argument("--threads", type=int, default=2)


def load_demo_target(a) -> tuple:
    """(tokenizer, model, dtype) of the demo target, after applying --threads and --dtype."""
    torch.set_num_threads(a.threads)
    dtype = parse_dtype(fast_dtype("cpu") if a.dtype == "auto" else a.dtype)
    return load_tokenizer("smollm2"), load_model("smollm2", dtype=dtype), dtype


def draft_factories(draft: str, model, dtype, hybrid_ngram_min: int = 3):
    """(name, factory(batch) -> proposer) for a draft checkpoint alone and in the n-gram hybrid.
    An EAGLE checkpoint shares the benchmarked target's weights and reads its features."""
    from specdec.eagle_draft import is_eagle, load_eagle
    from specdec.proposers import EagleProposer, HybridProposer
    if is_eagle(draft):
        name, d = "eagle", load_eagle(draft, model, dtype)

        def make(b):
            return EagleProposer(d, b, max_len(model))
    else:
        name, d = "draft", load_model(draft, dtype=dtype)
        ids = getattr(d, "extra", {}).get("draft_vocab")
        token_map = torch.tensor(ids, dtype=torch.long) if ids else None

        def make(b):
            return DraftModelProposer(d, b, max_len(model), token_map=token_map)
    return [(name, make),
            (f"hybrid (ngram>={hybrid_ngram_min} + {name})",
             lambda b: HybridProposer(NgramProposer(min_n=hybrid_ngram_min, max_n=max(5, hybrid_ngram_min)), make(b)))]


class _Null:
    def update(self, *_):
        pass


def _merge(rows: list[Row]) -> Row:
    """Combine per-prompt rows of one config (batch 1): times and the engine's counters summed, so
    acceptance and mean accepted length are rates of the pooled counts (accepted / proposed,
    emitted / row-rounds, as in specdec.stats), not means of per-prompt ratios; c token-weighted."""
    r0 = rows[0]
    tokens = sum(r.tokens for r in rows)
    w = [r.tokens / tokens for r in rows]
    stats = SpecStats()
    for r in rows:
        stats.merge(r.stats)
    return Row(r0.name, r0.batch, r0.k, tokens, sum(r.seconds for r in rows),
               *rates(stats, r0.k),
               sum(r.c * x for r, x in zip(rows, w)),
               None if r0.identical is None else all(r.identical for r in rows),
               *(sum(getattr(r, f) for r in rows) for f in ("rounds", "draft_s", "target_s", "round_s", "plain_s")),
               stats=stats)


if __name__ == "__main__":
    main()
