"""The trainer on the smoke target: kill-and-resume, non-finite steps, online features, best head,
packed batching, and a 2-rank DeepSpeed ZeRO-2 run on CPU."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from specdistill.capture.store import FeatureStore
from specdistill.config import ConfigError, register, to_run_config
from specdistill.data.vocab import DraftVocab, build_draft_vocab
from specdistill.evaluate.bench import load_prompts
from specdistill.heads.build import build_head
from specdistill.heads.checkpoint import load_head
from specdistill.heads.copy_init import copy_query_heads, fast_dims
from specdistill.layout import RunLayout
from specdistill.redact import redacted
from specdistill.target import load_target
from specdistill.train.accelerator import deepspeed_config, make_accelerator
from specdistill.train.curves import moving_average
from specdistill.train.data import OnlineSource, StoreSource
from specdistill.train.trainer import Trainer, copy_tokens, load_tau_evaluator
from specdistill.train.ttt import TTTBatch

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
register()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """Prepared samples and a feature store of the smoke run (the train stage's inputs)."""
    root = tmp_path_factory.mktemp("runs")
    proc = subprocess.run([sys.executable, "train.py", "+exp=smoke", f"run_root={root}", "stages=[prepare,capture]"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "smoke"


def run_dir_from(prepared: Path, root: Path, name: str) -> Path:
    """A new run under `root` whose store holds the smoke run's prepared data and features."""
    shutil.copytree(prepared.parent / "store", root / "store", dirs_exist_ok=True)
    return root / name


def compose_cfg(run_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return to_run_config(compose(config_name="config", overrides=[
            "+exp=smoke", f"run_root={run_dir.parent}", f"name={run_dir.name}", *overrides]))


def assert_copy_queries_kept_off_fast_pairs(head) -> None:
    """The copy heads' query rows outside rotary's slowest pairs are still exactly zero after training,
    while the same rows of the other query heads are not."""
    E = head.config.arch.head_dim
    fast = fast_dims(E)
    rows_NED = head.midlayer.self_attn.q_proj.weight.detach().view(-1, E, head.midlayer.self_attn.q_proj.in_features)
    for q_head in range(len(rows_NED)):
        held = rows_NED[q_head, fast].abs().max() == 0
        assert held == (q_head in copy_query_heads(head)), q_head


RESUME_ARGS = ["stages=[train]", "train.max_steps=12", "train.ckpt_every=3", "train.keep_last=2", "train.grad_accum=2"]


def train_command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "train.py", "+exp=smoke", f"run_root={run_dir.parent}", f"name={run_dir.name}",
            *RESUME_ARGS, *extra]


@pytest.mark.slow  # three training subprocesses: ~1-2 minutes on two busy cores
def test_killed_run_resumes_to_the_same_weights_and_loss_curve(prepared, tmp_path):
    reference = run_dir_from(prepared, tmp_path, "reference")
    killed = run_dir_from(prepared, tmp_path, "killed")
    proc = subprocess.run(train_command(reference), cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]

    victim = subprocess.Popen(train_command(killed), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=ENV)
    deadline = time.time() + 240
    while not (killed / "ckpt" / "step-0000006").exists() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (killed / "ckpt" / "final").exists(), "the run ended before it could be killed"

    proc = subprocess.run(train_command(killed), cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr
    want = load_file(str(reference / "ckpt" / "final" / "head.safetensors"))
    got = load_file(str(killed / "ckpt" / "final" / "head.safetensors"))
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0)
    curve = [json.loads((d / "train" / "history.json").read_text()) for d in (reference, killed)]
    assert [h["step"] for h in curve[0]] == [h["step"] for h in curve[1]] == list(range(1, 13))
    for a, b in zip(*curve):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and a["acc/0"] == b["acc/0"]
    # rotation keeps the last two checkpoints, each with everything a resume needs; the best head stays
    assert [p.name for p in sorted((killed / "ckpt").glob("step-*"))] == ["step-0000009", "step-0000012"]
    last = killed / "ckpt" / "step-0000012"
    assert {"trainer_state.json", "rng-rank-0.safetensors", "optimizer.bin", "scheduler.bin"} <= {
        p.name for p in last.iterdir()}
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["step"] == 12 and state["micro"] == 24 and {"epoch", "batch_in_epoch"} <= state.keys()
    assert (killed / "ckpt" / "best" / "head.safetensors").exists()


def test_non_finite_steps_are_skipped_then_the_run_stops(prepared, tmp_path):
    run_dir = run_dir_from(prepared, tmp_path, "blowup")
    cfg = compose_cfg(run_dir, "train.lr=1e30", "train.warmup_ratio=0", "train.max_bad_steps=3",
                      "train.max_steps=40", "train.grad_clip=1e30")
    trainer = Trainer(cfg, RunLayout.of(cfg), load_target(cfg.target))
    with pytest.raises(RuntimeError, match=r"3 non-finite steps in a row \(train.max_bad_steps=3\)"):
        trainer.fit(redacted(cfg))
    assert trainer.state.skipped == 3 and trainer.state.bad_in_row == 3
    assert 0 < trainer.state.step < 40  # some steps were applied before the loss blew up
    params = [p for p in trainer.head.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    assert trainer.train_step(trainer.my_batches(0)[0]) is None  # a skipped step leaves the weights alone
    assert all(torch.equal(a, p) for a, p in zip(before, params))


def test_online_features_match_the_store_and_train(prepared, tmp_path):
    run_dir = run_dir_from(prepared, tmp_path, "online")
    cfg = compose_cfg(run_dir, "capture=online", "train.max_steps=3", "head.copy_slow_pairs_only=true")
    layout = RunLayout.of(cfg)
    target = load_target(cfg.target)
    stored = StoreSource(FeatureStore(RunLayout.of(compose_cfg(run_dir)).features_dir))
    online = OnlineSource(layout.samples_dir, target, "last", 32, "cpu")
    ids = [0, 5, 7]  # store order differs from the prepared rows': map through the store's source indices
    rows = [stored.store.source_indices[i] for i in ids]
    for a, b in zip(online.samples(rows), stored.samples(ids)):
        assert torch.equal(a["input_ids"].int(), b["input_ids"].int())
        # the store holds bf16 copies of the same tensors
        torch.testing.assert_close(a["aux"].to(torch.bfloat16).float(), b["aux"].float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(a["last"].to(torch.bfloat16).float(), b["last"].float(), atol=1e-2, rtol=1e-2)
    result = Trainer(cfg, RunLayout.of(cfg), target).fit(redacted(cfg))
    assert result["steps"] == 3 and (run_dir / "ckpt" / "final" / "head.safetensors").exists()
    assert_copy_queries_kept_off_fast_pairs(load_head(run_dir / "ckpt" / "final"))
    assert not layout.features_dir.exists()  # online: nothing was stored


def test_a_frozen_lm_head_stays_the_targets_rows_while_the_rest_trains(prepared, tmp_path):
    run_dir = run_dir_from(prepared, tmp_path, "frozen")
    # an Eagle 3.1 head: its per-layer norms before fc (starting at ones, the copy heads fitted through them) train
    cfg = compose_cfg(run_dir, "train.max_steps=3", "head.freeze_lm_head=true", "head.fc_norm=true")
    target = load_target(cfg.target)
    trainer = Trainer(cfg, RunLayout.of(cfg), target)
    head = trainer.head
    draft_ids = head.draft_to_target(torch.arange(head.config.draft_vocab_size))
    target_rows = target.model.get_output_embeddings().weight.detach()[draft_ids].to(head.lm_head.weight.dtype)
    fc_before = head.fc.weight.detach().clone()
    assert torch.equal(head.lm_head.weight, target_rows)
    assert all(torch.equal(norm.weight, torch.ones_like(norm.weight)) for norm in head.fc_norm)
    assert trainer.fit(redacted(cfg))["steps"] == 3
    assert torch.equal(head.lm_head.weight, target_rows)
    assert not torch.equal(head.fc.weight, fc_before)
    assert not any(torch.equal(norm.weight, torch.ones_like(norm.weight)) for norm in head.fc_norm)
    saved = load_head(run_dir / "ckpt" / "final")
    assert saved.config.fc_norm and torch.equal(saved.fc_norm[2].weight, head.fc_norm[2].weight)
    with pytest.raises(ConfigError, match="head.freeze_lm_head"):
        compose_cfg(run_dir, "head.freeze_lm_head=true", "head.init_lm_head_from_target=false")


def test_a_peagle_head_trains_its_mask_hidden_and_keeps_its_mask_token(prepared, tmp_path):
    run_dir = run_dir_from(prepared, tmp_path, "peagle")
    cfg = compose_cfg(run_dir, "train.max_steps=3", "head=peagle")
    target = load_target(cfg.target)
    trainer = Trainer(cfg, RunLayout.of(cfg), target)
    head = trainer.head
    # the random target's tokenizer has no mask token and fewer tokens than embedding rows: the first unused row
    assert head.config.parallel_drafting and head.config.mask_token_id == len(target.tokenizer) < target.vocab_size
    before = head.mask_hidden.detach().clone()
    assert trainer.fit(redacted(cfg))["steps"] == 3
    assert not torch.equal(head.mask_hidden, before)
    saved = load_head(run_dir / "ckpt" / "final")
    assert saved.config.parallel_drafting and saved.config.mask_token_id == head.config.mask_token_id
    assert torch.equal(saved.mask_hidden, head.mask_hidden)  # (the saved head is widened: its vocabulary differs)
    chosen = compose_cfg(run_dir_from(prepared, tmp_path, "peagle5"), "head=peagle", "head.mask_token_id=5")
    assert Trainer(chosen, RunLayout.of(chosen), target).head.config.mask_token_id == 5


def test_a_dflash_head_trains_packed_blocks_of_its_steps(prepared, tmp_path):
    run_dir = run_dir_from(prepared, tmp_path, "dflash")
    cfg = compose_cfg(run_dir, "train.max_steps=2", "head=dflash", "head.num_layers=2", "train.batching=pack")
    target = load_target(cfg.target)
    trainer = Trainer(cfg, RunLayout.of(cfg), target)
    head = trainer.head
    assert head.config.block_size == cfg.train.ttt_steps + 1 and len(head.layers) == 2
    assert head.config.mask_token_id == len(target.tokenizer) < target.vocab_size  # the first unused row
    before = {k: v.detach().clone() for k, v in head.named_parameters()}
    assert trainer.fit(redacted(cfg))["steps"] == 2
    moved = {k for k, v in head.named_parameters() if not torch.equal(v, before[k])}
    assert {"fc.weight", "hidden_norm.weight", "layers.1.self_attn.k_norm.weight"} <= moved
    assert "embed_tokens.weight" not in moved and "lm_head.weight" not in moved  # frozen, the target's
    saved = load_head(run_dir / "ckpt" / "final")
    assert saved.config.kind == "dflash" and saved.config.num_layers == 2
    with pytest.raises(ConfigError, match="head.num_layers"):
        compose_cfg(run_dir, "head.num_layers=2")


def test_in_loop_tau_keeps_the_best_head_and_packing_trains(prepared, tmp_path):
    run_dir = run_dir_from(prepared, tmp_path, "best")
    cfg = compose_cfg(run_dir, "train.batching=pack", "train.eval_every=2", "train.max_steps=6",
                      "train.ckpt_every=100")
    taus = iter([1.5, 2.0, 1.8])
    calls = []

    def tau_of(head):
        calls.append((head.training, head.config.draft_vocab_size))
        return {"tau": next(taus), "tau_copy": 1.0}

    trainer = Trainer(cfg, RunLayout.of(cfg), load_target(cfg.target), tau_evaluator=tau_of)
    plan = trainer.my_batches(0)
    assert all(len(batch) == 1 for batch in plan) and any(len(batch[0]) > 1 for batch in plan)  # packed rows
    trainer.fit(redacted(cfg))
    history = json.loads((run_dir / "train" / "history.json").read_text())
    # the in-loop tau scores what is served: the head widened past its 256 trained draft tokens (smoke: 320)
    assert [h.get("tau") for h in history] == [None, 1.5, None, 2.0, None, 1.8] and calls == [(False, 320)] * 3
    assert json.loads((run_dir / "ckpt" / "best" / "best.json").read_text()) == {"step": 4, "tau": 2.0}
    assert [load_head(run_dir / "ckpt" / d).config.draft_vocab_size for d in ("best", "final")] == [320, 320]
    step_state = load_file(str(run_dir / "ckpt" / "step-0000006" / "model.safetensors"))
    assert step_state["head.lm_head.weight"].shape[0] == 256  # what a resumed run goes on training
    assert {"acc/0", "accept/2", "loss/1", "tau_sim", "holdout/tau_sim", "holdout/acc2", "holdout/copy_tau_sim",
            "holdout/copy_acc2"} <= history[-1].keys()


def test_curves_average_each_step_with_the_window_before_it():
    """The plotted training curves: each point is the mean of its own value and the window - 1 before it,
    fewer at the start, so the curve starts at the first value and lags no further than the window."""
    values = [4.0, 0.0, 2.0, 6.0, 1.0]
    assert moving_average(values, 3).tolist() == [4.0, 2.0, 2.0, 8 / 3, 3.0]
    assert moving_average(values, 1).tolist() == values


def test_copy_tokens_complete_a_3_gram_earlier_in_their_own_document():
    """Held-out copy accuracy counts a token only where its own document already holds the 3-gram: packed
    rows never match across documents, padding never counts."""
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 8, 5, 6, 7], [5, 6, 7, 9, 9, 5, 6, 7, 0, 0]])
    packed = TTTBatch(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool), torch.zeros(2, 10, 4),
                      doc_BT=torch.tensor([[0] * 7 + [1] * 3, [0, 0, 0, 0, 0, 0, 0, 0, -1, -1]]))
    assert copy_tokens(packed).nonzero().tolist() == [[0, 5], [1, 7]]  # not [0, 9]: 5 6 7 is document 0's
    padded = TTTBatch(ids, torch.ones_like(ids), torch.tensor([[True] * 10, [True] * 8 + [False] * 2]),
                      torch.zeros(2, 10, 4))
    assert copy_tokens(padded).nonzero().tolist() == [[0, 5], [0, 9], [1, 7]]


def test_in_loop_tau_never_runs_on_the_prompts_the_head_is_scored_on(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr("specdistill.evaluate.run.evaluate_head_tau",
                        lambda head, target, prompts, cfg: seen.append(prompts) or {"tau": 1.0, "tau_copy": 1.0})
    cfg = compose_cfg(tmp_path / "loop", "train.eval_every=2", "eval.limit=16", "eval.loop_limit=4")
    load_tau_evaluator(cfg.eval, cfg.train.eval_every, target=None)(None)
    scored = {turns[0] for turns in load_prompts("spec_bench", 16)[0]}
    assert len(seen[0]) == 4 and not scored & set(seen[0])
    bench = tmp_path / "three.jsonl"
    bench.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(3)))
    small = compose_cfg(tmp_path / "loop", "train.eval_every=2", f"eval.bench={bench}", "eval.limit=3")
    with pytest.raises(ConfigError, match="outside the 3 evaluated ones"):
        load_tau_evaluator(small.eval, small.train.eval_every, target=None)


