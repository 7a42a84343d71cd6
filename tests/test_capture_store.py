"""The offline feature store: round trip, resume after a kill, skip or recapture, corruption, bad input."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import datasets
import pytest
import torch

from specdistill.capture import run as capture_run
from specdistill.capture.shard_writer import ShardWriter
from specdistill.capture.store import FeatureStore, FeatureStoreError, length_batches, shuffled_order
from specdistill.config import CaptureConfig, RandomTargetConfig, RunConfig, TargetConfig
from specdistill.layout import RunLayout
from specdistill.pipeline import LazyTarget

TINY = RandomTargetConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2
)


def make_samples(cfg: RunConfig, lengths: list[int], seed: int = 0, vocab: int = 384) -> list[dict]:
    """Write a prepared-samples dataset where the capture stage looks for it; returns its rows."""
    rng = random.Random(seed)
    rows = [
        {
            "input_ids": [rng.randrange(vocab) for _ in range(n)],
            "loss_mask": [int(rng.random() < 0.6) for _ in range(n)],
        }
        for n in lengths
    ]
    ds = datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in ("input_ids", "loss_mask")})
    ds.save_to_disk(str(RunLayout.of(cfg, "capture").samples_dir))
    return rows


def small_cfg(tmp_path, name: str = "t", **capture) -> RunConfig:
    """A run under a root of its own (`<tmp_path>/<name>`), so runs of different names share no store."""
    capture = {"shard_tokens": 60, "batch_tokens": 64, **capture}
    target = TargetConfig(name="random", random=dataclasses.replace(TINY))
    return RunConfig(name=name, run_root=str(Path(tmp_path) / name), target=target, capture=CaptureConfig(**capture))


LENGTHS = [7, 23, 12, 31, 5, 18, 9, 26, 14, 11, 3, 20]


@pytest.fixture(scope="module")
def target():
    lazy = LazyTarget(small_cfg("unused").target)
    lazy.get()
    return lazy


def test_store_round_trip(tmp_path, target):
    cfg = small_cfg(tmp_path)
    rows = make_samples(cfg, LENGTHS)
    result = capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)
    store = FeatureStore(result["features"])
    assert len(store.shards) > 2 and result["tokens"] == sum(LENGTHS) and not result["skipped"]
    assert sorted(store.source_indices) == list(range(len(LENGTHS)))
    m = store.manifest
    assert (m["layer_ids"], m["hidden_size"], m["dtype"], m["teacher"]) == ([1, 3, 4], 32, "bfloat16", "last")
    store.verify()
    for i, src in enumerate(store.source_indices):
        s = store.sample(i)
        assert (
            s["input_ids"].tolist() == rows[src]["input_ids"]
            and s["loss_mask"].tolist() == rows[src]["loss_mask"]
        )
        assert s["aux"].shape == (LENGTHS[src], 3 * 32) and s["last"].shape == (LENGTHS[src], 32)
        assert s["aux"].dtype == torch.bfloat16 and store.lengths[i] == LENGTHS[src]
    order = shuffled_order(store, seed=3)
    streamed = dict(store.iter_samples(order))
    assert list(streamed) == order
    for i in order:
        for key, t in store.sample(i).items():
            assert torch.equal(streamed[i][key], t), key


def test_resume_after_kill_mid_shard(tmp_path, target, monkeypatch):
    ref_cfg = small_cfg(tmp_path / "ref")
    make_samples(ref_cfg, LENGTHS)
    ref_store = FeatureStore(capture_run.run(ref_cfg, RunLayout.of(ref_cfg, "capture"), target)["features"])
    cfg = small_cfg(tmp_path / "run")
    make_samples(cfg, LENGTHS)
    out = RunLayout.of(cfg, "capture").features_dir
    kill_after = ref_store.shards[0]["samples"] + ref_store.shards[1]["samples"] + 1  # inside shard 2
    real_add, calls = ShardWriter.add, []

    def add_then_die(self, sample):
        if len(calls) == kill_after:
            raise KeyboardInterrupt("killed mid-shard")
        calls.append(1)
        real_add(self, sample)

    monkeypatch.setattr(ShardWriter, "add", add_then_die)
    with pytest.raises(KeyboardInterrupt):
        capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)
    monkeypatch.setattr(ShardWriter, "add", real_add)
    assert not (out / "manifest.json").exists()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.safetensors")}
    assert sorted(kept) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    # what a kill during the write of shard 2 or before its record leaves behind
    (out / "shard-00002.safetensors").write_bytes(b"partial")
    (out / ".shard-00003.safetensors.abc.tmp").write_bytes(b"partial")
    # a recorded shard damaged since (same size): must be captured again, not re-used
    damaged = bytearray((out / "shard-00001.safetensors").read_bytes())
    damaged[-5] ^= 0xFF
    (out / "shard-00001.safetensors").write_bytes(bytes(damaged))
    kept["shard-00001.safetensors"] = (out / "shard-00001.safetensors").stat().st_mtime_ns

    result = capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)
    store = FeatureStore(result["features"])
    store.verify()
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == kept["shard-00000.safetensors"]  # kept
    assert (out / "shard-00001.safetensors").stat().st_mtime_ns != kept["shard-00001.safetensors"]  # redone
    assert not list(out.glob(".*.tmp"))
    assert [s["sha256"] for s in store.shards] == [s["sha256"] for s in ref_store.shards]


def test_skip_when_same_recapture_when_changed(tmp_path, target):
    cfg = small_cfg(tmp_path)
    make_samples(cfg, LENGTHS)
    assert not capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)["skipped"]
    assert capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)["skipped"]
    cfg.capture.dtype = "float32"
    assert not capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)["skipped"]
    assert FeatureStore(RunLayout.of(cfg, "capture").features_dir).manifest["dtype"] == "float32"
    make_samples(cfg, LENGTHS, seed=1)  # same lengths, other tokens: must not be re-used
    assert not capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)["skipped"]
    retrained = small_cfg(tmp_path)  # same name and shapes, other weights
    retrained.target.random.seed = 1
    assert not capture_run.run(retrained, RunLayout.of(retrained, "capture"), LazyTarget(retrained.target))["skipped"]
    make_samples(cfg, LENGTHS[:4], seed=1)  # fewer shards: the old ones past the end are removed
    result = capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)
    assert result["samples"] == 4
    assert len(list(RunLayout.of(cfg, "capture").features_dir.glob("shard-*"))) == result["shards"]


def test_target_dtype_captures_in_bf16_and_is_part_of_the_store_key(tmp_path, target):
    """capture.target_dtype=bfloat16 runs a bf16 copy of the target (the fp32 one stays as it is for the
    evaluation's lossless check); its store is not mistaken for the fp32 one, and its features are close."""
    cfg = small_cfg(tmp_path)
    make_samples(cfg, LENGTHS)
    capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)
    fp32 = FeatureStore(RunLayout.of(cfg, "capture").features_dir)
    fp32_aux = [fp32.sample(i)["aux"].float() for i in range(len(fp32))]
    cfg.capture.target_dtype = "bfloat16"
    assert not capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)["skipped"]
    bf16 = FeatureStore(RunLayout.of(cfg, "capture").features_dir)
    assert bf16.manifest["target_dtype"] == "bfloat16"
    assert next(target.get().model.parameters()).dtype == torch.float32
    for i, ref in enumerate(fp32_aux):
        got = bf16.sample(i)["aux"].float()
        assert not torch.equal(got, ref)  # computed in bf16, not only stored in it
        torch.testing.assert_close(got, ref, rtol=0.1, atol=0.1)
    assert capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)["skipped"]


