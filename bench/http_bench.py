"""Benchmark the service over HTTP: concurrency levels x speculation on/off, in one run.

    python bench/http_bench.py                       # starts the demo pair on a local Ray cluster
    python bench/http_bench.py --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct

Streaming chat requests (greedy; fixed max_tokens with ignore_eos, or --stop-at-eos) at each concurrency level, with the
server's adaptive speculation and with `num_speculative_tokens: 0`, alternating wave by wave (a
wave: one request per client slot) so that a drifting machine speed falls on both modes alike. Prints tokens/s,
time to first token, inter-token latency (p50), the acceptance rate from the router's /stats, and
the in-process engine's tokens/s on the same prompts at batch 1, configured as the app is (its
proposer, scheduling knobs, lookup corpus and in-target draft), speculating and plain, timed before
and after the HTTP runs (service / engine ratio against their mean).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import httpx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Everyday questions written for this benchmark: not the distillation data (Python docs and
# stdlib code), not the engine benchmark's prompts, never used to tune a policy.
QUESTIONS = ["Why do leaves change colour in autumn?", "How should I prepare for a job interview?",
             "What is a good way to start learning the guitar?", "Why is the sky blue during the day?",
             "Can you suggest a simple recipe for dinner tonight?", "How do vaccines train the immune system?",
             "What are some tips for sleeping better at night?", "How does a bicycle stay upright when moving?",
             "Explain the difference between weather and climate.", "What should I pack for a weekend hiking trip?",
             "How do I politely decline an invitation from a friend?", "Why do cats purr?",
             "What are the main causes of inflation?", "How can I save money on groceries?",
             "What makes a good short story?", "How do airplanes stay in the air?"]


# Programming requests, also written for this benchmark (the kind of text where drafts agree more).
CODING = ["Write a Python function that checks whether a year is a leap year.",
          "Write a JavaScript function that removes duplicates from an array.",
          "How do I sort a list of dictionaries by a key in Python?",
          "Write a SQL query that counts orders per customer.",
          "Write a Python class for a simple bank account with deposit and withdraw.",
          "Show how to read a CSV file with pandas and print the first rows.",
          "Write a bash script that renames all .txt files in a folder to .md.",
          "Write a Python function that returns the n-th Fibonacci number iteratively."]
# Everyday tasks of other kinds (writing, lists, rewriting, plans, arithmetic), added later to check
# the figures above on requests that no setting was chosen on.
TASKS = ["Write a short, friendly email asking my landlord to fix a leaking tap.",
         "Give me five ideas for a birthday party for a ten-year-old.",
         "Summarize the plot of Romeo and Juliet in a few sentences.",
         "What are the pros and cons of living in a big city?", "Explain to a child how rain forms.",
         "Rewrite this sentence to sound more formal: we can't make it to the meeting, sorry.",
         "List some healthy snacks I can take to work.", "How do I change a flat tyre on a car?",
         "Write a haiku about the sea.", "What is the difference between a virus and a bacterium?",
         "Plan a three-day trip to Rome for a first-time visitor.",
         "A train travels 120 km in 1.5 hours. What is its average speed? Explain.",
         "How can I improve my public speaking?",
         "Translate 'Where is the train station?' into French and Spanish.",
         "Describe the water cycle step by step.", "What are good habits for keeping a clean kitchen?"]
# Written on 2026-12-05 after the lookup corpus's settings were fixed (specdec/corpus.py), and used
# only to measure it: nothing was chosen on these.
FRESH = ["How do I get a stubborn stain out of a white shirt?", "What is the best way to learn a new language as an adult?",
         "Why do we have leap years?", "Write a thank-you note to a neighbour who watered my plants.",
         "What should I look for when buying a used car?", "How do bees make honey?",
         "Give me a simple weekly exercise plan for a beginner.", "What causes thunder and lightning?",
         "How can I stay focused while studying at home?", "Explain what a mortgage is in plain words.",
         "Suggest three board games for a family evening and say why.", "Why does bread go stale?",
         "What are some ways to reduce stress at work?", "How do I write a good cover letter?",
         "Describe how a refrigerator keeps food cold.", "What is the difference between a lake and a pond?",
         "How do I care for a cactus?", "Tell me a short bedtime story about a brave little fox.",
         "What are the benefits of drinking water?", "How do solar panels produce electricity?",
         "Recommend a few ways to make new friends in a new city.", "Why do onions make people cry?",
         "What is compound interest? Give an example.", "How should I store fresh herbs so they last longer?"]
# Written on 2026-12-06, before any measurement on them; held out from every choice of a setting.
HELDOUT = ["What is the difference between baking soda and baking powder?", "How do I start a vegetable garden on a balcony?",
           "Why do some people get seasick?", "Write a short message congratulating a colleague on a promotion.",
           "How does a credit score work?", "What are the rules of chess for beginners?",
           "Explain how the moon causes tides.", "How can I make my phone battery last longer?",
           "Give me three ideas for a rainy Sunday afternoon with kids.", "Why is it important to warm up before exercise?",
           "What is the history of the Olympic Games in a few sentences?", "How do I negotiate a higher salary?",
           "Describe how coffee is grown and roasted.", "What should I do if my dog eats chocolate?",
           "How do noise-cancelling headphones work?", "Suggest a packing list for a beach holiday."]
# Written on 2026-12-06 (fourth session) before the draft trained that day was measured, to compare drafts
# on questions neither distillation run nor any choice of a setting has seen.
UNSEEN = ["Why do cats purr?", "How do I fix a squeaky door hinge?", "What is the difference between weather and climate?",
          "Write a short apology to a friend for missing their party.", "How does a microwave oven heat food?",
          "What are good habits for keeping a tidy kitchen?", "Explain what inflation is to a teenager.",
          "How can I tell if an egg is still fresh?", "Suggest a three-day itinerary for a first visit to Rome.",
          "Why do we dream?", "How do I choose a good pair of running shoes?", "What is a black hole?",
          "Give me tips for speaking confidently in a meeting.", "How do vaccines train the immune system?",
          "Write a limerick about a forgetful robot.", "What should I consider before adopting a cat?"]
# Written on 2026-12-06 (sixth session, a Xeon with AMX) before any measurement on them, to re-measure
# the service on this machine after the bf16 row-chunking fix.
TODAY = ["How do I keep basil alive indoors?", "What makes the sky turn red at sunset?",
         "Write a two-sentence invitation to a book club meeting.", "How do airplanes stay in the air?",
         "What is the difference between a virus and a bacterium?", "Give me five tips for sleeping better.",
         "Explain what a budget is and how to make one.", "Why do leaves change colour in autumn?",
         "How do I politely decline a job offer?", "What is photosynthesis, in simple terms?",
         "Suggest a healthy breakfast I can make in ten minutes.", "How does a bicycle gear system work?",
         "Write a haiku about the first snow of winter.", "What are the main causes of traffic jams?",
         "How can I teach a child to tie their shoes?", "Why is the ocean salty?"]
# Written on 2026-12-07 (seventeenth session) before any measurement on them, to judge a larger lookup
# corpus on questions that no setting, corpus or draft was chosen on.
DEC7 = ["How do I remove rust from garden tools?", "Why do our ears pop on an airplane?",
        "Write a short note asking a neighbour to keep the music down at night.", "What is the difference between a comet and an asteroid?",
        "How can I make homemade pizza dough?", "Explain how a vaccine is tested before it is approved.",
        "Give me four ideas for a cheap date night at home.", "Why do some trees lose their leaves in winter while others do not?",
        "How do I prepare for my first marathon?", "What does a project manager do all day?",
        "Write a short poem about a rainy train journey.", "How does recycling plastic actually work?",
        "What are some polite ways to end a phone call?", "Explain the rules of basketball in simple terms.",
        "How do I clean a cast-iron pan?", "Why is it colder at the top of a mountain?"]
PROMPT_SETS = {"everyday": QUESTIONS, "coding": CODING, "tasks": TASKS, "fresh": FRESH, "heldout": HELDOUT,
               "unseen": UNSEEN, "today": TODAY, "dec7": DEC7}

STOP_AT_EOS = False  # --stop-at-eos: answers end at the model's end of sequence (else ignore_eos)


async def sse_chunks(client, url: str, path: str, body: dict):
    """The JSON objects of a streamed response (a non-200 status raises)."""
    async with client.stream("POST", f"{url}{path}", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


async def one(client, url, model, q, max_tokens, spec: bool, temperature: float = 0.0):
    """One streamed request: (start, arrival time of each content chunk, completion tokens).

    With STOP_AT_EOS the answer ends where the model ends it (or at max_tokens) and the count comes
    from the usage chunk; otherwise it runs to max_tokens (ignore_eos)."""
    body = {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True}
    body.update({"stream_options": {"include_usage": True}} if STOP_AT_EOS else {"ignore_eos": True})
    if spec is not True:  # False: speculation off; an int: that many drafts per round (pinned)
        body["num_speculative_tokens"] = int(spec)
    t0 = time.perf_counter()
    times, text = [], []
    async for chunk in sse_chunks(client, url, "/v1/chat/completions", body):
        if chunk.get("usage"):
            max_tokens = chunk["usage"]["completion_tokens"]
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            times.append(time.perf_counter())
            text.append(chunk["choices"][0]["delta"]["content"])
    return t0, times, max_tokens


async def level(url, model, concurrency, requests, max_tokens, spec, bar, temperature: float = 0.0,
                questions: list[str] = QUESTIONS, offset: int = 0):
    """`requests` streaming requests, `concurrency` at a time: tokens, wall seconds, TTFTs, ITLs."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def task(i):
            async with sem:
                res = await one(client, url, model, questions[(offset + i) % len(questions)], max_tokens, spec,
                                temperature)
                bar.update()
                return res
        t0 = time.perf_counter()
        results = await asyncio.gather(*[task(i) for i in range(requests)])
        wall = time.perf_counter() - t0
    tokens = sum(n for _, _, n in results)
    return {"tokens": tokens, "wall": wall, "tps": tokens / wall,
            "ttft": [ts[0] - t for t, ts, _ in results if ts],
            "itl": [(ts[-1] - ts[0]) / (n - 1) for t, ts, n in results if len(ts) > 1]}


