"""The train stage: one Trainer over accelerate (+ DeepSpeed), resumable from its last checkpoint.

The loop reads top to bottom in `fit`: a micro-batch (`train_step`), an optimizer step every `train.grad_accum`
of them, metrics, the periodic evaluations (held-out accuracy at checkpoints, the real in-loop tau every
`train.eval_every` steps, keeping the best head in `ckpt/best/`), and a checkpoint every `train.ckpt_every`
steps (`checkpoint.py`: saving, verifying, resuming). With `train.served_vocab_size`, the heads in `best/` and
`final/` (and the one the in-loop tau scores) are widened to that many draft tokens (`heads/widen.py`); step
checkpoints keep the trained shape, so a resumed run trains the same head. Each rank writes the sample ids it
consumed to `train/samples-rank-R.json`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from specdistill.capture.store import FeatureStore
from specdistill.config import ConfigError, EvalConfig, RunConfig, WandbConfig
from specdistill.data.vocab import DraftVocab, build_draft_vocab
from specdistill.distributed import rank_and_world
from specdistill.evaluate import metrics
from specdistill.fingerprint import train_fingerprint
from specdistill.heads.build import build_head
from specdistill.heads.checkpoint import head_from_state
from specdistill.heads.copy_init import init_copy_attention, keep_copy_queries_on_slow_pairs
from specdistill.heads.widen import widened
from specdistill.io import write_json
from specdistill.layout import RunLayout
from specdistill.redact import redacted
from specdistill.target import Target, computing_in
from specdistill.target_runner import TargetRunner
from specdistill.train.accelerator import all_ranks_true, make_accelerator
from specdistill.train.block import unroll_block
from specdistill.train.checkpoint import CheckpointManager
from specdistill.train.curves import plot_history
from specdistill.train.data import PLANS, OnlineSource, StoreSource, collate, holdout_split
from specdistill.train.loss import LOSSES
from specdistill.train.schedule import warmup_cosine
from specdistill.train.teacher import Teacher
from specdistill.train.ttt import TTTBatch, TTTResult, padded_documents, teacher_rows, unroll_ttt

log = logging.getLogger(__name__)
COPY_INIT_SAMPLES = 40  # training samples the copy heads' token read-out is fitted on: a few thousand tokens fit it


class TTTModel(nn.Module):
    """Wraps a head so its objective (the TTT unroll; a DFlash head's block denoising) runs through `forward` (what
    DeepSpeed engines expect)."""

    def __init__(self, head: nn.Module, steps: int, step_weight: float, loss: str):
        super().__init__()
        self.head = head
        self.steps, self.step_weight, self.loss_fn = steps, step_weight, LOSSES[loss]

    def forward(self, batch: TTTBatch, teacher) -> TTTResult:
        objective = unroll_block if self.head.config.kind == "dflash" else unroll_ttt
        return objective(self.head, batch, teacher, self.steps, self.step_weight, self.loss_fn)


def load_tau_evaluator(ev: EvalConfig, eval_every: int, target: Target):
    """`head -> {"tau": ..., "tau_copy": ...}`: the evaluation stage's tree-verified greedy tau on
    `eval.loop_limit` first turns of the `eval.bench` rows outside the evaluated slice, so the best head is
    never chosen on the prompts it is finally scored on (imported lazily: evaluation pulls in the decoding
    stack)."""
    from specdistill.evaluate.bench import held_out_prompts
    from specdistill.evaluate.run import evaluate_head_tau

    prompts = held_out_prompts(ev.bench, ev.limit, ev.loop_limit)
    if not prompts:
        raise ConfigError(f"train.eval_every={eval_every} needs rows of eval.bench={ev.bench} "
                          f"outside the {ev.limit} evaluated ones (eval.limit); the benchmark has none left")
    return lambda head: evaluate_head_tau(head, target, prompts, ev)


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this rank already consumed in `epoch`
    micro: int = 0  # micro-batches consumed in all (gradient accumulation counts them)
    skipped: int = 0
    bad_in_row: int = 0  # consecutive non-finite steps
    best_metric: float | None = None  # tau (or held-out simulated tau) of the head in ckpt/best
    best_step: int | None = None
    world: int = 1


class Trainer:
    def __init__(self, cfg: RunConfig, layout: RunLayout, target: Target, tau_evaluator=None):
        """`tau_evaluator(head) -> {"tau": ..., "tau_copy": ...}` runs every `train.eval_every` steps (default:
        the evaluation stage's `evaluate_head_tau` on `eval.bench` rows outside the scored slice)."""
        self.cfg, self.layout = cfg, layout
        self.accelerator = make_accelerator(cfg.train)
        self.rank, self.world = rank_and_world()
        self.device = self.accelerator.device
        vocab = DraftVocab.load(layout.vocab_file)
        if cfg.capture.mode == "online":
            self.source = OnlineSource(layout.samples_dir, computing_in(target, cfg.capture.target_dtype),
                                       cfg.capture.teacher, cfg.capture.teacher_topk, self.device)
        else:
            store = FeatureStore(layout.features_dir)
            store.check_compatible(target.name, list(target.layer_ids), target.hidden_size, cfg.capture.teacher)
            self.source = StoreSource(store)
        self.fingerprint = train_fingerprint(cfg.train, cfg.head, cfg.capture, cfg.seed, layout, target)
        self.checkpoints = CheckpointManager(layout, self.accelerator, self.rank, self.world, self.fingerprint,
                                             cfg.name, cfg.train.keep_last)
        if cfg.restart:
            self.checkpoints.discard()
        self.resume_from = self.checkpoints.latest_intact()
        self.plan = PLANS[cfg.train.batching]
        self.packed = cfg.train.batching == "pack"
        torch.manual_seed(cfg.seed)
        self.head = build_head(cfg.head, target, vocab.d2t_N, vocab.t2d_V, cfg.train.ttt_steps + 1)
        runner = TargetRunner(target)
        norm = runner.final_norm().float()
        self.target_lm_head = target.model.get_output_embeddings().weight
        self.served_vocab = self.served_vocabulary(vocab)
        self.teacher = Teacher(norm.to(self.device), self.target_lm_head.float().to(self.device),
                               self.head.d2t.to(self.device), self.head.t2d.to(self.device), cfg.train.vocab_chunk)
        self.train_ids, self.holdout_ids = holdout_split(len(self.source.lengths), cfg.train.holdout_share, cfg.seed)
        self.train_lengths = {i: self.source.lengths[i] for i in self.train_ids}
        if cfg.head.copy_init and self.resume_from is None:  # a resumed run loads its weights instead
            one_at_a_time = (s for i in self.train_ids[:COPY_INIT_SAMPLES] for s in self.source.samples([i]))
            fit_r2 = init_copy_attention(self.head, one_at_a_time)
            log.info("copy heads initialised (token identity read from the features with R^2 %.2f)", fit_r2)
        if cfg.head.copy_slow_pairs_only:
            keep_copy_queries_on_slow_pairs(self.head)
        self.batches_per_epoch = max(1, len(self.plan(self.train_lengths, cfg.train.batch_tokens, cfg.seed, 0)) // self.world)
        self.total_steps = cfg.train.max_steps or max(1, int(cfg.train.epochs * self.batches_per_epoch) // cfg.train.grad_accum)
        params = [p for p in self.head.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, betas=tuple(cfg.train.betas), weight_decay=cfg.train.weight_decay)
        scheduler = warmup_cosine(optimizer, self.total_steps, int(cfg.train.warmup_ratio * self.total_steps))
        model = TTTModel(self.head, cfg.train.ttt_steps, cfg.train.step_weight, cfg.train.loss)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.zero3 = cfg.train.deepspeed == "zero3"
        self.tau_evaluator = tau_evaluator
        if cfg.train.eval_every > 0 and tau_evaluator is None:
            self.tau_evaluator = load_tau_evaluator(cfg.eval, cfg.train.eval_every, target)
        self.state = TrainState(world=self.world)
        self.history: list[dict] = []
        self.consumed: list[dict] = []  # epoch and sample ids of each micro-batch this process trained on
        log.info("training on %d samples (%d held out), %s batching, %d micro-batches per epoch per rank, "
                 "%d optimizer steps; rank %d of %d; features %s", len(self.train_ids), len(self.holdout_ids),
                 cfg.train.batching, self.batches_per_epoch, self.total_steps, self.rank, self.world,
                 "computed online by the target" if cfg.capture.mode == "online" else "from the feature store")

    def served_vocabulary(self, vocab: DraftVocab) -> DraftVocab | None:
        """The `train.served_vocab_size` most frequent tokens (the trained ones first), or None: serve as trained
        (a head over the full vocabulary, a target's own MTP module, is served as trained)."""
        size, limit = self.cfg.train.served_vocab_size, vocab.t2d_V.numel()
        if size is None or size == vocab.size or self.head.config.draft_vocab_size == limit:
            return None
        if size > limit:
            raise ConfigError(f"config field `train.served_vocab_size`: got {size}, the target has only {limit} tokens")
        return build_draft_vocab(vocab.counts_V, size)

    def my_batches(self, epoch: int) -> list[list[list[int]]]:
        """This rank's share of the epoch's plan: every world-th batch, the same count on every rank."""
        plan = self.plan(self.train_lengths, self.cfg.train.batch_tokens, self.cfg.seed, epoch)
        return plan[self.rank::self.world][: len(plan) // self.world or 1]

    # ------------------------------------------------------------ checkpoints

    def maybe_resume(self) -> None:
        if self.resume_from is None:
            return
        saved, self.history, self.consumed = self.checkpoints.restore(self.resume_from)
        self.state = TrainState(**saved)
        log.info("resumed from %s (step %d, epoch %d, micro-batch %d)", self.resume_from, self.state.step,
                 self.state.epoch, self.state.batch_in_epoch)

    def save_checkpoint(self) -> None:
        self.checkpoints.save(self.state.step, self.state.__dict__, self.history, self.consumed)

    def head_snapshot(self, on_every_rank: bool = False):
        """The head with all its weights, on rank 0 (None elsewhere) or on every rank; every rank must call it.
        Under ZeRO-3 each rank holds only a shard of every weight, so they are gathered into a standalone copy."""
        head = self.accelerator.unwrap_model(self.model).head
        if not self.zero3:
            return head if self.rank == 0 or on_every_rank else None
        if on_every_rank:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(head.parameters()), modifier_rank=None):
                state = {k: v.detach().clone() for k, v in head.state_dict().items()}
        else:
            state = self.accelerator.get_state_dict(self.model)  # gathered onto rank 0
            if self.rank != 0:
                return None
            state = {k.removeprefix("head."): v for k, v in state.items()}
        return head_from_state(head.config, state, "the gathered ZeRO-3 weights").to(self.device)

    def served_snapshot(self, on_every_rank: bool = False):
        """`head_snapshot`, widened to the served draft vocabulary when one is set."""
        head = self.head_snapshot(on_every_rank)
        if head is None or self.served_vocab is None:
            return head
        wide, fit_cos = widened(head, self.target_lm_head, self.served_vocab)
        log.info("head widened from %d to %d draft tokens (shared drift map fits the trained rows with cosine %.3f)",
                 head.config.draft_vocab_size, self.served_vocab.size, fit_cos)
        return wide

    def improves(self, metric: float) -> bool:
        return self.state.best_metric is None or metric > self.state.best_metric

    def save_best(self, metric: float, name: str, head) -> None:
        """Keep `head` (rank 0's served snapshot) in best/ when `metric` beats every earlier one (never rotated away)."""
        if not self.improves(metric):
            return
        self.state.best_metric, self.state.best_step = metric, self.state.step
        self.checkpoints.save_head(self.layout.best_dir, head, {"step": self.state.step, name: metric})
        if self.rank == 0:
            log.info("new best head (%s %.4f at step %d) in %s", name, metric, self.state.step, self.layout.best_dir)

    # ------------------------------------------------------------ steps

    def teacher_targets(self, batch: TTTBatch, extra: dict):
        if "topk_ids" in extra:
            return self.teacher.from_topk(extra["topk_logprobs"], extra["topk_ids"])
        return self.teacher.from_last(batch.last_BTH, teacher_rows(batch))

    def load_batch(self, rows: list[list[int]]):
        flat = [i for row in rows for i in row]
        by_id = dict(zip(flat, self.source.samples(flat)))
        batch, extra = collate([[by_id[i] for i in row] for row in rows], self.device, self.packed)
        return batch, self.teacher_targets(batch, extra)

    def train_step(self, rows: list[list[int]]) -> TTTResult | None:
        """One micro-batch; None when the loss or the gradients are not finite (nothing is applied)."""
        batch, teacher = self.load_batch(rows)
        with self.accelerator.accumulate(self.model):
            result = self.model(batch, teacher)
            if not all_ranks_true(bool(torch.isfinite(result.loss))):
                self.optimizer.zero_grad()
                return None
            self.accelerator.backward(result.loss)
            if self.accelerator.sync_gradients:
                if self.cfg.train.deepspeed:
                    # the engine stepped inside backward; its ZeRO optimizer checked the gradient norm first
                    # and skipped the update (on every rank) when it was not finite
                    finite = not self.model.optimizer.overflow
                else:
                    finite = bool(torch.isfinite(self.accelerator.clip_grad_norm_(self.model.parameters(),
                                                                                  self.cfg.train.grad_clip)))
                if not finite:
                    self.optimizer.zero_grad()
                    return None
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
        return result

    @torch.no_grad()
    def evaluate_holdout(self) -> dict:
        """Held-out accuracy per TTT step and the chain tau it implies: over every token, and (`copy_`) over
        the tokens the context holds (`copy_tokens`), where a head falls behind prompt lookup as the steps go on."""
        if not self.holdout_ids:
            return {}
        lengths = {i: self.source.lengths[i] for i in self.holdout_ids}
        totals = {"": [0, 0], "copy_": [0, 0]}  # kind -> [hits per step, positions per step]
        for rows in self.plan(lengths, self.cfg.train.batch_tokens, 0, 0):
            batch, teacher = self.load_batch(rows)
            copies = replace(batch, loss_mask_BT=batch.loss_mask_BT * copy_tokens(batch))
            for kind, kept in (("", batch), ("copy_", copies)):
                r = self.model(kept, teacher)
                totals[kind] = [totals[kind][0] + r.step_acc * r.step_count, totals[kind][1] + r.step_count]
        out = {}
        for kind, (hits, count) in totals.items():
            step_acc = hits / count.clamp(min=1)
            out[f"holdout/{kind}tau_sim"] = float(1 + torch.cumprod(step_acc, 0).sum())
            out.update({f"holdout/{kind}acc{j}": float(a) for j, a in enumerate(step_acc)})
        return out

    def fit(self, recorded_config: dict) -> dict:
        """Train to `train.max_steps` (resuming where a killed run stopped); W&B records `recorded_config`."""
        cfg = self.cfg
        self.maybe_resume()
        wandb_run = start_wandb(cfg.wandb, cfg.name, recorded_config, self.layout.run_dir, self.rank)
        bar = tqdm(total=self.total_steps, initial=self.state.step, desc="train", disable=self.rank != 0)
        t0, tokens, step_s = time.time(), 0, 0.0
        while self.state.step < self.total_steps:
            mine = self.my_batches(self.state.epoch)
            while self.state.batch_in_epoch < len(mine) and self.state.step < self.total_steps:
                rows = mine[self.state.batch_in_epoch]
                started = time.perf_counter()
                result = self.train_step(rows)
                step_s += time.perf_counter() - started
                self.state.batch_in_epoch += 1
                self.state.micro += 1
                self.consumed.append({"epoch": self.state.epoch, "ids": [i for row in rows for i in row]})
                if result is None:
                    self.state.skipped += 1
                    self.check_bad_steps()
                    continue
                tokens += sum(self.train_lengths[i] for row in rows for i in row)
                if self.state.micro % cfg.train.grad_accum:
                    continue
                self.state.step += 1
                self.state.bad_in_row = 0
                metrics = self.metrics(result, tokens / max(1e-9, time.time() - t0)) | {"step_s": step_s}
                step_s = 0.0
                metrics.update(self.periodic_evaluations())
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
        if not self.checkpoints.steps() or self.checkpoints.steps()[-1] != self.layout.step_dir(self.state.step):
            self.save_checkpoint()
        return self.finish(wandb_run)

    def periodic_evaluations(self) -> dict:
        """Held-out metrics at checkpoint steps and the end; real tau every `train.eval_every` steps."""
        cfg, step, out = self.cfg.train, self.state.step, {}
        if step % cfg.ckpt_every == 0 or step == self.total_steps:
            out.update(self.evaluate_holdout())
            if cfg.eval_every == 0 and "holdout/tau_sim" in out and self.improves(out["holdout/tau_sim"]):
                self.save_best(out["holdout/tau_sim"], "holdout/tau_sim", self.served_snapshot())
        if cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == self.total_steps):
            head = self.served_snapshot(on_every_rank=True)  # the ranks share the prompts
            head.eval()
            result = self.tau_evaluator(head)
            head.train()
            out["tau"], out["tau_copy"] = float(result["tau"]), float(result["tau_copy"])
            log.info("step %d: in-loop tau %.3f (copy rounds %.3f)", step, out["tau"], out["tau_copy"])
            self.save_best(out["tau"], "tau", head)
        return out

    def check_bad_steps(self) -> None:
        self.state.bad_in_row += 1
        log.warning("non-finite loss or gradients: step skipped (%d in a row, %d in all)", self.state.bad_in_row, self.state.skipped)
        if self.state.bad_in_row >= self.cfg.train.max_bad_steps:
            raise RuntimeError(f"{self.state.bad_in_row} non-finite steps in a row (train.max_bad_steps="
                               f"{self.cfg.train.max_bad_steps}); lower train.lr or check the features")

    def metrics(self, r: TTTResult, tokens_per_s: float) -> dict:
        m = {"step": self.state.step, "loss": float(r.loss.detach()), "lr": self.scheduler.get_last_lr()[0],
             "tokens_per_s": tokens_per_s, "tau_sim": r.simulated_tau(), "skipped": self.state.skipped}
        for j in range(len(r.step_acc)):
            m[f"acc/{j}"] = float(r.step_acc[j])
            m[f"accept/{j}"] = float(r.step_accept[j])
            m[f"loss/{j}"] = float(r.step_loss[j])
        return m

    def finish(self, wandb_run) -> dict:
        head, layout = self.served_snapshot(), self.layout
        write_json(layout.train_dir / f"samples-rank-{self.rank}.json",
                   {"rank": self.rank, "world": self.world, "micro_batches": self.consumed})
        self.checkpoints.save_head(layout.final_dir, head)
        if self.rank == 0:
            write_json(layout.train_dir / "history.json", self.history)
            plot_history(self.history, layout.train_dir / "curves.png")
        if wandb_run is not None:
            wandb_run.finish()
        last = self.history[-1] if self.history else {}
        log.info("head written to %s; history and curves in %s", layout.final_dir, layout.train_dir)
        return {"head": str(layout.final_dir), "steps": self.state.step, "skipped": self.state.skipped,
                "best": str(layout.best_dir) if self.state.best_step is not None else None,
                "best_step": self.state.best_step, "loop_tau": last.get("tau"),
                **{k: v for k, v in last.items() if k.startswith("holdout/")}}


def start_wandb(wandb_cfg: WandbConfig, name: str, run_config: dict, run_dir: Path, rank: int):
    """The W&B run of run `name` on rank 0, recording `run_config` (the redacted run config); None elsewhere or
    with `wandb.mode=disabled`."""
    if wandb_cfg.mode == "disabled" or rank != 0:
        return None
    import wandb

    return wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity, name=name, mode=wandb_cfg.mode,
                      dir=str(run_dir), config=run_config, reinit="finish_previous")


def copy_tokens(batch: TTTBatch) -> torch.Tensor:
    """[B, T] bool: the tokens that complete a 3-gram already earlier in their own document."""
    doc_BT = batch.doc_BT if batch.doc_BT is not None else padded_documents(batch.valid_BT)
    out = torch.zeros_like(batch.valid_BT)
    for b, (ids, docs) in enumerate(zip(batch.input_ids_BT.tolist(), doc_BT.tolist())):
        for doc in set(docs) - {-1}:
            columns = [t for t, d in enumerate(docs) if d == doc]
            repeats = metrics.repeated_trigrams([ids[t] for t in columns])
            out[b, [t for t, repeated in zip(columns, repeats) if repeated]] = True
    return out


def run(cfg: RunConfig, layout: RunLayout, target) -> dict:
    return Trainer(cfg, layout, target.get()).fit(redacted(cfg))