def test_corrupted_and_truncated_shards_are_named(tmp_path, target):
    cfg = small_cfg(tmp_path)
    make_samples(cfg, LENGTHS)
    out = RunLayout.of(cfg, "capture").features_dir
    capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)
    shard = out / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    store = FeatureStore(out)  # same size: only the hash tells
    with pytest.raises(FeatureStoreError, match="shard-00001.safetensors: sha256"):
        store.verify()
    shard.write_bytes(bytes(data[:-50]))
    with pytest.raises(FeatureStoreError, match="shard-00001.safetensors: .* bytes"):
        FeatureStore(out)
    (out / "manifest.json").unlink()
    with pytest.raises(FeatureStoreError, match="no manifest.json"):
        FeatureStore(out)


def test_incompatible_store_is_refused(tmp_path, target):
    cfg = small_cfg(tmp_path, teacher="topk", teacher_topk=4)
    make_samples(cfg, LENGTHS)
    store = FeatureStore(capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)["features"])
    ok = dict(target_name="random", layer_ids=[1, 3, 4], hidden_size=32, teacher="topk")
    store.check_compatible(**ok, teacher_topk=4)
    for field, value in [
        ("target_name", "meta-llama/Llama-3.1-8B"),
        ("layer_ids", [2, 3, 4]),
        ("hidden_size", 4096),
        ("teacher", "last"),
    ]:
        with pytest.raises(FeatureStoreError, match=f"{field}: the store has"):
            store.check_compatible(**{**ok, field: value})
    with pytest.raises(FeatureStoreError, match="teacher_topk"):
        store.check_compatible(**ok, teacher_topk=8)


