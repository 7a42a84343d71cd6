"""The train stage: one Trainer over accelerate (+ DeepSpeed), resumable from its last checkpoint.

accelerate / DeepSpeed wiring lives only here; heads, losses and the TTT unroll are single-device code.
A checkpoint holds the head, optimizer, scheduler, data position and every rank's RNG, so a run
killed with SIGKILL and started again with the same command ends with the same weights.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from specdistill.capture.store import FeatureStore
from specdistill.config import RunConfig
from specdistill.data.vocab import DraftVocab
from specdistill.heads import build_head, save_head
from specdistill.io import write_json
from specdistill.pipeline import redacted
from specdistill.target import Target, TargetRunner
from specdistill.train.loss import LOSSES
from specdistill.train.schedule import bucketed_batches, warmup_cosine
from specdistill.train.teacher import Teacher
from specdistill.train.ttt import TTTBatch, TTTResult, unroll_ttt

log = logging.getLogger(__name__)
DEEPSPEED_DIR = Path(__file__).resolve().parents[2] / "conf" / "deepspeed"


class TTTModel(nn.Module):
    """Wraps a head so the TTT unroll runs through `forward` (what DeepSpeed engines expect)."""

    def __init__(self, head: nn.Module, steps: int, step_weight: float, loss: str):
        super().__init__()
        self.head = head
        self.steps, self.step_weight, self.loss_fn = steps, step_weight, LOSSES[loss]

    def forward(self, batch: TTTBatch, teacher) -> TTTResult:
        return unroll_ttt(self.head, batch, teacher, self.steps, self.step_weight, self.loss_fn)


def rank_and_world() -> tuple[int, int]:
    """From torch.distributed: accelerate may report `0 of 1` under DeepSpeed on CPU."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def make_accelerator(cfg: RunConfig):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    precision = cfg.train.mixed_precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() else "no"
    plugin = None
    if cfg.train.deepspeed:
        ds = json.loads((DEEPSPEED_DIR / f"{cfg.train.deepspeed}.json").read_text())
        ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=cfg.train.grad_accum,
                  gradient_clipping=cfg.train.grad_clip)
        ds["bf16"] = {"enabled": precision == "bf16"}
        plugin = DeepSpeedPlugin(hf_ds_config=ds)
    return Accelerator(mixed_precision=precision, gradient_accumulation_steps=cfg.train.grad_accum,
                       deepspeed_plugin=plugin, cpu=not torch.cuda.is_available())


def collate(store: FeatureStore, ids: list[int], device) -> TTTBatch:
    """Right-padded batch of stored samples."""
    samples = [store.sample(i) for i in ids]
    T = max(len(s["input_ids"]) for s in samples)
    B = len(samples)
    aux_dim = samples[0]["aux"].shape[-1]
    input_ids = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    aux = torch.zeros(B, T, aux_dim, dtype=torch.float32)
    extra = {}
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        input_ids[b, :n] = s["input_ids"].long()
        loss_mask[b, :n] = s["loss_mask"].long()
        valid[b, :n] = True
        aux[b, :n] = s["aux"].float()
        for key in ("last", "topk_logprobs", "topk_ids"):
            if key in s:
                t = extra.setdefault(key, torch.zeros(B, T, s[key].shape[-1], dtype=torch.float32 if key != "topk_ids" else torch.long))
                t[b, :n] = s[key].to(t.dtype)
    batch = TTTBatch(input_ids.to(device), loss_mask.to(device), valid.to(device), aux.to(device),
                     extra["last"].to(device) if "last" in extra else None)
    return batch, {k: v.to(device) for k, v in extra.items()}


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this rank already consumed in `epoch`
    skipped: int = 0
    bad_in_row: int = 0  # consecutive non-finite steps
    best_metric: float | None = None


