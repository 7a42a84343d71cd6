"""Batched local generation with the target: our own decode loop, built for data synthesis throughput.

Why not `model.generate`: it keeps decoding rows that have already stopped until the longest row in
the batch ends, and reallocates the KV cache every step. Here prompts are sorted by length (less
padding), and finished rows leave the batch at once (the KV cache is compacted), so a batch costs
what its live rows need.

Legend: B = rows in the batch, T = tokens, V = vocab.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

log = logging.getLogger(__name__)


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens, without the stop token
    finished: bool  # True when a stop token ended it, False when max_new_tokens did


def sample_next(logits_BV: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """Greedy at temperature 0, else nucleus sampling; returns token ids [B]."""
    if temperature <= 0:
        return logits_BV.argmax(dim=-1)
    probs_BV = torch.softmax(logits_BV.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        outside_BV = sorted_BV.cumsum(dim=-1) - sorted_BV > top_p  # keep the smallest set reaching top_p
        sorted_BV[outside_BV] = 0.0
        probs_BV = torch.zeros_like(probs_BV).scatter_(-1, order_BV, sorted_BV)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


class LocalGenerator:
    """Generates continuations of token-id prompts with a causal LM, in batches."""

    def __init__(self, model, pad_token_id: int, stop_token_ids: list[int], batch_size: int,
                 num_tokens: int | None = None):
        self.model = model
        self.num_tokens = num_tokens  # ids >= this have no token (a padded embedding) and are never emitted
        self.pad_token_id = pad_token_id
        self.stop_token_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.int64)
        self.batch_size = batch_size

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, desc: str = "generate") -> list[Generation]:
        """One Generation per prompt, in the prompts' order."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Generation | None] = [None] * len(prompts)
        generator = torch.Generator().manual_seed(seed)
        with tqdm(total=len(prompts), desc=desc, unit="seq", leave=False) as bar:
            for start in range(0, len(order), self.batch_size):
                batch = order[start: start + self.batch_size]
                outs = self._generate_batch([prompts[i] for i in batch], max_new_tokens, temperature, top_p,
                                            generator)
                for i, out in zip(batch, outs):
                    results[i] = out
                bar.update(len(batch))
        return results

    def _next_logits(self, out) -> torch.Tensor:
        logits_BV = out.logits[:, -1]
        if self.num_tokens is not None and self.num_tokens < logits_BV.shape[-1]:
            logits_BV[:, self.num_tokens:] = float("-inf")
        return logits_BV

    @torch.inference_mode()
    def _generate_batch(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float,
                        generator: torch.Generator) -> list[Generation]:
        width = max(len(p) for p in prompts)
        input_ids_BT = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.int64)
        attention_BT = torch.zeros((len(prompts), width + max_new_tokens), dtype=torch.int64)
        for row, prompt in enumerate(prompts):  # left padding: every row's next token is at column `width`
            input_ids_BT[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.int64)
            attention_BT[row, width - len(prompt): width] = 1
        positions_BT = (attention_BT[:, :width].cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(input_ids=input_ids_BT, attention_mask=attention_BT[:, :width], position_ids=positions_BT,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits_BV = self._next_logits(out)
        next_pos_B = positions_BT[:, -1] + 1
        alive = list(range(len(prompts)))  # original row of each live batch row
        generated: list[list[int]] = [[] for _ in prompts]
        finished = [False] * len(prompts)
        for step in range(max_new_tokens):
            tokens_B = sample_next(logits_BV, temperature, top_p, generator)
            stopped_B = torch.isin(tokens_B, self.stop_token_ids)
            for b, row in enumerate(alive):
                if stopped_B[b]:
                    finished[row] = True
                else:
                    generated[row].append(int(tokens_B[b]))
            if step == max_new_tokens - 1:
                break
            if stopped_B.any():
                keep_B = (~stopped_B).nonzero().squeeze(-1)
                if keep_B.numel() == 0:
                    break
                alive = [alive[int(b)] for b in keep_B]
                cache.batch_select_indices(keep_B)
                tokens_B, next_pos_B, attention_BT = tokens_B[keep_B], next_pos_B[keep_B], attention_BT[keep_B]
            attention_BT[:, width + step] = 1
            out = self.model(input_ids=tokens_B[:, None], attention_mask=attention_BT[:, : width + step + 1],
                             position_ids=next_pos_B[:, None], past_key_values=cache, use_cache=True)
            logits_BV = self._next_logits(out)
            next_pos_B = next_pos_B + 1
        return [Generation(token_ids=g, finished=f) for g, f in zip(generated, finished)]