STAT_KEYS = ("proposed", "accepted", "rounds", "emitted", "draft_time", "target_time", "round_time",
             "lookup_accepted", "lookup_proposed")
GATE_KEYS = ("rounds", "rounds_without")  # the LookupGate's multi-step rounds planned, of them without lookups
# (kept as gate_rounds, gate_rounds_without)


def paired_level(url, model, concurrency, requests, max_tokens, bar, temperature, questions, first_spec: bool,
                 per_client: int = 1):
    """Speculation off and on at one concurrency level, alternating wave by wave (a wave:
    `per_client` requests per client slot, each client sending its next request as soon as one
    ends; the same questions in both modes), so that both modes see the same machine: this one's
    speed drifts by 10-30 % within minutes. A wave ends with its slowest request: with one request
    per client, rows that finish at different times (speculation) leave the lane running short
    batches at every wave's end, which a steady stream of requests does not. Returns {spec: measurements}."""
    out = {s: {"tokens": 0, "wall": 0.0, "ttft": [], "itl": [], **{k: 0.0 for k in STAT_KEYS}, **{f"gate_{k}": 0.0 for k in GATE_KEYS}}
           for s in (False, True)}
    size = concurrency * per_client
    waves = max(1, requests // size)
    for w in range(waves):
        for spec in ((first_spec, not first_spec) if w % 2 == 0 else (not first_spec, first_spec)):
            before = httpx.get(f"{url}/stats", timeout=30).json()
            r = asyncio.run(level(url, model, concurrency, size, max_tokens, spec, bar, temperature,
                                  questions, offset=w * size))
            after = httpx.get(f"{url}/stats", timeout=30).json()
            o = out[spec]
            for k in ("tokens", "wall", "ttft", "itl"):
                o[k] += r[k]
            for k in STAT_KEYS:
                o[k] += after[k] - before[k]
            for k in GATE_KEYS:
                o[f"gate_{k}"] += after["lookup_gate"][k] - before["lookup_gate"][k]
    return out


def run_engine(tok, worker, proposer, batch: int, n_prompts: int, max_tokens: int, temperature: float = 0.0,
               questions: list[str] = QUESTIONS, scheduling=None) -> dict:
    """Chat on questions[:n_prompts] in process (greedy, or sampled at `temperature`), `batch` at a
    time (after a short warm-up): tokens/s, and target forward ms and round ms per round.
    `scheduling`: the router's knobs (serve_app's SchedulingConfig) for the engine; None: the engine's defaults."""
    from dataclasses import fields

    from specdec.engine import EngineConfig, LLMEngine
    from specdec.prompts import encode_chat
    from specdec.sampling import SamplingParams
    knobs = {f.name: getattr(scheduling, f.name) for f in fields(EngineConfig) if hasattr(scheduling, f.name)}
    eng = LLMEngine(worker, proposer, tok, EngineConfig(**{**knobs, "max_batch_size": batch,
                                                           "max_model_len": worker.max_model_len,
                                                           "speculate": proposer is not None}))
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in questions[:n_prompts]]
    eng.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm up
    rounds0, target0, round0 = eng.stats.rounds, eng.stats.target_time, eng.stats.round_time
    t0 = time.perf_counter()
    seqs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                ignore_eos=not STOP_AT_EOS))
    wall = time.perf_counter() - t0
    n = max(1, eng.stats.rounds - rounds0)
    return {"tps": sum(s.num_output for s in seqs) / wall, "target_ms": (eng.stats.target_time - target0) / n * 1e3,
            "round_ms": (eng.stats.round_time - round0) / n * 1e3}


