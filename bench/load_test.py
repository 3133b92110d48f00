"""Load test over HTTP: many concurrent streaming clients, then a table of failures, throughput
and latencies.

    python bench/load_test.py --url http://127.0.0.1:8000 --concurrency 32 --requests 256
    python bench/load_test.py --url http://127.0.0.1:8000/tiny --model tiny_target0 --max-tokens 24

Each client streams completions (greedy unless --temperature, `ignore_eos` so every request
generates exactly its max_tokens, usage in the last chunk) one after another until `--requests`
have been sent. A request fails on a non-200 status, an error event in the stream, a missing
`[DONE]`, a transport error, or a token count other than asked for. Prints one markdown table:
requests, failures, throughput (requests/s, output tokens/s), end-to-end latency p50/p99 and time
to first token p50/p99. Loopback only in tests; `run_load()` is what tests/test_load.py calls.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import httpx

PROMPTS = ["def add(a, b):", "import json\n", "class Foo:", "for i in range(", "x = [1, 2,", "# comment\n",
           "while True:", "return self.", "What is the capital of France?", "Explain what a hash table is.",
           "with open(path) as f:", "try:\n    import", "if __name__ == '__main__':", "lambda x:",
           "Write a haiku about", "SELECT * FROM"]


@dataclass
class Result:
    index: int  # which prompt
    ok: bool = False
    status: int = 0
    text: str = ""
    tokens: int = 0
    latency: float = 0.0  # request sent -> [DONE]
    ttft: float | None = None  # request sent -> first non-empty text
    error: str | None = None


@dataclass
class LoadReport:
    results: list[Result] = field(default_factory=list)
    elapsed: float = 0.0
    concurrency: int = 0

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    def summary(self) -> dict:
        ok = [r for r in self.results if r.ok]
        lat = sorted(r.latency for r in ok)
        ttft = sorted(r.ttft for r in ok if r.ttft is not None)
        return {"requests": len(self.results), "failures": len(self.failures), "concurrency": self.concurrency,
                "elapsed_s": self.elapsed, "req_per_s": len(ok) / self.elapsed if self.elapsed else 0.0,
                "tokens_per_s": sum(r.tokens for r in ok) / self.elapsed if self.elapsed else 0.0,
                "latency_p50_s": _pct(lat, 50), "latency_p99_s": _pct(lat, 99),
                "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99)}

    def table(self) -> str:
        s = self.summary()
        rows = [("requests", f"{s['requests']}"), ("concurrency", f"{s['concurrency']}"),
                ("failures", f"{s['failures']}"), ("wall time (s)", f"{s['elapsed_s']:.1f}"),
                ("throughput (req/s)", f"{s['req_per_s']:.2f}"), ("throughput (tokens/s)", f"{s['tokens_per_s']:.1f}"),
                ("latency p50 (s)", f"{s['latency_p50_s']:.3f}"), ("latency p99 (s)", f"{s['latency_p99_s']:.3f}"),
                ("TTFT p50 (s)", f"{s['ttft_p50_s']:.3f}"), ("TTFT p99 (s)", f"{s['ttft_p99_s']:.3f}")]
        lines = ["| metric | value |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in rows]
        errors = sorted({r.error for r in self.failures if r.error})
        if errors:
            lines += ["", "errors: " + "; ".join(errors[:5])]
        return "\n".join(lines)


def _pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile (0.0 for no data)."""
    if not xs:
        return 0.0
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]


async def _one(client: httpx.AsyncClient, url: str, body: dict, index: int, headers: dict) -> Result:
    res = Result(index)
    t0 = time.perf_counter()
    text, done = [], False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = f"stream error: {chunk['error'].get('message')}"
                    continue
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices") or []:
                    if c.get("text"):
                        if res.ttft is None:
                            res.ttft = time.perf_counter() - t0
                        text.append(c["text"])
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - t0
    res.text = "".join(text)
    if res.error is None and not done:
        res.error = "stream ended without [DONE]"
    if res.error is None and res.tokens != body["max_tokens"] and body.get("ignore_eos"):
        res.error = f"{res.tokens} tokens, asked for {body['max_tokens']}"
    res.ok = res.error is None
    return res


async def run_load(url: str, model: str, *, concurrency: int = 32, requests: int = 256,
                   max_tokens: int | list[int] = 32, prompts: list[str] | None = None, temperature: float = 0.0,
                   ignore_eos: bool = True, api_key: str | None = None, timeout_s: float = 300.0) -> LoadReport:
    """`requests` streaming completions from `concurrency` clients; request i uses prompt
    i % len(prompts) and max_tokens[i % len(prompts)] when a list is given."""
    prompts = prompts or PROMPTS
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    report = LoadReport(concurrency=concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def client_loop(client):
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            j = i % len(prompts)
            n = max_tokens[j % len(max_tokens)] if isinstance(max_tokens, list) else max_tokens
            body = {"model": model, "prompt": prompts[j], "max_tokens": n, "temperature": temperature,
                    "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
            report.results.append(await _one(client, url, body, j, headers))

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[client_loop(client) for _ in range(concurrency)])
        report.elapsed = time.perf_counter() - t0
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="Base URL of the app (its route prefix included).")
    ap.add_argument("--concurrency", type=int, default=32, help="Concurrent streaming clients.")
    ap.add_argument("--requests", type=int, default=256, help="Requests in all.")
    ap.add_argument("--max-tokens", type=int, default=32, help="Tokens generated per request.")
    ap.add_argument("--model", default=None, help="Model id (default: the first of GET /v1/models).")
    ap.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (0: greedy).")
    ap.add_argument("--api-key", default=None, help="Bearer key, when the app requires one.")
    ap.add_argument("--json", action="store_true", help="Print the summary as JSON after the table.")
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or httpx.get(f"{args.url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    report = asyncio.run(run_load(args.url, model, concurrency=args.concurrency, requests=args.requests,
                                  max_tokens=args.max_tokens, temperature=args.temperature, api_key=args.api_key))
    print(report.table())
    if args.json:
        print(json.dumps(report.summary()))
    return 1 if report.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