def test_topk_teacher_is_smaller_and_matches_log_softmax(tmp_path, target):
    cfg = small_cfg(tmp_path, teacher="topk", teacher_topk=4, dtype="float32")
    rows = make_samples(cfg, LENGTHS[:3])
    store = FeatureStore(capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)["features"])
    model = target.get().model
    for i, src in enumerate(store.source_indices):
        s = store.sample(i)
        assert set(s) == {"input_ids", "loss_mask", "aux", "topk_logprobs", "topk_ids"}
        with torch.inference_mode():
            logp = model(torch.tensor([rows[src]["input_ids"]])).logits[0].float().log_softmax(-1)
        top = logp.topk(4, dim=-1)
        assert torch.equal(s["topk_ids"], top.indices.to(torch.int32))
        torch.testing.assert_close(s["topk_logprobs"], top.values, rtol=0, atol=1e-5)
    last_cfg = small_cfg(tmp_path, name="last", dtype="float32")
    make_samples(last_cfg, LENGTHS[:3])
    assert (
        store.bytes_per_token()
        < FeatureStore(capture_run.run(last_cfg, RunLayout.of(last_cfg, "capture"), target)["features"]).bytes_per_token()
    )


@pytest.mark.parametrize(
    "rows, match",
    [
        ({"input_ids": [[1, 2], [3, 4, 5], [6]], "loss_mask": [[0, 1], [1, 1, 0], [1]]}, None),
        (
            {"input_ids": [[1, 2], [3, 4, 5], [6]], "loss_mask": [[0, 1], [1, 1, 0], [1, 1]]},
            "row 2: loss_mask has 2",
        ),
        (
            {"input_ids": [[1, 2], [3, 999, 5]], "loss_mask": [[0, 1], [1, 1, 1]]},
            "row 1: input_ids holds token 999",
        ),
        ({"input_ids": [[1, 2], [3, 4]], "loss_mask": [[0, 1], [2, 1]]}, "row 1: loss_mask holds 2"),
        ({"input_ids": [[1, 2], []], "loss_mask": [[0, 1], []]}, "row 1: input_ids is empty"),
        ({"input_ids": [[1, 2]], "labels": [[0, 1]]}, r"missing column\(s\) \['loss_mask'\]"),
        ({"input_ids": [["a"]], "loss_mask": [[1]]}, "column `input_ids` has type list<item: string>"),
    ],
)
def test_bad_samples_are_named(tmp_path, target, rows, match):
    cfg = small_cfg(tmp_path)
    datasets.Dataset.from_dict(rows).save_to_disk(str(RunLayout.of(cfg, "capture").samples_dir))
    if match is None:
        assert capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)["samples"] == 3
        return
    with pytest.raises(capture_run.BadSamples, match=match):
        capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)
    assert not RunLayout.of(cfg, "capture").features_dir.exists()


def test_online_mode_writes_nothing(tmp_path, target):
    cfg = small_cfg(tmp_path, mode="online")
    assert capture_run.run(cfg, RunLayout.of(cfg, "capture"), target) == {"mode": "online", "skipped": True}
    assert not RunLayout.of(cfg, "capture").features_dir.exists()


def test_training_orders(tmp_path, target):
    cfg = small_cfg(tmp_path)
    make_samples(cfg, LENGTHS)
    store = FeatureStore(capture_run.run(cfg, RunLayout.of(cfg, "capture"), target)["features"])
    order = shuffled_order(store, seed=0)
    assert sorted(order) == list(range(len(store)))
    assert order == shuffled_order(store, seed=0) and order != shuffled_order(store, seed=0, epoch=1)
    shard_of = [store.locate(i)[0] for i in order]
    assert len(set(shard_of)) == sum(
        1 for a, b in zip([None, *shard_of], shard_of) if a != b
    )  # one visit each
    batches = length_batches(store, batch_tokens=40, seed=0)
    assert sorted(i for b in batches for i in b) == list(range(len(store)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(store.lengths[i] for i in b) <= 40
