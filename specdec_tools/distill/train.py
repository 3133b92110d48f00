"""The distillation loop: token-level KL(p_target || q_draft) over the kept vocabulary (DistillSpec,
Zhou et al. 2023; the reduced head is FR-Spec, Zhao et al. 2025) on a mix of plain text rows and
the target's own answers to chat prompts (fraction `mix`).

Each step: draw B = batch_tokens // seq_len rows, prefill them through the teacher for sparse
top-k targets, run the draft (bf16 autocast on CPU), AdamW with warmup + cosine decay over the
run's progress (steps or minutes, whichever ends first), gradient clipping. `ckpt.pt` in the
output directory holds model, optimizer, step, elapsed time and both data cursors, and is
written every `save_minutes` and at the end, so `--resume` continues the same schedule.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from specdec_tools.distill.teacher import pad_rows


@dataclass
class TrainConfig:
    steps: int | None = None  # stop after this many optimizer steps (total, across resumes)
    minutes: float | None = None  # ... or after this much training time (total, across resumes)
    batch_tokens: int = 4096
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 10
    weight_decay: float = 0.01
    clip: float = 1.0
    mix: float = 0.25
    seed: int = 0
    save_minutes: float = 5.0
    amp: bool = True


def lr_factor(step: int, progress: float, warmup: int, min_ratio: float) -> float:
    warm = min(1.0, (step + 1) / max(1, warmup))
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return warm * (min_ratio + (1 - min_ratio) * cos)


def kl_loss(logits: Tensor, t_ids: Tensor, t_probs: Tensor, mask: Tensor) -> tuple[Tensor, float]:
    """logits [B, T, N]; t_ids, t_probs [B, T, k]; mask [B, T]. Mean KL over masked positions and
    the fraction of them where the draft's argmax is the teacher's."""
    logq = F.log_softmax(logits.float(), dim=-1)  # [B, T, N]
    lq = logq.gather(-1, t_ids)  # [B, T, k]
    kl = (t_probs * (t_probs.clamp_min(1e-12).log() - lq)).sum(-1)  # [B, T]
    n = mask.sum().clamp_min(1)
    match = ((logits.argmax(-1) == t_ids[..., 0]) & mask).sum() / n
    return (kl * mask).sum() / n, float(match)


class Trainer:
    def __init__(self, student, teacher, stream, pool, cfg: TrainConfig, out: Path, pad_id: int,
                 state: dict | None = None, meta: dict | None = None):
        self.student, self.teacher, self.stream, self.pool = student, teacher, stream, pool
        self.cfg, self.out, self.pad, self.meta = cfg, Path(out), pad_id, meta or {}
        decay = [p for p in student.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in student.parameters() if p.requires_grad and p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
        self.rows = max(1, cfg.batch_tokens // cfg.seq_len)
        st = state or {}
        self.step = st.get("step", 0)
        self.elapsed = st.get("elapsed", 0.0)
        self.timing = st.get("timing", {"teacher_s": 0.0, "student_s": 0.0, "tokens": 0, "seq_rows": 0, "rows": 0})
        self.last = st.get("last", {})
        if "optimizer" in st:
            self.opt.load_state_dict(st["optimizer"])

    def progress(self) -> float:
        p = 0.0
        if self.cfg.steps:
            p = max(p, self.step / self.cfg.steps)
        if self.cfg.minutes:
            p = max(p, self.elapsed / (60 * self.cfg.minutes))
        return p

    def done(self) -> bool:
        if self.cfg.steps is not None and self.step >= self.cfg.steps:
            return True
        return self.cfg.minutes is not None and self.elapsed >= 60 * self.cfg.minutes

    def batch(self) -> tuple[Tensor, Tensor]:
        """tokens [B, T] and mask [B, T]: True where position t's next-token distribution is trained."""
        rng = random.Random(self.cfg.seed * 1_000_003 + self.step)
        rows, starts = [], []
        for _ in range(self.rows):
            if self.pool is not None and self.cfg.mix > 0 and rng.random() < self.cfg.mix:
                row, answer = self.pool.take(self.elapsed)
                starts.append(max(0, answer - 1))  # the last prompt position predicts the answer's first token
                self.timing["seq_rows"] += 1
            else:
                row = self.stream.next_row(rng)
                starts.append(0)
            rows.append(row)
        tokens, lengths = pad_rows(rows, self.pad)
        pos = torch.arange(tokens.shape[1])[None, :]
        mask = (pos < lengths[:, None]) & (pos >= torch.tensor(starts)[:, None])  # [B, T]
        self.timing["rows"] += len(rows)
        return tokens, mask

    def train_step(self) -> dict:
        tokens, mask = self.batch()
        t0 = time.perf_counter()
        t_ids, t_probs = self.teacher.targets(tokens)  # [B, T, k] each
        t1 = time.perf_counter()
        lr = self.cfg.lr * lr_factor(self.step, self.progress(), self.cfg.warmup, self.cfg.min_lr_ratio)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.student.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.amp):
            logits = self.student(tokens)  # [B, T, N]
        loss, match = kl_loss(logits, t_ids, t_probs, mask)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.student.parameters(), self.cfg.clip)
        self.opt.step()
        t2 = time.perf_counter()
        n = int(tokens.numel())
        self.timing["teacher_s"] += t1 - t0
        self.timing["student_s"] += t2 - t1
        self.timing["tokens"] += n
        self.step += 1
        self.last = {"kl": float(loss.detach()), "match": match, "lr": lr, "grad_norm": float(gnorm)}
        return self.last

    def save(self) -> None:
        state = {"model": self.student.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step,
                 "elapsed": self.elapsed, "timing": self.timing, "last": self.last,
                 "stream": dict(self.stream.state), "pool": self.pool.state if self.pool else None,
                 "kept": self.student.kept.tolist(), "config": self.student.config.to_dict(),
                 "train_config": asdict(self.cfg), **self.meta}
        tmp = self.out / "ckpt.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.out / "ckpt.pt")

    def run(self) -> dict:
        bar = tqdm(total=self.cfg.steps, initial=self.step, unit="step", desc="distill", mininterval=1.0,
                   dynamic_ncols=True)
        last_save = time.perf_counter()
        while not self.done():
            t0 = time.perf_counter()
            m = self.train_step()
            self.elapsed += time.perf_counter() - t0
            left = (60 * self.cfg.minutes - self.elapsed) / 60 if self.cfg.minutes else None
            bar.update(1)
            bar.set_postfix(kl=f"{m['kl']:.3f}", match=f"{m['match']:.2f}", lr=f"{m['lr']:.1e}",
                            tok_s=f"{self.timing['tokens'] / max(self.elapsed, 1e-9):.0f}",
                            **({"min_left": f"{left:.1f}"} if left is not None else {}))
            if time.perf_counter() - last_save > 60 * self.cfg.save_minutes:
                self.save()
                last_save = time.perf_counter()
        bar.close()
        self.save()
        return self.summary()

    def summary(self) -> dict:
        t = self.timing
        gen_s = self.pool.gen_seconds if self.pool else 0.0
        return {
            "steps": self.step, "train_seconds": round(self.elapsed, 1), "tokens": t["tokens"],
            "seq_level_rows": t["seq_rows"], "rows": t["rows"],
            "teacher_tokens_per_s": round(t["tokens"] / t["teacher_s"], 1) if t["teacher_s"] else None,
            "train_tokens_per_s": round(t["tokens"] / t["student_s"], 1) if t["student_s"] else None,
            "overall_tokens_per_s": round(t["tokens"] / self.elapsed, 1) if self.elapsed else None,
            "gen_seconds": round(gen_s, 1),
            "gen_tokens_per_s": round(self.pool.gen_tokens / gen_s, 1) if gen_s else None,
            **{f"final_{k}": v for k, v in self.last.items()},
        }
