"""Capture cost against a plain forward, and store size against the anchors' 8·H-byte layout (4 bf16 states).

Capture time is the whole offline stage (data scan, forwards with hooks, bf16 cast, shard writes,
hashing, manifest); the baseline is the HF causal-LM forward (logits included) over the same padded
batches, tensors prepared in advance. Goals: capture/forward >= 0.95; top-k teacher bytes <= 0.8x.
The same capture with a bf16 copy of the fp32 target (`capture.target_dtype=bfloat16`) is timed against
the fp32 capture: its speed-up where the device multiplies bf16 natively.

    python benchmarks/capture.py                # the tiny random target
    python benchmarks/capture.py --embedded     # SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time
from pathlib import Path

import datasets
import torch

from specdistill.capture import run as capture_run
from specdistill.capture.store import FeatureStore, padded_batches, plan_shards
from specdistill.config import CaptureConfig, RunConfig, TargetConfig
from specdistill.layout import RunLayout
from specdistill.pipeline import LazyTarget


def synthetic_samples(
    cfg: RunConfig, vocab: int, num: int, min_len: int, max_len: int, seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    ids = [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[1] * len(x) for x in ids]}).save_to_disk(
        str(RunLayout.of(cfg, "capture").samples_dir), num_proc=1
    )
    return ids


def time_plain_forward(model, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        for input_ids_BT, attention_mask_BT in batches:
            model(input_ids=input_ids_BT, attention_mask=attention_mask_BT)
    return time.perf_counter() - t0


def time_capture(cfg: RunConfig, lazy: LazyTarget, out: Path) -> tuple[float, FeatureStore]:
    cfg.out = str(out)
    t0 = time.perf_counter()
    capture_run.run(cfg, RunLayout.of(cfg, "capture"), lazy)
    return time.perf_counter() - t0, FeatureStore(out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--embedded", action="store_true", help="the embedded SmolLM2-135M target (default: random)"
    )
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--topk", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many timings each")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        target_cfg = TargetConfig() if args.embedded else TargetConfig(name="random")
        cfg = RunConfig(
            name="bench",
            run_root=tmp,
            target=target_cfg,
            capture=CaptureConfig(batch_tokens=args.batch_tokens, shard_tokens=8 * args.batch_tokens),
        )
        lazy = LazyTarget(cfg.target)
        target = lazy.get()
        ids = synthetic_samples(cfg, target.vocab_size, args.samples, args.min_len, args.max_len, seed=0)
        lengths = [len(x) for x in ids]
        pad_id = target.tokenizer.pad_token_id or 0
        batches = [
            capture_run.right_padded([ids[i] for i in batch], pad_id)
            for members in plan_shards(lengths, cfg.capture.shard_tokens)
            for batch in padded_batches(members, lengths, cfg.capture.batch_tokens)
        ]
        time_plain_forward(target.model, batches[:1])  # warm-up

        plain, last, topk, last_bf16 = [], [], [], []
        for r in range(args.repeats):
            plain.append(time_plain_forward(target.model, batches))
            cfg.capture.teacher = "last"
            seconds, last_store = time_capture(cfg, lazy, Path(tmp) / f"last-{r}")
            last.append(seconds)
            cfg.capture.teacher, cfg.capture.teacher_topk = "topk", args.topk
            seconds, topk_store = time_capture(cfg, lazy, Path(tmp) / f"topk-{r}")
            topk.append(seconds)
            cfg.capture.teacher, cfg.capture.target_dtype = "last", "bfloat16"
            seconds, _ = time_capture(cfg, lazy, Path(tmp) / f"bf16-{r}")
            last_bf16.append(seconds)
            cfg.capture.target_dtype = "float32"

    tokens = sum(lengths)
    anchor_bytes = 8 * target.hidden_size
    forward_tps, last_tps, topk_tps, bf16_tps = (tokens / min(t) for t in (plain, last, topk, last_bf16))
    print(f"target {target.name}: H={target.hidden_size}, {len(batches)} batches, {tokens} tokens")
    print(f"plain forward     {forward_tps:10.0f} tok/s")
    print(f"capture (last)    {last_tps:10.0f} tok/s   {last_store.bytes_per_token():8.1f} B/token")
    print(
        f"capture (top-{args.topk:<3d}) {topk_tps:10.0f} tok/s   {topk_store.bytes_per_token():8.1f} B/token"
    )
    print(f"capture (bf16)    {bf16_tps:10.0f} tok/s   (the last-state capture, a bf16 copy of the target)")
    print(f"anchor layout     8*H = {anchor_bytes} B/token")
    print(
        f"RESULT capture_over_forward={last_tps / forward_tps:.3f} "
        f"topk_capture_over_forward={topk_tps / forward_tps:.3f} "
        f"bytes_ratio_last={last_store.bytes_per_token() / anchor_bytes:.3f} "
        f"bytes_ratio_topk={topk_store.bytes_per_token() / anchor_bytes:.3f} "
        f"bf16_target_capture_over_fp32={bf16_tps / last_tps:.3f}"
    )


if __name__ == "__main__":
    main()
