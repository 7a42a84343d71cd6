"""Batched local generation with the target: our own decode loop with continuous batching.

Why not `model.generate`: a batch there decodes until its longest row ends, so rows that stopped early
keep costing a slot. A decode step on CPU costs about the same for 20 rows as for 32 (reading the
weights dominates), so here a row that stops leaves at once and a waiting prompt takes its slot:
waiting prompts are prefilled as a group, left padded, and joined to the running batch's KV cache.
Columns that became padding for every live row are trimmed, so the cache stays as wide as the
oldest live row needs. Prompts are taken shortest first (less padding). The KV cache grows in place
(buffers with spare columns) instead of being copied at every step.

Legend: B = live rows, W = cache width (columns), V = vocab, K = nucleus candidates.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specdistill.target_runner import require_kv_cache, with_kv_cache

log = logging.getLogger(__name__)

NUCLEUS_CANDIDATES = (256, 4096)  # top-k sizes tried before a full sort
SPARE_COLUMNS = 64  # KV columns allocated ahead
SMALL_MODEL_PARAMS = 20_000_000  # below this a decode step is too small to split across threads


@contextmanager
def threads_for(model):
    """One intra-op thread for tiny models: splitting their microsecond ops costs more than it saves,
    and on a busy CPU the threads' spin-waits cost more still."""
    if sum(p.numel() for p in model.parameters()) >= SMALL_MODEL_PARAMS:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
    if top_p >= 1.0:
        return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
    # The nucleus usually lies within the top few hundred or thousand tokens: a top-k is far cheaper than
    # sorting the vocabulary, and exact for every row whose top-k already holds `top_p` of the mass;
    # only the other rows go on to a larger k, and finally to the whole (sorted) vocabulary.
    vocab = probs_BV.shape[-1]
    tokens_B = torch.empty(probs_BV.shape[0], dtype=torch.int64, device=probs_BV.device)
    rows_R = torch.arange(probs_BV.shape[0], device=probs_BV.device)
    for k in (*NUCLEUS_CANDIDATES, vocab):
        top_RK, ids_RK = probs_BV[rows_R].topk(min(k, vocab), dim=-1)
        done_R = top_RK.sum(dim=-1) >= top_p if k < vocab else torch.ones_like(rows_R, dtype=torch.bool)
        top_RK, ids_RK = top_RK[done_R], ids_RK[done_R]
        top_RK[top_RK.cumsum(dim=-1) - top_RK > top_p] = 0.0  # keep the smallest set reaching top_p
        picked_R = torch.multinomial(top_RK, 1, generator=generator) if len(top_RK) else ids_RK[:, :1]
        tokens_B[rows_R[done_R]] = ids_RK.gather(-1, picked_R).squeeze(-1)
        rows_R = rows_R[~done_R]
        if rows_R.numel() == 0:
            break
    return tokens_B


class _GrowingLayer(DynamicLayer):
    """A KV layer whose keys/values are views into buffers with spare columns: appending a token writes
    in place, where the plain layer copies the whole cache every step (B * W * layers bytes per token)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, add = (self.keys.shape[-2] if self.keys.numel() else 0), key_states.shape[-2]
        buf_k = getattr(self, "_buf_k", None)
        owned = (buf_k is not None and self.keys.numel() and self.keys.data_ptr() == buf_k.data_ptr()
                 and self.keys.shape[:2] == buf_k.shape[:2])
        if not owned or n + add > buf_k.shape[-2]:
            capacity = n + add + max(SPARE_COLUMNS, n // 2)
            self._buf_k = key_states.new_empty((*key_states.shape[:2], capacity, key_states.shape[-1]))
            self._buf_v = value_states.new_empty((*value_states.shape[:2], capacity, value_states.shape[-1]))
            if n:
                self._buf_k[:, :, :n] = self.keys
                self._buf_v[:, :, :n] = self.values
        self._buf_k[:, :, n: n + add] = key_states
        self._buf_v[:, :, n: n + add] = value_states
        self.keys, self.values = self._buf_k[:, :, : n + add], self._buf_v[:, :, : n + add]
        return self.keys, self.values


def _growing_cache() -> DynamicCache:
    cache = DynamicCache()
    cache.layer_class_to_replicate = _GrowingLayer
    return cache


@dataclass
class _Running:
    """The live rows: which prompt each is, its KV cache, attention columns, next position, next logits."""

    rows: list[int]
    cache: DynamicCache
    attention_BW: torch.Tensor
    next_pos_B: torch.Tensor
    logits_BV: torch.Tensor

    def select(self, keep_B: torch.Tensor) -> None:
        self.rows = [self.rows[b] for b in keep_B.tolist()]
        self.cache.batch_select_indices(keep_B)
        self.attention_BW, self.next_pos_B = self.attention_BW[keep_B], self.next_pos_B[keep_B]
        self.logits_BV = self.logits_BV[keep_B]

    def trim_left(self) -> None:
        """Drop leading columns that are padding for every live row."""
        used = self.attention_BW.any(dim=0).nonzero()
        lead = int(used[0]) if used.numel() else 0
        if lead:
            self.attention_BW = self.attention_BW[:, lead:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]

    def join(self, other: _Running) -> None:
        """Append `other`'s rows, left-padding the narrower side so columns line up."""
        width = max(self.attention_BW.shape[1], other.attention_BW.shape[1])

        def pad(t: torch.Tensor, dim_from_end: int) -> torch.Tensor:
            missing = width - t.shape[-dim_from_end]
            return F.pad(t, (0, 0) * (dim_from_end - 1) + (missing, 0)) if missing else t

        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([pad(mine.keys, 2), pad(theirs.keys, 2)])
            mine.values = torch.cat([pad(mine.values, 2), pad(theirs.values, 2)])
        self.attention_BW = torch.cat([pad(self.attention_BW, 1), pad(other.attention_BW, 1)])
        self.next_pos_B = torch.cat([self.next_pos_B, other.next_pos_B])
        self.logits_BV = torch.cat([self.logits_BV, other.logits_BV])
        self.rows += other.rows


