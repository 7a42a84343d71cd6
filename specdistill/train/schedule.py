"""Learning-rate schedule and length-bucketed batching (deterministic per seed and epoch)."""

from __future__ import annotations

import math
import random

from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(optimizer, total_steps: int, warmup_steps: int, min_ratio: float = 0.1) -> LambdaLR:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return LambdaLR(optimizer, factor)


def bucketed_batches(lengths: dict[int, int], batch_tokens: int, seed: int, epoch: int,
                     bucket: int = 64) -> list[list[int]]:
    """Batches of sample ids with (batch size x longest sample) <= batch_tokens, little padding.

    Samples are shuffled, sorted by length inside windows of `bucket` batches' worth, then the batch
    order is shuffled again, so every epoch differs but padding stays small.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    ids = list(lengths)
    rng.shuffle(ids)
    batches: list[list[int]] = []
    window = max(1, bucket * max(1, batch_tokens // max(1, max(lengths.values(), default=1))))
    for start in range(0, len(ids), window):
        chunk = sorted(ids[start:start + window], key=lambda i: lengths[i])
        current: list[int] = []
        for i in chunk:
            longest = max([lengths[j] for j in current] + [lengths[i]])
            if current and longest * (len(current) + 1) > batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
    rng.shuffle(batches)
    return batches
