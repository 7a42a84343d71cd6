"""The train stage: one Trainer over accelerate (+ DeepSpeed), resumable from its last checkpoint.

accelerate / DeepSpeed wiring lives only here; heads, losses and the TTT unroll are single-device code.
A checkpoint (`ckpt/step-N/`) holds the head, optimizer, scheduler (accelerate's state), the data
position and history (`trainer_state.json`), every rank's RNG (`rng-rank-R.safetensors`) and sample ids, so a run
killed with SIGKILL and started again with the same command ends with the same weights. `checksums.json` is
written last: a resume passes over a corrupted checkpoint to the one before it. `trainer_state.json` also records
the run's fingerprint (hashes of the features, draft vocabulary and target, and the train and head fields that
change the weights): a checkpoint made for other inputs is refused, never resumed (`restart=true` discards it). The last
`train.keep_last` checkpoints are kept, and the best head so far (by in-loop tau, else held-out
simulated tau) in `ckpt/best/`. With `train.served_vocab_size`, the heads in `ckpt/best/` and
`ckpt/final/` (and the one the in-loop tau scores) are widened to that many draft tokens
(`heads/widen.py`); step checkpoints keep the trained shape, so a resumed run trains the same head. Each
rank writes the sample ids it consumed to `train/samples-rank-R.json`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn
from tqdm import tqdm

from specdistill.capture.run import samples_dir
from specdistill.capture.store import FeatureStore
from specdistill.config import ConfigError, RunConfig
from specdistill.data.vocab import DraftVocab, build_draft_vocab
from specdistill.distributed import rank_and_world
from specdistill.evaluate import metrics
from specdistill.fingerprint import TRAINED_ON, check_same, train_fingerprint
from specdistill.heads import build_head, head_from_state, save_head
from specdistill.heads.copy_init import init_copy_attention, keep_copy_queries_on_slow_pairs
from specdistill.heads.widen import widened
from specdistill.io import (
    CorruptFile,
    atomic_dir,
    atomic_path,
    save_tensors,
    verify_checksums,
    write_checksums,
    write_json,
)
from specdistill.pipeline import redacted
from specdistill.target import Target, TargetRunner, bf16_is_native, computing_in
from specdistill.train.data import PLANS, OnlineSource, StoreSource, collate
from specdistill.train.loss import LOSSES
from specdistill.train.schedule import warmup_cosine
from specdistill.train.teacher import Teacher
from specdistill.train.ttt import TTTBatch, TTTResult, padded_documents, teacher_rows, unroll_ttt

log = logging.getLogger(__name__)
DEEPSPEED_DIR = Path(__file__).resolve().parents[2] / "conf" / "deepspeed"
COPY_INIT_SAMPLES = 40  # training samples the copy heads' token read-out is fitted on (1,000: the same tau, docs/results.md)


class TTTModel(nn.Module):
    """Wraps a head so the TTT unroll runs through `forward` (what DeepSpeed engines expect)."""

    def __init__(self, head: nn.Module, steps: int, step_weight: float, loss: str):
        super().__init__()
        self.head = head
        self.steps, self.step_weight, self.loss_fn = steps, step_weight, LOSSES[loss]

    def forward(self, batch: TTTBatch, teacher) -> TTTResult:
        return unroll_ttt(self.head, batch, teacher, self.steps, self.step_weight, self.loss_fn)


def deepspeed_config(cfg: RunConfig, precision: str) -> dict:
    """conf/deepspeed/<name>.json completed from the train config (accumulation, clipping, precision)."""
    ds = json.loads((DEEPSPEED_DIR / f"{cfg.train.deepspeed}.json").read_text())
    ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=cfg.train.grad_accum,
              gradient_clipping=cfg.train.grad_clip)
    ds["bf16"] = {"enabled": precision == "bf16"}
    return ds


def resolve_precision(precision: str, deepspeed: str | None) -> str:
    """`auto`: bf16 on a GPU, and on a CPU that multiplies bf16 natively (AMX or AVX512-BF16, ~4x its fp32
    rate) unless DeepSpeed runs there; fp32 otherwise."""
    if precision != "auto":
        return precision
    if torch.cuda.is_available():
        return "bf16"
    return "bf16" if deepspeed is None and bf16_is_native("cpu") else "no"


def make_accelerator(cfg: RunConfig):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    if cfg.train.deepspeed and "LOCAL_RANK" not in os.environ:
        raise ConfigError(f"train.deepspeed={cfg.train.deepspeed} needs a multi-process launch, e.g. `accelerate "
                          "launch --multi_gpu --num_processes 2 train.py ...` (--multi_gpu also on a CPU-only "
                          "machine: without it accelerate starts a single process)")
    precision = resolve_precision(cfg.train.mixed_precision, cfg.train.deepspeed)
    plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config(cfg, precision)) if cfg.train.deepspeed else None
    # `cpu=True` would make accelerate drop DeepSpeed for plain DDP: on a CPU-only machine DeepSpeed finds
    # no GPU by itself and runs on the CPU over gloo
    return Accelerator(mixed_precision=precision, gradient_accumulation_steps=cfg.train.grad_accum,
                       deepspeed_plugin=plugin, cpu=not torch.cuda.is_available() and plugin is None)


def save_rng(path: Path) -> None:
    """This rank's torch (CPU and CUDA), numpy and python RNG states, as safetensors (no pickle)."""
    py_version, py_state, _ = random.getstate()
    np_state = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "python": torch.tensor(py_state, dtype=torch.int64),
               "numpy": torch.from_numpy(np_state[1].astype(np.int64)),
               "numpy_pos": torch.tensor([np_state[2]], dtype=torch.int64)}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    save_tensors(path, tensors, metadata={"python_version": str(py_version)})