class Trainer:
    def __init__(self, cfg: RunConfig, target: Target):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.ckpt_dir = self.run_dir / "ckpt"
        self.accelerator = make_accelerator(cfg)
        self.rank, self.world = rank_and_world()
        self.device = self.accelerator.device
        vocab = DraftVocab.load(self.run_dir / "data" / "vocab.safetensors")
        self.store = FeatureStore(self.run_dir / "features")
        self.store.check_compatible(target.name, list(target.layer_ids), target.hidden_size, cfg.capture.teacher)
        torch.manual_seed(cfg.seed)
        self.head = build_head(cfg.head, target, vocab.d2t_N, vocab.t2d_V)
        runner = TargetRunner(target)
        norm = runner.final_norm().float()
        self.teacher = Teacher(norm.to(self.device), target.model.get_output_embeddings().weight.float().to(self.device),
                               self.head.d2t.to(self.device), self.head.t2d.to(self.device), cfg.train.vocab_chunk)
        self.train_ids, self.holdout_ids = self.split(len(self.store))
        lengths = self.store.lengths
        self.train_lengths = {i: int(lengths[i]) for i in self.train_ids}
        per_epoch = math.ceil(len(bucketed_batches(self.train_lengths, cfg.train.batch_tokens, cfg.seed, 0)) / self.world)
        self.batches_per_epoch = per_epoch
        self.total_steps = cfg.train.max_steps or max(1, int(cfg.train.epochs * per_epoch) // cfg.train.grad_accum)
        params = [p for p in self.head.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, betas=tuple(cfg.train.betas), weight_decay=cfg.train.weight_decay)
        scheduler = warmup_cosine(optimizer, self.total_steps, int(cfg.train.warmup_ratio * self.total_steps))
        model = TTTModel(self.head, cfg.train.ttt_steps, cfg.train.step_weight, cfg.train.loss)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.state = TrainState()
        self.history: list[dict] = []

    def split(self, n: int) -> tuple[list[int], list[int]]:
        order = list(range(n))
        random.Random(self.cfg.seed).shuffle(order)
        n_hold = int(round(self.cfg.train.holdout_share * n)) if n >= 20 else 0
        return sorted(order[n_hold:]), sorted(order[:n_hold])

    # ------------------------------------------------------------ checkpoints

    def checkpoints(self) -> list[Path]:
        return sorted(self.ckpt_dir.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))

    def save_checkpoint(self) -> None:
        final = self.ckpt_dir / f"step-{self.state.step:07d}"
        tmp = self.ckpt_dir / f".tmp-step-{self.state.step:07d}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp))
        self.accelerator.wait_for_everyone()
        if self.rank == 0:
            write_json(tmp / "trainer_state.json", {**self.state.__dict__, "history": self.history})
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in self.checkpoints()[: -self.cfg.train.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            log.info("checkpoint %s", final)
        self.accelerator.wait_for_everyone()

    def maybe_resume(self) -> None:
        ckpts = self.checkpoints()
        if not ckpts:
            return
        latest = ckpts[-1]
        self.accelerator.load_state(str(latest))
        saved = json.loads((latest / "trainer_state.json").read_text())
        self.history = saved.pop("history")
        self.state = TrainState(**saved)
        log.info("resumed from %s (step %d, epoch %d)", latest, self.state.step, self.state.epoch)

    # ------------------------------------------------------------ steps

    def teacher_targets(self, batch: TTTBatch, extra: dict):
        if "topk_ids" in extra:
            return self.teacher.from_topk(extra["topk_logprobs"], extra["topk_ids"])
        return self.teacher.from_last(batch.last_BTH)

    def train_step(self, ids: list[int]) -> TTTResult | None:
        batch, extra = collate(self.store, ids, self.device)
        teacher = self.teacher_targets(batch, extra)
        with self.accelerator.accumulate(self.model):
            result = self.model(batch, teacher)
            if not torch.isfinite(result.loss):
                self.optimizer.zero_grad()
                return None
            self.accelerator.backward(result.loss)
            if self.accelerator.sync_gradients and not self.cfg.train.deepspeed:
                norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
                if not torch.isfinite(norm):
                    self.optimizer.zero_grad()
                    return None
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
        return result

    @torch.no_grad()
    def evaluate_holdout(self) -> dict:
        if not self.holdout_ids:
            return {}
        lengths = {i: int(self.store.lengths[i]) for i in self.holdout_ids}
        acc, count = None, 0
        for ids in bucketed_batches(lengths, self.cfg.train.batch_tokens, 0, 0):
            batch, extra = collate(self.store, ids, self.device)
            r = self.model(batch, self.teacher_targets(batch, extra))
            acc = r.step_acc * r.step_count if acc is None else acc + r.step_acc * r.step_count
            count = count + r.step_count
        step_acc = acc / count.clamp(min=1)
        return {"holdout/acc0": float(step_acc[0]), "holdout/tau_sim": float(1 + torch.cumprod(step_acc, 0).sum())}

    def fit(self) -> dict:
        cfg = self.cfg
        self.maybe_resume()
        wandb_run = start_wandb(cfg, self.rank)
        bar = tqdm(total=self.total_steps, initial=self.state.step, desc="train", disable=self.rank != 0)
        t0, tokens = time.time(), 0
        micro = 0
        while self.state.step < self.total_steps:
            batches = bucketed_batches(self.train_lengths, cfg.train.batch_tokens, cfg.seed, self.state.epoch)
            mine = batches[self.rank::self.world][: self.batches_per_epoch]
            while self.state.batch_in_epoch < len(mine) and self.state.step < self.total_steps:
                ids = mine[self.state.batch_in_epoch]
                result = self.train_step(ids)
                self.state.batch_in_epoch += 1
                micro += 1
                if result is None:
                    self.state.skipped += 1
                    self.check_bad_steps()
                    continue
                tokens += sum(self.train_lengths[i] for i in ids)
                if micro % cfg.train.grad_accum:
                    continue
                self.state.step += 1
                self.state.bad_in_row = 0
                metrics = self.metrics(result, tokens / max(1e-9, time.time() - t0))
                if self.state.step % cfg.train.ckpt_every == 0 or self.state.step == self.total_steps:
                    metrics.update(self.evaluate_holdout())
                self.history.append(metrics)
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics['acc/0']:.2f}", tau_sim=f"{metrics['tau_sim']:.2f}")
                if wandb_run is not None:
                    wandb_run.log(metrics, step=self.state.step)
                if self.state.step % cfg.train.ckpt_every == 0:
                    self.save_checkpoint()
            if self.state.batch_in_epoch >= len(mine):
                self.state.epoch += 1
                self.state.batch_in_epoch = 0
        bar.close()
        self.save_checkpoint()
        return self.finish(wandb_run)

    def check_bad_steps(self) -> None:
        self.state.bad_in_row += 1
        log.warning("non-finite loss or gradients: step skipped (%d in a row, %d in all)", self.state.bad_in_row, self.state.skipped)
        if self.state.bad_in_row >= self.cfg.train.max_bad_steps:
            raise RuntimeError(f"{self.state.bad_in_row} non-finite steps in a row (train.max_bad_steps="
                               f"{self.cfg.train.max_bad_steps}); lower train.lr or check the features")

    def metrics(self, r: TTTResult, tokens_per_s: float) -> dict:
        m = {"step": self.state.step, "loss": float(r.loss.detach()), "lr": self.scheduler.get_last_lr()[0],
             "tokens_per_s": tokens_per_s, "tau_sim": r.simulated_tau()}
        for j in range(len(r.step_acc)):
            m[f"acc/{j}"] = float(r.step_acc[j])
            m[f"accept/{j}"] = float(r.step_accept[j])
            m[f"loss/{j}"] = float(r.step_loss[j])
        return m

    def finish(self, wandb_run) -> dict:
        head = self.accelerator.unwrap_model(self.model).head
        final = self.ckpt_dir / "final"
        if self.rank == 0:
            save_head(head, final)
            write_json(self.run_dir / "train" / "history.json", self.history)
            plot_history(self.history, self.run_dir / "train" / "curves.png")
        if wandb_run is not None:
            wandb_run.finish()
        last = self.history[-1] if self.history else {}
        log.info("head written to %s", final)
        return {"head": str(final), "steps": self.state.step, "skipped": self.state.skipped,
                "acc0": last.get("acc/0"), "tau_sim": last.get("tau_sim"), **{k: v for k, v in last.items() if k.startswith("holdout/")}}


def start_wandb(cfg: RunConfig, rank: int):
    if cfg.wandb.mode == "disabled" or rank != 0:
        return None
    import wandb

    return wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.name, mode=cfg.wandb.mode,
                      dir=str(cfg.run_dir), config=redacted(cfg), reinit="finish_previous")


def plot_history(history: list[dict], path: Path) -> None:
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [h["loss"] for h in history])
    ax_loss.set(xlabel="step", ylabel="weighted TTT loss", title="training loss")
    for j in range(len([k for k in history[0] if k.startswith("acc/")])):
        ax_acc.plot(steps, [h[f"acc/{j}"] for h in history], label=f"step {j}")
    ax_acc.set(xlabel="step", ylabel="top-1 agreement with target", title="accuracy per TTT step")
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: RunConfig, target) -> dict:
    return Trainer(cfg, target.get()).fit()
