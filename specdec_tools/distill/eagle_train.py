"""Train an EAGLE-style draft (specdec.eagle_draft; Li et al. 2024) from the target's cached features.

Features and logits come from the same cheap forward pass: one bf16 *prefill* of the target over
a row gives f_p at every position, and the teacher's distribution at p is head(f_p). So the
expensive part is done once (`FeatureCache.build`, ~1k tokens/s here) and training then makes
several passes over it at the draft's own speed (one layer: several thousand tokens/s).

Rows: the target's own greedy answers to training chat prompts and code prefixes (the serving
distribution; specdec_tools.distill.answers) and packed plain text (stdlib source and pydoc prose).
Loss per position p (EAGLE-1): smooth-L1(g_p, f_{p+1}) + w * CE(softmax(head(f_{p+1})), head(g_p)),
with uniform noise on the input features, plus the same loss for a second pass that reads the
draft's own predicted features where inference's second step does (after HASS, Zhang et al.
2024, and EAGLE-3's training-time test), so later draft steps degrade less. The draft vocabulary (FR-Spec, Zhao et al. 2025) is the N tokens the target
predicts most on these rows, counted in the same feature pass.
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.eagle_draft import EagleDraft
from specdec_tools.distill.teacher import check_draft_vocab
from specdec_tools.distill.train import lr_factor


@dataclass
class FeatureCache:
    """Rows of tokens with the target's features (bf16: final-norm, after the taps of its
    `feature_layers` if it has any), plus greedy-prediction counts."""

    tokens: list[Tensor]  # each [L] long
    feats: list[Tensor]  # each [L, (taps + 1) * hidden] bfloat16
    kinds: list[str]
    pred_counts: Tensor  # [vocab] how often the target's greedy prediction was each token

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @classmethod
    @torch.inference_mode()
    def build(cls, target, rows: list[tuple[str, list[int]]], batch_rows: int = 16, desc: str = "teacher features",
              path: Path | None = None, chunk_rows: int = 1024, save_minutes: float = 5.0) -> "FeatureCache":
        """Prefill `rows` ((kind, token ids)) through `target`, returned in their order, in chunks of
        `chunk_rows` (each sorted by length). Rows are cached by content in `path` (the whole store is
        rewritten after a chunk when `save_minutes` have passed since the last save, and at the end:
        on a GPU a chunk takes seconds and the store gigabytes): a rerun with rows added anywhere, or
        reordered, prefills only the rows the file lacks. `pred_counts` counts the target's greedy
        predictions over every row the file holds."""
        from tqdm import tqdm

        store = cls.load(path) if path is not None and Path(path).is_file() else \
            cls([], [], [], torch.zeros(target.args.vocab_size, dtype=torch.long))
        where = {tuple(t.tolist()): j for j, t in enumerate(store.tokens)}
        todo = list({tuple(r): (kind, r) for kind, r in rows if tuple(r) not in where}.values())
        bar = tqdm(total=sum(len(r) for _, r in todo), desc=desc, unit="tok", unit_scale=True, dynamic_ncols=True)
        last_save = time.perf_counter()
        for c in range(0, len(todo), chunk_rows):
            chunk = todo[c: c + chunk_rows]
            order = sorted(range(len(chunk)), key=lambda i: len(chunk[i][1]))
            for b in range(0, len(order), batch_rows):
                idx = order[b: b + batch_rows]
                for i, t, f in zip(idx, *store._prefill(target, [chunk[i][1] for i in idx])):
                    where[tuple(chunk[i][1])] = len(store.tokens)
                    store.tokens.append(t)
                    store.feats.append(f)
                    store.kinds.append(chunk[i][0])
                bar.update(sum(len(chunk[i][1]) for i in idx))
            last = c + chunk_rows >= len(todo)
            if path is not None and (last or time.perf_counter() - last_save > 60 * save_minutes):
                store.save(path)
                last_save = time.perf_counter()
        bar.close()
        idx = [where[tuple(r)] for _, r in rows]
        return cls([store.tokens[j] for j in idx], [store.feats[j] for j in idx], [k for k, _ in rows],
                   store.pred_counts)

    def _prefill(self, target, rows: list[list[int]]) -> tuple[list[Tensor], list[Tensor]]:
        T = max(len(r) for r in rows)
        tokens = torch.zeros(len(rows), T, dtype=torch.long)
        for r, ids in enumerate(rows):
            tokens[r, : len(ids)] = torch.tensor(ids)
        if target.num_slots < len(rows) or target.max_len < T or target.layers[0].self_attn.kv_cache is None:
            target.setup_cache(max(len(rows), target.num_slots), max(T, target.max_len))
        dev = target.device
        exact, target.exact_positions = target.exact_positions, False  # SDPA: 2-3x faster prefill here;
        try:  # features for training need no bit-exactness across forward shapes
            h = target.hidden_states(tokens.to(dev), torch.arange(len(rows), device=dev),
                                     torch.zeros(len(rows), dtype=torch.long, device=dev), taps=True)
        finally:
            target.exact_positions = exact
        pred = target.lm_head(h[..., -target.args.hidden_size:]).argmax(-1).cpu()  # [b, T] the target's greedy tokens: ranks the draft vocabulary
        h = h.to(torch.bfloat16).cpu()  # [b, T, (taps + 1) * hidden] the cache lives in host memory
        toks, feats = [], []
        for r, ids in enumerate(rows):
            n = len(ids)
            self.pred_counts += torch.bincount(pred[r, :n], minlength=len(self.pred_counts))
            toks.append(tokens[r, :n].clone())
            feats.append(h[r, :n].clone())
        return toks, feats

    def save(self, path: Path) -> None:
        tmp = Path(str(path) + ".tmp")
        torch.save({"tokens": self.tokens, "feats": self.feats, "kinds": self.kinds,
                    "pred_counts": self.pred_counts}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "FeatureCache":
        d = torch.load(path, weights_only=True)
        return cls(d["tokens"], d["feats"], d["kinds"], d["pred_counts"])

    def select_vocab(self, n: int, specials: list[int]) -> tuple[list[int], dict]:
        """The n tokens the target predicted most (plus `specials`) and their coverage."""
        V = len(self.pred_counts)
        check_draft_vocab(n, V, specials)
        if n <= 0 or n >= V:
            return list(range(V)), {"coverage": 1.0}
        score = self.pred_counts.double()
        score[specials] = -1
        kept = sorted(set(score.topk(n - len(specials)).indices.tolist()) | set(specials))
        cov = self.pred_counts[kept].sum().item() / max(1, self.pred_counts.sum().item())
        return kept, {"coverage": round(cov, 4), "tokens": int(self.pred_counts.sum())}


@dataclass
class EagleTrainConfig:
    minutes: float | None = 30.0
    steps: int | None = None
    batch_tokens: int = 4096
    lr: float = 5e-4
    warmup: int = 20
    min_lr_ratio: float = 0.1
    cls_weight: float = 0.5  # CE weight beside the feature regression
    noise: float = 0.1  # U(-noise, noise) added to input features
    draft_steps: int = 2  # > 1: also train draft steps 2.. on the draft's own features
    step2_weight: float = 0.7
    save_minutes: float = 5.0
    seed: int = 0
    amp: bool = True


def eagle_loss(draft: EagleDraft, feats: Tensor, tokens: Tensor, mask: Tensor, cfg: EagleTrainConfig,
               train: bool = True, generator: torch.Generator | None = None) -> tuple[Tensor, dict]:
    """feats [B, L, hidden] f_0..f_{L-1} (with a fusing draft: [B, L, (taps + 1) * hidden], the final
    feature last), tokens [B, L] x_0..x_{L-1}, mask [B, L] real positions.

    Step 1: position p reads (f_p, x_{p+1}) and predicts g_p ~ f_{p+1}. With cfg.draft_steps = 2, a
    second pass reads (g_{p-1}, x_{p+1}) -- the draft's own prediction of f_p, as at the second
    draft step of inference -- attending to the first pass's entries before p, and is trained on
    the same targets (weighted cfg.step2_weight): later draft steps degrade less. Each further step
    j reads step j-1's predictions the same way (its own errors compounded, as at draft step j of
    inference; the attention context stays the first pass's entries), weighted step2_weight^(j-1).
    The input noise is drawn from `generator` (torch's global generator if None)."""
    f_in, f_out = feats[:, :-1].float(), feats[:, 1:, -draft.args.hidden_size:].float()
    if train and cfg.noise > 0:
        u = torch.rand(f_in.shape, generator=generator, dtype=f_in.dtype, device=f_in.device)
        f_in = f_in + (u * 2 - 1) * cfg.noise
    m = (mask[:, 1:] & mask[:, :-1]).float()  # [B, L-1] positions with a real next token
    head = draft.lm_head.weight.float()
    p_teacher = torch.softmax(f_out @ head.T, -1)  # [B, L-1, N] the teacher at p+1
    t_top = p_teacher.argmax(-1)
    g, kv = draft.forward_train(f_in, tokens[:, 1:])  # [B, L-1, hidden] ~ f_1..f_{L-1}
    loss, info = _step_loss(g, f_out, head, p_teacher, t_top, m, cfg.cls_weight)
    prev, m_j = g, m.clone()
    for j in range(2, cfg.draft_steps + 1):  # training-time test: step j reads step j-1's predictions
        f_j = torch.cat([draft.fused(f_in[:, :1]).to(f_in.dtype), prev[:, :-1].detach().to(f_in.dtype)], 1)  # g_{p-1} in place of f_p
        prev, _ = draft.forward_train(f_j, tokens[:, 1:], context=kv)
        m_j = m_j.clone()  # (not in place: the previous step's loss saved it for backward)
        m_j[:, j - 2] = 0  # the first j-1 positions have no step j-1 prediction
        loss_j, info_j = _step_loss(prev, f_out, head, p_teacher, t_top, m_j, cfg.cls_weight)
        loss = loss + cfg.step2_weight ** (j - 1) * loss_j
        info[f"top1_step{j}"] = info_j["top1"]
    return loss, info


def _step_loss(g, f_out, head, p_teacher, t_top, m, cls_weight):
    n = m.sum().clamp_min(1)
    g = g.float()
    reg = (F.smooth_l1_loss(g, f_out, reduction="none").mean(-1) * m).sum() / n
    s_logits = g @ head.T
    ce = (-(p_teacher * torch.log_softmax(s_logits, -1)).sum(-1) * m).sum() / n
    top1 = ((s_logits.argmax(-1) == t_top).float() * m).sum() / n
    return reg + cls_weight * ce, {"reg": reg.item(), "ce": ce.item(), "top1": top1.item()}


def _batches(cache: FeatureCache, idx: list[int], batch_tokens: int):
    """Groups of row indices of similar length with about batch_tokens tokens each."""
    idx = sorted(idx, key=lambda i: len(cache.tokens[i]))
    groups, cur, cur_max = [], [], 0
    for i in idx:
        L = len(cache.tokens[i])
        if cur and max(cur_max, L) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, L)
    if cur:
        groups.append(cur)
    return groups