def load_rng(path: Path) -> None:
    t = load_file(str(path))
    torch.set_rng_state(t["torch"])
    random.setstate((3, tuple(int(x) for x in t["python"]), None))
    np.random.set_state(("MT19937", t["numpy"].numpy().astype(np.uint32), int(t["numpy_pos"][0]), 0, 0.0))
    if "cuda" in t and torch.cuda.is_available():
        torch.cuda.set_rng_state(t["cuda"])


def trainer_state(ckpt: Path) -> dict:
    """A checkpoint's trainer_state.json; a missing or garbled one is a CorruptFile naming it."""
    path = ckpt / "trainer_state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CorruptFile(f"{path}: unreadable ({err})") from err


def all_ranks_true(flag: bool) -> bool:
    """True only if `flag` holds on every rank (ranks must skip a step together or hang in the reduce)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
    t = torch.tensor([1 if flag else 0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item())


def load_tau_evaluator(cfg: RunConfig, target: Target):
    """`head -> {"tau": ..., "tau_copy": ...}`: the evaluation stage's tree-verified greedy tau on
    `eval.loop_limit` first turns of the `eval.bench` rows outside the evaluated slice, so the best head is
    never chosen on the prompts it is finally scored on (imported lazily: evaluation pulls in the decoding
    stack)."""
    from specdistill.evaluate.bench import held_out_prompts
    from specdistill.evaluate.run import evaluate_head_tau

    prompts = held_out_prompts(cfg.eval.bench, cfg.eval.limit, cfg.eval.loop_limit)
    if not prompts:
        raise ConfigError(f"train.eval_every={cfg.train.eval_every} needs rows of eval.bench={cfg.eval.bench} "
                          f"outside the {cfg.eval.limit} evaluated ones (eval.limit); the benchmark has none left")
    return lambda head: evaluate_head_tau(head, target, prompts, cfg.eval)


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
    def __init__(self, cfg: RunConfig, target: Target, tau_evaluator=None):
        """`tau_evaluator(head) -> {"tau": ..., "tau_copy": ...}` runs every `train.eval_every` steps (default:
        the evaluation stage's `evaluate_head_tau` on `eval.bench` rows outside the scored slice)."""
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.ckpt_dir = self.run_dir / "ckpt"
        self.accelerator = make_accelerator(cfg)
        self.rank, self.world = rank_and_world()
        self.device = self.accelerator.device
        vocab = DraftVocab.load(self.run_dir / "data" / "vocab.safetensors")
        if cfg.capture.mode == "online":
            self.source = OnlineSource(samples_dir(cfg), computing_in(target, cfg.capture.target_dtype),
                                       cfg.capture.teacher, cfg.capture.teacher_topk, self.device)
        else:
            store = FeatureStore(self.run_dir / "features")
            store.check_compatible(target.name, list(target.layer_ids), target.hidden_size, cfg.capture.teacher)
            self.source = StoreSource(store)
        self.fingerprint = train_fingerprint(cfg, target)
        if cfg.restart:
            self.discard_checkpoints()
        self.resume_from = self.intact_checkpoint()
        self.plan = PLANS[cfg.train.batching]
        self.packed = cfg.train.batching == "pack"
        torch.manual_seed(cfg.seed)
        self.head = build_head(cfg.head, target, vocab.d2t_N, vocab.t2d_V)
        runner = TargetRunner(target)
        norm = runner.final_norm().float()
        self.target_lm_head = target.model.get_output_embeddings().weight
        self.served_vocab = self.served_vocabulary(vocab)
        self.teacher = Teacher(norm.to(self.device), self.target_lm_head.float().to(self.device),
                               self.head.d2t.to(self.device), self.head.t2d.to(self.device), cfg.train.vocab_chunk)
        self.train_ids, self.holdout_ids = self.split(len(self.source.lengths))
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
            self.tau_evaluator = load_tau_evaluator(cfg, target)
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

    def split(self, n: int) -> tuple[list[int], list[int]]:
        order = list(range(n))
        random.Random(self.cfg.seed).shuffle(order)
        n_hold = int(round(self.cfg.train.holdout_share * n)) if n >= 20 else 0
        return sorted(order[n_hold:]), sorted(order[:n_hold])

    def my_batches(self, epoch: int) -> list[list[list[int]]]:
        """This rank's share of the epoch's plan: every world-th batch, the same count on every rank."""
        plan = self.plan(self.train_lengths, self.cfg.train.batch_tokens, self.cfg.seed, epoch)
        return plan[self.rank::self.world][: len(plan) // self.world or 1]

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
        save_rng(tmp / f"rng-rank-{self.rank}.safetensors")
        write_json(tmp / f"samples-rank-{self.rank}.json", {"micro_batches": self.consumed})
        self.accelerator.wait_for_everyone()
        if self.rank == 0:
            write_json(tmp / "trainer_state.json", {**self.state.__dict__, "history": self.history,
                                                    "fingerprint": self.fingerprint})
            write_checksums(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in self.checkpoints()[: -self.cfg.train.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            log.info("checkpoint %s (keeping the last %d)", final, self.cfg.train.keep_last)
        self.accelerator.wait_for_everyone()

    def discard_checkpoints(self) -> None:
        """restart=true: the run's checkpoints and training records go, whatever they were trained on."""
        if self.rank == 0 and self.ckpt_dir.exists():
            log.warning("restart=true: removing %s and %s", self.ckpt_dir, self.run_dir / "train")
            shutil.rmtree(self.ckpt_dir)
            shutil.rmtree(self.run_dir / "train", ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def intact_checkpoint(self) -> Path | None:
        """The newest step checkpoint whose files match their checksums (a corrupted newer one is passed over
        with a warning naming its bad file) and that was trained on this run's inputs and settings (else
        StaleRun says what changed); when every one is corrupted the error names them all."""
        corrupt = []
        for ckpt in reversed(self.checkpoints()):
            try:
                verify_checksums(ckpt)
                recorded = trainer_state(ckpt).get("fingerprint")
            except CorruptFile as err:
                log.warning("%s; resuming from the checkpoint before it", err)
                corrupt.append(str(err))
                continue
            if recorded is None:
                log.warning("%s records no fingerprint (written by an older version): resuming unchecked", ckpt)
            else:
                check_same(ckpt, recorded, self.fingerprint, self.cfg.name)
            return ckpt
        if corrupt:
            raise CorruptFile(f"every checkpoint in {self.ckpt_dir} is corrupted: {'; '.join(corrupt)}; pass "
                              "restart=true to train from the start")
        return None

    def maybe_resume(self) -> None:
        latest = self.resume_from
        if latest is None:
            return
        saved = trainer_state(latest)
        saved.pop("fingerprint", None)
        consumed = latest / f"samples-rank-{self.rank}.json"
        if consumed.exists():  # the sample ids trained on before the resume (older checkpoints lack them)
            self.consumed = json.loads(consumed.read_text())["micro_batches"]
        if saved.get("world", 1) != self.world:
            raise RuntimeError(f"{latest} was written by {saved.get('world', 1)} ranks, this run has {self.world}; "
                               "resume with the same number of processes (the data order depends on it)")
        try:
            self.accelerator.load_state(str(latest))
            load_rng(latest / f"rng-rank-{self.rank}.safetensors")
        except Exception as err:  # a checkpoint without checksums (older version): accelerate's or safetensors' error
            raise CorruptFile(f"{latest}: cannot be loaded ({type(err).__name__}: {err}); remove it to resume from the "
                              "one before, or pass restart=true") from err
        self.history = saved.pop("history")
        self.state = TrainState(**saved)
        log.info("resumed from %s (step %d, epoch %d, micro-batch %d)", latest, self.state.step, self.state.epoch,
                 self.state.batch_in_epoch)

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
        """Keep `head` (rank 0's served snapshot) in ckpt/best/ when `metric` beats every earlier one (never rotated away)."""
        if not self.improves(metric):
            return
        self.state.best_metric, self.state.best_step = metric, self.state.step
        if self.rank == 0:
            with atomic_dir(self.ckpt_dir / "best") as tmp:
                write_json(tmp / TRAINED_ON, self.fingerprint)
                save_head(head, tmp)
                write_json(tmp / "best.json", {"step": self.state.step, name: metric})
            log.info("new best head (%s %.4f at step %d) in %s", name, metric, self.state.step, self.ckpt_dir / "best")

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

    def fit(self) -> dict:
        cfg = self.cfg
        self.maybe_resume()
        wandb_run = start_wandb(cfg, self.rank)
        bar = tqdm(total=self.total_steps, initial=self.state.step, desc="train", disable=self.rank != 0)
        t0, tokens = time.time(), 0
        while self.state.step < self.total_steps:
            mine = self.my_batches(self.state.epoch)
            while self.state.batch_in_epoch < len(mine) and self.state.step < self.total_steps:
                rows = mine[self.state.batch_in_epoch]
                result = self.train_step(rows)
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
                metrics = self.metrics(result, tokens / max(1e-9, time.time() - t0))
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
        if not self.checkpoints() or self.checkpoints()[-1].name != f"step-{self.state.step:07d}":
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
        head = self.served_snapshot()
        final = self.ckpt_dir / "final"
        write_json(self.run_dir / "train" / f"samples-rank-{self.rank}.json",
                   {"rank": self.rank, "world": self.world, "micro_batches": self.consumed})
        if self.rank == 0:
            with atomic_dir(final) as tmp:
                write_json(tmp / TRAINED_ON, self.fingerprint)
                save_head(head, tmp)
            write_json(self.run_dir / "train" / "history.json", self.history)
            plot_history(self.history, self.run_dir / "train" / "curves.png")
        if wandb_run is not None:
            wandb_run.finish()
        last = self.history[-1] if self.history else {}
        log.info("head written to %s; history and curves in %s", final, self.run_dir / "train")
        return {"head": str(final), "steps": self.state.step, "skipped": self.state.skipped,
                "best": str(self.ckpt_dir / "best") if self.state.best_step is not None else None,
                "best_step": self.state.best_step, "loop_tau": last.get("tau"),
                **{k: v for k, v in last.items() if k.startswith("holdout/")}}


def start_wandb(cfg: RunConfig, rank: int):
    if cfg.wandb.mode == "disabled" or rank != 0:
        return None
    import wandb

    return wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.name, mode=cfg.wandb.mode,
                      dir=str(cfg.run_dir), config=redacted(cfg), reinit="finish_previous")


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


def moving_average(values: list[float], window: int) -> np.ndarray:
    """Mean of each value and the `window - 1` before it (fewer at the start): per-step training metrics
    swing with each batch's mix of documents, so only their trend is readable."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def plot_history(history: list[dict], path: Path) -> None:
    """train/curves.png: loss and per-step accuracy (a moving average over about a fiftieth of the run,
    the raw values faint behind), and the held-out accuracy at each checkpoint."""
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    window = max(1, len(history) // 50)
    depths = range(len([k for k in history[0] if k.startswith("acc/")]))
    fig, (ax_loss, ax_acc, ax_held) = plt.subplots(1, 3, figsize=(16, 4))
    for ax, key, label in [(ax_loss, "loss", "loss")] + [(ax_acc, f"acc/{j}", f"step {j}") for j in depths]:
        raw = [h[key] for h in history]
        line, = ax.plot(steps, moving_average(raw, window), label=label)
        ax.plot(steps, raw, color=line.get_color(), alpha=0.12, linewidth=0.5)
    ax_loss.set(xlabel="step", ylabel="weighted TTT loss", title=f"training loss (mean of {window} steps)")
    ax_acc.set(xlabel="step", ylabel="top-1 agreement with target",
               title=f"accuracy per TTT step (mean of {window} steps)")
    ax_acc.legend(fontsize=7, loc="lower right")
    held = [h for h in history if "holdout/copy_acc0" in h]
    for j in depths:
        line, = ax_held.plot([h["step"] for h in held], [h[f"holdout/acc{j}"] for h in held], label=f"step {j}")
        ax_held.plot([h["step"] for h in held], [h[f"holdout/copy_acc{j}"] for h in held], "--", color=line.get_color())
    ax_held.set(xlabel="step", ylabel="top-1 agreement with target",
                title="held out: all tokens (solid), tokens in the context (dashed)")
    ax_held.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)


def run(cfg: RunConfig, target) -> dict:
    return Trainer(cfg, target.get()).fit()
