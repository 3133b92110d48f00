"""The engine of this working tree against the same engine at another revision, alternated.

    python bench/tree_ab.py --base HEAD~1 [--batches 1,4,8,16] [--kinds chat,code] [--repeats 2] [--temperature 1.0]

A change to the scheduler or the adaptive policy is judged by the speedup it gives, and this
2-core machine's speed drifts within minutes, so the two versions run alternately, each in its own
process (`git worktree` holds the base revision under /tmp): for every batch size and prompt kind,
base then this tree then base then ..., each run timing plain decoding and the hybrid (prompt
lookup + the shipped EAGLE draft, adaptive k, as the default app) on `specdec-bench`'s prompts, 64
tokens after a warm-up wave, greedy or (`--temperature`) sampled without a seed, as most clients
send. The table gives each version's adaptive / plain ratio per run and their means; greedy outputs
are checked against plain decoding in the child.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent


def child(batch: int, kind: str, prompts: int, repeats: int, temperature: float) -> None:
    """One version's runs (this process imports the tree it was started in): prints a JSON line."""
    from specdec_tools.bench import add_target_args, draft_factories, load_demo_target, prompt_kinds, run_engine
    ap = argparse.ArgumentParser()
    add_target_args(ap)
    tok, model, dtype = load_demo_target(ap.parse_args([]))
    make = dict(draft_factories("smollm2-eagle", model, dtype))
    hybrid = next(f for name, f in make.items() if name.startswith("hybrid"))
    ids = (prompt_kinds(tok, 16)[kind] * 4)[:prompts]
    ratios = []
    for _ in range(repeats):
        base, t_plain, _ = run_engine(model, tok, ids, None, 0, batch, 64, warm_tokens=32, temperature=temperature)
        out, t_spec, _ = run_engine(model, tok, ids, hybrid(batch), 4, batch, 64, adaptive=True, warm_tokens=32,
                                    ngram_k=8 if batch == 1 else 0, temperature=temperature)
        assert temperature > 0 or out == base, "speculative output differs from plain decoding"
        ratios.append(t_plain / t_spec)
    print("RESULT " + json.dumps(ratios))


def run_child(tree: Path, batch: int, kind: str, prompts: int, repeats: int, temperature: float) -> list[float]:
    cmd = [sys.executable, str(tree / "bench" / "tree_ab.py"), "--child", str(batch), kind, str(prompts), str(repeats),
           str(temperature)]
    if not (tree / "bench" / "tree_ab.py").exists():  # a base from before this script: run this one there
        cmd[1] = str(Path(__file__).resolve())
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the revision to compare this working tree against")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--kinds", default="chat")
    ap.add_argument("--repeats", type=int, default=2, help="alternations of the two versions")
    ap.add_argument("--runs", type=int, default=1, help="plain/adaptive pairs per child run")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled, unseeded")
    a = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="tree_ab_")) / "base"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), a.base], cwd=ROOT, check=True)
    try:
        cells = [(int(b), k) for b in a.batches.split(",") for k in a.kinds.split(",")]
        results: dict[tuple[int, str, str], list[float]] = {}
        with tqdm(total=len(cells) * a.repeats * 2, desc="tree A/B") as bar:
            for batch, kind in cells:
                n = 6 if batch == 1 else batch
                for _ in range(a.repeats):
                    for name, tree in (("base", base), ("this tree", ROOT)):
                        results.setdefault((batch, kind, name), []).extend(
                            run_child(tree, batch, kind, n, a.runs, a.temperature))
                        bar.update()
        print(f"\nadaptive hybrid / plain, bf16 where native, 64 tokens, T = {a.temperature}, base = {a.base}")
        print("| batch | prompts | base, per run | this tree, per run | base mean | this tree mean |")
        print("|---|---|---|---|---|---|")
        for batch, kind in cells:
            old, new = results[(batch, kind, "base")], results[(batch, kind, "this tree")]
            print(f"| {batch} | {kind} | {' / '.join(f'{r:.3f}' for r in old)} | {' / '.join(f'{r:.3f}' for r in new)} "
                  f"| {sum(old) / len(old):.3f}x | {sum(new) / len(new):.3f}x |")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)


if __name__ == "__main__":
    main()