def test_a_served_vocabulary_wider_than_the_target_is_a_config_error(prepared, tmp_path):
    cfg = compose_cfg(run_dir_from(prepared, tmp_path, "wide"), "train.served_vocab_size=1000")
    with pytest.raises(ConfigError, match="`train.served_vocab_size`: got 1000, the target has only 384 tokens"):
        Trainer(cfg, RunLayout.of(cfg), load_target(cfg.target))


def test_deepspeed_configs_compose():
    for stage, name in ((2, "zero2"), (3, "zero3")):
        cfg = compose_cfg(Path("/nonexistent/smoke"), f"train.deepspeed={name}", "train.grad_accum=4")
        ds = deepspeed_config(cfg.train, "no")
        assert ds["zero_optimization"]["stage"] == stage
        assert ds["gradient_accumulation_steps"] == 4 and ds["gradient_clipping"] == 0.5
        assert ds["bf16"] == {"enabled": False}


def test_deepspeed_without_a_multi_process_launch_is_a_config_error(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cfg = compose_cfg(Path("/nonexistent/smoke"), "train.deepspeed=zero2")
    with pytest.raises(ConfigError, match="train.deepspeed=zero2 needs a multi-process launch.*--multi_gpu"):
        make_accelerator(cfg.train)


@pytest.mark.slow  # two ranks importing DeepSpeed: ~40 s each
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_two_rank_deepspeed_run_on_cpu_splits_the_data_and_skips_bad_gradients(prepared, tmp_path, stage):
    """Rank 1 alone sees a non-finite gradient: both ranks skip that step. Ranks train on disjoint data,
    and the final head holds every weight (ZeRO-3 shards them across the ranks)."""
    run_dir = run_dir_from(prepared, tmp_path, stage)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", "29533", "tests/deepspeed_bad_gradient.py", str(run_dir),
           f"train.deepspeed={stage}", "train.max_steps=3", "train.grad_accum=2", "head.copy_slow_pairs_only=true"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads((run_dir / f"bad-gradient-rank-{r}.json").read_text()) for r in (0, 1)]
    assert reports == [{"world": 2, "skipped": 1, "steps": 3}] * 2
    ranks = [json.loads((run_dir / "train" / f"samples-rank-{r}.json").read_text()) for r in (0, 1)]
    assert len(ranks[0]["micro_batches"]) == len(ranks[1]["micro_batches"]) == 8  # (3 steps + 1 skipped) x 2
    for epoch in {b["epoch"] for b in ranks[0]["micro_batches"]}:
        seen = [{i for b in r["micro_batches"] if b["epoch"] == epoch for i in b["ids"]} for r in ranks]
        assert seen[0] and seen[1] and not seen[0] & seen[1], epoch
    cfg = compose_cfg(run_dir)
    trained = DraftVocab.load(RunLayout.of(cfg).vocab_file)
    served = build_draft_vocab(trained.counts_V, cfg.train.served_vocab_size)  # what ckpt/final and best hold
    fresh = build_head(cfg.head, load_target(cfg.target), served.d2t_N, served.t2d_V)
    for name in ("final", "best"):
        head = load_head(run_dir / "ckpt" / name)
        for key, value in head.state_dict().items():
            assert value.shape == fresh.state_dict()[key].shape and torch.isfinite(value.float()).all(), (name, key)
        assert_copy_queries_kept_off_fast_pairs(head)
    assert (run_dir / "ckpt" / "step-0000003").is_dir()