def engine_baselines(app, max_tokens, n_prompts=4, temperature: float = 0.0,
                     questions: list[str] = QUESTIONS) -> tuple[float, float]:
    """In-process tokens/s at batch 1 on the same prompts, same threads as a replica (all cores):
    (the service's path: the app's proposer, scheduling knobs, lookup corpus and in-target draft
    (serve_app.args.AppArgs `app`); plain decoding)."""
    import torch

    from deployments.draft import make_proposer
    from deployments.target import make_worker
    from specdec.loader import load_model, load_tokenizer, parse_dtype
    from specdec.target_worker import TargetWorker
    torch.set_num_threads(os.cpu_count() or 1)
    app.validate_models()
    tc, dc, rc = app.target_config(), app.draft_config(), app.router_config()
    tok, model = load_tokenizer(tc.model), load_model(tc.model, dtype=parse_dtype(tc.dtype))
    one = {"num_slots": 1, "max_model_len": 2048}
    prop = make_proposer(dc.model_copy(update=one), target_model=model)
    worker = make_worker(tc.model_copy(update={**one, "return_hidden": False}), model)
    spec = run_engine(tok, worker, prop, 1, n_prompts, max_tokens, temperature, questions, rc)["tps"]
    plain = run_engine(tok, TargetWorker(model, 1, 2048), None, 1, n_prompts, max_tokens, temperature, questions)["tps"]
    return spec, plain


