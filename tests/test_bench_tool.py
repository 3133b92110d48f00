"""The engine benchmark (`specdec-bench`): each row's speedup is against the plain runs timed beside
it, and the whole tool runs end to end on a tiny checkpoint."""
from __future__ import annotations

import itertools

import pytest

from specdec.stats import SpecStats
from specdec_tools import bench


def test_speedup_is_against_the_plain_runs_beside_each_row(monkeypatch):
    """Plain decoding drifts 1 s -> 2 s -> 3 s -> 4 s over the run, every configuration takes 1.5 s:
    each row is held to the mean of the plain run before it and the one after it."""
    plain_seconds = itertools.count(1.0)
    calls = []

    def fake_run_engine(model, tok, prompts, proposer, k, batch, max_tokens, **opts):
        st = SpecStats(rounds=4, target_time=0.4, emitted=8)
        plain = proposer is None
        calls.append("plain" if plain else "config")
        return [[1, 2, 3, 4]] * len(prompts), float(next(plain_seconds)) if plain else 1.5, st

    monkeypatch.setattr(bench, "run_engine", fake_run_engine)
    rows = bench.bench_engine(None, None, [[1], [2]], [], ks=[2], batch=2, max_tokens=4, bar=bench._Null())
    assert [r.name for r in rows] == ["plain", "ngram", "ngram adaptive"]
    assert calls == ["plain", "config", "plain", "config", "plain"]  # interleaved
    assert rows[0].speedup == pytest.approx(1.0)
    assert rows[1].speedup == pytest.approx((1.0 + 2.0) / 2 / 1.5)
    assert rows[2].speedup == pytest.approx((2.0 + 3.0) / 2 / 1.5)
    merged = bench._merge([rows[1], rows[1]])  # batch 1 sums prompts: seconds and plain seconds alike
    assert merged.speedup == pytest.approx(rows[1].speedup)


def test_bench_runs_end_to_end_on_a_tiny_checkpoint(tiny_dir, capsys):
    bench.main(["--target", str(tiny_dir), "--no-hf", "--no-self", "--ks", "2", "--batches", "1,2",
                "--prompts", "2", "--max-tokens", "6", "--kinds", "chat", "--threads", "1", "--waves", "2"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[1:]]
    assert [(r[0], r[1]) for r in rows] == [(name, b) for b in ("1", "2")
                                            for name in ("plain", "ngram", "ngram adaptive")]
    assert all(r[10] == "yes" for r in rows if r[0] != "plain")  # speculation's output is plain decoding's
    assert all(r[8].endswith("x") and r[8] != "nanx" for r in rows)
    assert [r[8] for r in rows if r[0] == "plain"] == ["1.00x", "1.00x"]