def _collate(cache: FeatureCache, rows: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    L = max(len(cache.tokens[i]) for i in rows)
    H = cache.feats[rows[0]].shape[-1]
    tokens = torch.zeros(len(rows), L, dtype=torch.long)
    feats = torch.zeros(len(rows), L, H, dtype=torch.bfloat16)
    mask = torch.zeros(len(rows), L, dtype=torch.bool)
    for r, i in enumerate(rows):
        n = len(cache.tokens[i])
        tokens[r, :n], feats[r, :n], mask[r, :n] = cache.tokens[i], cache.feats[i], True
    return feats, tokens, mask


class EagleTrainer:
    """Epochs over the feature cache (shuffled length-bucketed batches), AdamW with warmup and a
    cosine schedule on the run's progress; `ckpt.pt` (model, optimizer, step, time, epoch and the
    batches of it done, the running average of the step metrics, plus `meta`) every `save_minutes`.

    Every random draw is a function of what the checkpoint holds, as in the llama trainer: an
    epoch's batch order is seeded by (seed, epoch) and a step's input noise by (seed, step), so a
    resumed run skips the epoch's batches already trained and continues the same schedule, bit
    for bit (with a step budget; a time budget ends where the clock says)."""

    def __init__(self, draft: EagleDraft, cache: FeatureCache, cfg: EagleTrainConfig, out: Path,
                 state: dict | None = None, meta: dict | None = None):
        self.draft, self.cache, self.cfg, self.out, self.meta = draft, cache, cfg, Path(out), meta or {}
        self.params = [p for p in draft.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.step, self.elapsed, self.epoch, self.tokens_seen = 0, 0.0, 0, 0
        self.epoch_pos = 0  # batches of the current epoch already trained
        self.last: dict = {}  # running average (0.95) of the step metrics: the summary's train_top1/loss
        if state is not None:
            draft.load_state_dict(state["model"], strict=False)
            self.opt.load_state_dict(state["opt"])
            self.step, self.elapsed = state["step"], state["elapsed"]
            self.epoch, self.tokens_seen = state.get("epoch", 0), state.get("tokens_seen", 0)
            self.epoch_pos = state.get("epoch_pos", 0)
            self.last = state.get("last", {})

    def progress(self) -> float:
        parts = []
        if self.cfg.minutes:
            parts.append(self.elapsed / (60 * self.cfg.minutes))
        if self.cfg.steps:
            parts.append(self.step / self.cfg.steps)
        return max(parts) if parts else 1.0

    def save(self) -> None:
        state = {"model": self.draft.trained_state(), "opt": self.opt.state_dict(), "step": self.step,
                 "elapsed": self.elapsed, "epoch": self.epoch, "epoch_pos": self.epoch_pos,
                 "tokens_seen": self.tokens_seen, "last": self.last, "cfg": asdict(self.cfg),
                 "token_map": self.draft.token_map.tolist(), **self.meta}
        tmp = self.out / "ckpt.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.out / "ckpt.pt")

    def epoch_groups(self) -> list[list[int]]:
        """The current epoch's batches in training order (shuffled by (seed, epoch))."""
        groups = _batches(self.cache, list(range(len(self.cache.tokens))), self.cfg.batch_tokens)
        random.Random(self.cfg.seed * 1000 + self.epoch).shuffle(groups)
        return groups

    def noise_generator(self) -> torch.Generator:
        """The generator of this step's input noise, seeded by (seed, step), on the draft's device."""
        return torch.Generator(self.device).manual_seed(self.cfg.seed * 1_000_003 + self.step)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def train_step(self, rows: list[int]) -> dict:
        feats, tokens, mask = (t.to(self.device, non_blocking=True) for t in _collate(self.cache, rows))
        lr = self.cfg.lr * lr_factor(self.step, self.progress(), self.cfg.warmup, self.cfg.min_lr_ratio)
        for g in self.opt.param_groups:
            g["lr"] = lr
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.amp):
            loss, info = eagle_loss(self.draft, feats, tokens, mask, self.cfg, generator=self.noise_generator())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.step += 1
        self.tokens_seen += int(mask.sum())
        return {**info, "loss": loss.item(), "lr": lr}

    def averaged(self, info: dict) -> dict:
        """The running average after a step with metrics `info`. It lives in the checkpoint, so a
        resumed run goes on averaging where the interrupted one stopped (and a rerun at the final
        step, training nothing, reports what the finished run did)."""
        if not self.last:
            return dict(info)
        return {k: 0.95 * self.last.get(k, v) + 0.05 * v for k, v in info.items()}

    def run(self) -> dict:
        from tqdm import tqdm

        self.draft.train()
        bar = tqdm(total=100, desc="train eagle", unit="%", dynamic_ncols=True, initial=int(100 * self.progress()))
        last_save = time.perf_counter()
        while self.progress() < 1.0:
            for rows in self.epoch_groups()[self.epoch_pos:]:  # a resumed run skips the batches done
                if self.progress() >= 1.0:
                    break
                t0 = time.perf_counter()
                info = self.train_step(rows)
                self.elapsed += time.perf_counter() - t0
                self.epoch_pos += 1
                self.last = self.averaged(info)
                bar.n = int(100 * min(1.0, self.progress()))
                bar.set_postfix(step=self.step, ep=self.epoch, loss=f"{self.last['loss']:.3f}",
                                top1=f"{self.last['top1']:.3f}", top1_2=f"{self.last.get('top1_step2', 0.0):.3f}",
                                tok_s=f"{self.tokens_seen / max(self.elapsed, 1e-9):.0f}")
                bar.refresh()
                if time.perf_counter() - last_save > 60 * self.cfg.save_minutes:
                    self.save()
                    last_save = time.perf_counter()
            else:
                self.epoch, self.epoch_pos = self.epoch + 1, 0
        bar.close()
        self.save()
        self.draft.eval()
        return {"steps": self.step, "epochs": round(self.epoch + 0.0, 2), "minutes": round(self.elapsed / 60, 2),
                "tokens_seen": self.tokens_seen, "train_top1": round(self.last.get("top1", 0.0), 4),
                "train_loss": round(self.last.get("loss", 0.0), 4)}