def start_local(args: dict, port: int = 8765) -> str:
    """Start a local Ray cluster and the app built from `args`; returns its URL."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve
    from serve_app import build_app
    ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False)  # (its own)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running service; default: start the demo pair locally")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--proposer", default=None, help="default: the app's default (AppArgs)")
    ap.add_argument("--draft", default=None, help="draft checkpoint for proposer draft/eagle/hybrid")
    ap.add_argument("--dtype", default="auto", help="auto: the app's default (specdec.loader.fast_dtype)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=0, help="per level and mode (default: 4 x concurrency, >= 16)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled requests (unseeded)")
    ap.add_argument("--prompts", default="everyday", choices=sorted(PROMPT_SETS), help="which questions")
    ap.add_argument("--repeats", type=int, default=3, help="runs of every level (each ratio from one run)")
    ap.add_argument("--warmup", type=int, default=2, help="requests per mode before measuring (a fresh "
                    "router's first rounds calibrate the adaptive cost model; 0: measure them too)")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--stop-at-eos", action="store_true", help="answers end where the model ends them (at most "
                    "--max-tokens), as a user's do; tokens/s counts the usage chunk's completion tokens "
                    "(greedy answers are the same in both modes). Default: exactly --max-tokens (ignore_eos)")
    ap.add_argument("--per-client", type=int, default=1, help="requests each client sends back to back within "
                    "a wave (closed loop); --requests rounds to whole waves of concurrency x this")
    ap.add_argument("--app-args", default="{}", help="JSON: extra AppArgs for the local app (e.g. "
                    '\'{"lookup_k": 0}\')')
    a = ap.parse_args(argv)
    global STOP_AT_EOS
    STOP_AT_EOS = a.stop_at_eos
    if a.dtype == "auto":
        from specdec.loader import fast_dtype
        a.dtype = fast_dtype()
    levels = [int(c) for c in a.concurrency.split(",")]
    args = {"target": a.target, "dtype": a.dtype, "max_batch_size": max(levels)}
    args.update({k: v for k, v in (("proposer", a.proposer), ("draft", a.draft)) if v is not None})
    args.update(json.loads(a.app_args))
    url = a.url or start_local(args)
    # whole waves; by default at least 4 per mode and run (one wave per mode at 16 measured 0.77-0.94x
    # for identical work on this machine, four waves 1.00-1.05x)
    w = {c: c * a.per_client for c in levels}  # requests per wave
    n_req = {c: w[c] * max(1, (a.requests or max(16, 4 * c)) // w[c]) for c in levels}
    from serve_app.args import AppArgs
    app = AppArgs(**{**args, "max_batch_size": 1})
    baselines = []  # in process, before and after the HTTP runs: their mean is what the service is held to
    if not a.no_engine:
        baselines.append(engine_baselines(app, a.max_tokens, temperature=a.temperature, questions=PROMPT_SETS[a.prompts]))
    bar = tqdm(total=2 * a.repeats * sum(n_req.values()) + 2 * a.warmup, desc="http bench")
    for spec in (False, True):  # warm-up, not measured: a fresh router calibrates its cost model
        asyncio.run(level(url, a.model, 1, a.warmup, a.max_tokens, spec, bar, a.temperature, PROMPT_SETS[a.prompts]))
    rows = []
    for rep in range(a.repeats):
        for c in levels:
            pair = paired_level(url, a.model, c, n_req[c], a.max_tokens, bar, a.temperature,
                                PROMPT_SETS[a.prompts], first_spec=rep % 2 == 1, per_client=a.per_client)
            for spec, m in pair.items():
                r = {"tps": m["tokens"] / m["wall"], "ttft": statistics.median(m["ttft"]),
                     "itl": statistics.median(m["itl"])}
                prop, rounds = m["proposed"], max(1, m["rounds"])
                acc = m["accepted"] / prop if prop else 0.0
                split = {k: m[k] / rounds * 1e3 for k in ("draft_time", "target_time", "round_time")}
                looked = (m["lookup_accepted"] / max(1, m["emitted"]), m["lookup_accepted"] / max(1, m["lookup_proposed"]),
                          m["gate_rounds"] - m["gate_rounds_without"], m["gate_rounds"])
                rows.append((rep, c, spec, r, acc, split, prop / max(1, m["emitted"]), looked))
    bar.close()
    base = plain = None
    if not a.no_engine:  # (this machine's speed drifts by 20-30% within minutes)
        baselines.append(engine_baselines(app, a.max_tokens, temperature=a.temperature, questions=PROMPT_SETS[a.prompts]))
        base, plain = (statistics.mean(x) for x in zip(*baselines))
    how = "greedy" if a.temperature == 0 else f"temperature {a.temperature:g}"
    print(f"\n{a.model} via {url} (proposer {app.proposer}), {how} streaming chat ({a.prompts} questions), "
          f"{'up to ' if a.stop_at_eos else ''}{a.max_tokens} tokens, {a.dtype}, "
          f"{a.per_client} request{'s' if a.per_client > 1 else ''} per client and wave")
    print(f"app args: {args}")
    print("| run | concurrency | speculation | tokens/s | TTFT p50 ms | ITL p50 ms | acceptance | drafts/token | "
          "lookup tokens/token (of proposed; gated rounds with lookups) | round ms (draft / target / other) | spec/off |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    off = {(rep, c): r["tps"] for rep, c, spec, r, *_ in rows if not spec}
    ratios = {}
    for rep, c, spec, r, acc, sp, drafts, looked in sorted(rows, key=lambda x: x[:3]):
        if spec:
            ratios.setdefault(c, []).append(r["tps"] / off[rep, c])
        other = sp["round_time"] - sp["draft_time"] - sp["target_time"]
        print(f"| {rep + 1} | {c} | {'adaptive' if spec else 'off'} | {r['tps']:.1f} | {r['ttft'] * 1e3:.0f} | "
              f"{r['itl'] * 1e3:.1f} | {acc:.2f} | {drafts:.2f} | {looked[0]:.2f} ({looked[1]:.2f}; "
              f"{looked[2]:.0f}/{looked[3]:.0f}) | {sp['round_time']:.1f} ({sp['draft_time']:.1f} / "
              f"{sp['target_time']:.1f} / {other:.1f}) | {r['tps'] / off[rep, c]:.2f}x |")
    print("\n| concurrency | spec/off per run | median |")
    print("|---|---|---|")
    for c, rs in ratios.items():
        print(f"| {c} | {' / '.join(f'{x:.2f}x' for x in rs)} | {statistics.median(rs):.2f}x |")
    if base:
        c1 = [r["tps"] for _, c, s, r, *_ in rows if c == 1 and s]
        c1_off = [r["tps"] for _, c, s, r, *_ in rows if c == 1 and not s]
        kept = (f"; service at concurrency 1 keeps {statistics.median(c1) / base:.0%} (speculation on) and "
                f"{statistics.median(c1_off) / plain:.0%} (plain)") if c1 else ""
        print(f"\nin-process engine, batch 1, same prompts, the app's configuration (mean of a run before and one after "
              f"the HTTP runs): speculating ({app.proposer}) {base:.1f} tok/s, plain {plain:.1f} tok/s{kept}")


if __name__ == "__main__":
    main()