class LocalGenerator:
    """Generates continuations of token-id prompts with a causal LM, `batch_size` rows at a time."""

    def __init__(self, model, pad_token_id: int, stop_token_ids: list[int], batch_size: int,
                 num_tokens: int | None = None):
        require_kv_cache(model, "local generation")
        self.model = model
        self.device = next(model.parameters()).device
        self.pad_token_id = pad_token_id
        self.stop_token_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.int64, device=self.device)
        self.batch_size = batch_size
        self.num_tokens = num_tokens  # ids >= this have no token (a padded embedding) and are never emitted
        self.refill_at = max(1, batch_size // 8)  # free slots that trigger a refill (fewer cache copies)

    def _next_logits(self, out) -> torch.Tensor:
        logits_BV = out.logits[:, -1]
        if self.num_tokens is not None and self.num_tokens < logits_BV.shape[-1]:
            logits_BV[:, self.num_tokens:] = float("-inf")
        return logits_BV

    def _prefill(self, rows: list[int], prompts: list[list[int]]) -> _Running:
        width = max(len(prompts[r]) for r in rows)
        input_ids_BW = torch.full((len(rows), width), self.pad_token_id, dtype=torch.int64)
        attention_BW = torch.zeros((len(rows), width), dtype=torch.int64)
        for b, r in enumerate(rows):
            input_ids_BW[b, width - len(prompts[r]):] = torch.tensor(prompts[r], dtype=torch.int64)
            attention_BW[b, width - len(prompts[r]):] = 1
        input_ids_BW, attention_BW = input_ids_BW.to(self.device), attention_BW.to(self.device)
        positions_BW = (attention_BW.cumsum(-1) - 1).clamp(min=0)
        cache = _growing_cache()
        # The last position as an index tensor, not `logits_to_keep=1`: the int form hands lm_head a strided
        # view, and torch's CPU matmul then copies the whole lm_head weight once per row.
        out = self.model(input_ids=input_ids_BW, attention_mask=attention_BW, position_ids=positions_BW,
                         **with_kv_cache(self.model, cache),
                         logits_to_keep=torch.tensor([width - 1], device=self.device))
        return _Running(list(rows), cache, attention_BW, positions_BW[:, -1] + 1, self._next_logits(out))

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, desc: str = "generate") -> list[Generation]:
        """One Generation per prompt, in the prompts' order."""
        waiting = deque(sorted(range(len(prompts)), key=lambda i: len(prompts[i])))
        generated: list[list[int]] = [[] for _ in prompts]
        finished = [False] * len(prompts)
        generator = torch.Generator(self.device).manual_seed(seed)
        running: _Running | None = None
        with threads_for(self.model), tqdm(total=len(prompts), desc=desc, unit="seq", leave=False) as bar:
            while waiting or running is not None:
                live = 0 if running is None else len(running.rows)
                if waiting and (live == 0 or self.batch_size - live >= min(self.refill_at, len(waiting))):
                    take = [waiting.popleft() for _ in range(min(self.batch_size - live, len(waiting)))]
                    fresh = self._prefill(take, prompts)
                    if running is None:
                        running = fresh
                    else:
                        running.join(fresh)
                tokens_B = sample_next(running.logits_BV, temperature, top_p, generator)
                stopped = torch.isin(tokens_B, self.stop_token_ids).tolist()
                done = []
                for row, token, stop in zip(running.rows, tokens_B.tolist(), stopped):
                    if stop:
                        finished[row] = True
                    else:
                        generated[row].append(token)
                    done.append(finished[row] or len(generated[row]) >= max_new_tokens)
                if any(done):
                    bar.update(sum(done))
                    keep_B = torch.tensor([b for b, d in enumerate(done) if not d], dtype=torch.int64,
                                          device=self.device)
                    if keep_B.numel() == 0:
                        running = None
                        continue
                    running.select(keep_B)
                    running.trim_left()
                    tokens_B = tokens_B[keep_B]
                running.attention_BW = F.pad(running.attention_BW, (0, 1), value=1)
                out = self.model(input_ids=tokens_B[:, None], attention_mask=running.attention_BW,
                                 position_ids=running.next_pos_B[:, None],
                                 **with_kv_cache(self.model, running.cache))
                running.logits_BV = self._next_logits(out)
                running.next_pos_B = running.next_pos_B + 1
        return [Generation(token_ids=g, finished=f) for g, f in zip(generated, finished)]
