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


def _fake_stats_run_engine(per_prompt: dict):
    """run_engine that returns the counters `per_prompt[first prompt token]` (fixed-length output, 1 s)."""
    def run(model, tok, prompts, proposer, k, batch, max_tokens, **opts):
        st = SpecStats(rounds=4, target_time=0.4, emitted=8) if proposer is None else per_prompt[prompts[0][0]]
        return [[1, 2, 3, 4]] * len(prompts), 1.0, st
    return run


def test_batch1_rates_pool_the_counts_of_prompts_of_different_sizes(monkeypatch):
    """At batch 1 each prompt runs alone and the rows merge: acceptance and mean accepted length
    are the pooled counts' rates (accepted / proposed, emitted / row-rounds; lookups alike), not
    token-weighted means of per-prompt ratios."""
    short = SpecStats(rounds=20, row_rounds=20, spec_row_rounds=20, proposed=10, accepted=9, emitted=40,
                      lookup_proposed=4, lookup_accepted=4)
    long = SpecStats(rounds=100, row_rounds=100, spec_row_rounds=100, proposed=100, accepted=20, emitted=150,
                     lookup_proposed=60, lookup_accepted=6)
    monkeypatch.setattr(bench, "run_engine", _fake_stats_run_engine({1: short, 2: long}))
    per_prompt = [bench.bench_engine(None, None, [[p]], [], ks=[2], batch=1, max_tokens=4, bar=bench._Null(),
                                     lookup=2) for p in (1, 2)]
    merged = {r.name: r for r in (bench._merge([rs[i] for rs in per_prompt]) for i in range(len(per_prompt[0])))}
    assert merged["ngram"].acceptance == pytest.approx(29 / 110)
    assert merged["ngram"].mean_len == pytest.approx(190 / 120)
    assert merged["plain + lookup 2"].acceptance == pytest.approx(10 / 64)
    assert merged["plain + lookup 2"].mean_len == pytest.approx(1 + 10 / (190 - 10))
    assert (merged["plain"].acceptance, merged["plain"].mean_len) == (0.0, 1.0)


def test_progress_bar_total_is_the_number_of_updates(tiny_dir, tiny_draft_dir, tmp_path, monkeypatch):
    """Every configuration bench_engine and bench_hf run advances the bar once; the total says so,
    whatever the flags (drafts, lookup, a corpus, several k, batch 1 and batch > 1, HF)."""
    from specdec.corpus import NgramCorpus
    bars = []

    class Bar:
        def __init__(self, total=None, **_):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(bench, "tqdm", Bar)
    every = SpecStats(rounds=4, row_rounds=4, target_time=0.4, emitted=8)
    monkeypatch.setattr(bench, "run_engine", _fake_stats_run_engine({p: every for p in range(512)}))
    NgramCorpus.save(tmp_path / "corpus.npz", [[5, 6, 7, 8, 9]] * 4, 512)
    bench.main(["--target", str(tiny_dir), "--draft", str(tiny_draft_dir), "--self-draft-layers", "1",
                "--ks", "2,3", "--batches", "1,2", "--prompts", "1", "--max-tokens", "4", "--kinds", "chat",
                "--threads", "1", "--lookup", "2", "--corpus", str(tmp_path / "corpus.npz")])
    assert len(bars) == 1 and bars[0].n > 0 and bars[0].total == bars[0].n


def test_hf_rows_print_no_figures_they_did_not_measure(capsys):
    """transformers' generate reports no acceptance, round lengths or draft cost: the table says
    "-" there, not the defaults 1.00 and 0.000 (which BENCHMARKS.md once printed)."""
    from specdec_tools.bench import Row, print_table
    print_table([Row("HF prompt lookup", 1, 2, 100, 1.0, plain_s=1.0)])
    cells = capsys.readouterr().out.strip().splitlines()[-1].split("|")
    assert [c.strip() for c in cells[5:8]] == ["-", "-", "-"]
