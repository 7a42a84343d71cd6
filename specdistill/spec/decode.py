"""Speculative generation on a real target: draft a tree with the head, verify it in one target
forward with tree attention, keep the accepted path's KV, repeat (gpt-fast's plain loop, with trees).

Positions: committed tokens x_0..x_{n-1} sit in both KV caches; the root x_n (the last token the
target chose) is not yet in either. The draft cache entry t is the head's step-0 input at position t:
(embedding of x_{t+1}, target features at t). A tree node at depth d sits at position n + d for the
target and n - 1 + d for the head, exactly as in the Training-Time Test.

Shapes: B batch (1 here), S cached, K frontier, N tree nodes, A aux features, D head hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specdistill.heads.layers import cached_attention
from specdistill.spec.kv import compact_kv
from specdistill.spec.tree import Tree, grow_dynamic_tree
from specdistill.spec.verify import verify_greedy
from specdistill.target import TargetRunner


class Drafter:
    """The head plus its KV cache: committed entries and the entries of the tree being drafted."""

    def __init__(self, head, target_vocab: int):
        self.head = head
        self.attn = head.attention()
        self.target_vocab = target_vocab
        self.draft_ids = torch.arange(len(head.d2t), device=head.d2t.device) + head.d2t
        self.k_BKSE = self.v_BKSE = None
        self.root_hidden_BD = None

    def _target_logprobs(self, hidden, depth: int) -> torch.Tensor:
        """Head log-probs over the draft vocab, placed in target-vocab ids (-inf elsewhere)."""
        logp = torch.log_softmax(self.head.logits(hidden, depth).float(), -1)
        out = torch.full((*logp.shape[:-1], self.target_vocab), float("-inf"), device=logp.device)
        out[..., self.draft_ids] = logp
        return out

    @torch.inference_mode()
    def extend(self, aux_BTA, last_BTH, next_tokens_BT, start: int) -> torch.Tensor:
        """Append committed entries for positions start..start+T-1; return the root's child log-probs."""
        B, T = next_tokens_BT.shape
        positions = torch.arange(start, start + T, device=aux_BTA.device).expand(B, T)
        prev_k, prev_v = self.k_BKSE, self.v_BKSE
        S = 0 if prev_k is None else prev_k.shape[2]
        mask = torch.ones(B, T, S + T, dtype=torch.bool, device=aux_BTA.device)
        mask[:, :, S:] = torch.ones(T, T, dtype=torch.bool, device=aux_BTA.device).tril()

        def attend(q, k, v):
            self.k_BKSE = k if prev_k is None else torch.cat([prev_k, k], 2)
            self.v_BKSE = v if prev_v is None else torch.cat([prev_v, v], 2)
            return cached_attention(q, self.attn.expand_kv(self.k_BKSE), self.attn.expand_kv(self.v_BKSE), mask)

        hidden = self.head.step(next_tokens_BT, self.head.initial_hidden(aux_BTA, last_BTH), positions, attend)
        self.root_hidden_BD = hidden[:, -1]
        self.tree_k, self.tree_v, self.tree_hidden, self.tree_anc = [], [], None, None
        return self._target_logprobs(self.root_hidden_BD, 0)

    @torch.inference_mode()
    def step(self, tokens_BK, parent_BK, depth: int) -> torch.Tensor:
        """Run one frontier of the tree (the `step_fn` of grow_dynamic_tree)."""
        B, K = tokens_BK.shape
        dev = tokens_BK.device
        if depth == 1:
            hidden_in = self.root_hidden_BD[:, None].expand(B, K, -1)
            anc_new = torch.zeros(B, K, 0, dtype=torch.bool, device=dev)
        else:
            prev_hidden = self.tree_hidden  # [B, K_prev, D] of the previous frontier
            hidden_in = prev_hidden.gather(1, parent_BK[..., None].expand(B, K, prev_hidden.shape[-1]))
            F_prev = self.tree_anc.shape[-1]
            K_prev = prev_hidden.shape[1]
            parent_flat = parent_BK + (F_prev - K_prev)  # index of each parent among all tree entries
            anc_new = self.tree_anc.gather(1, parent_flat[..., None].expand(B, K, F_prev)).clone()
            anc_new.scatter_(2, parent_flat[..., None], True)
        S = self.k_BKSE.shape[2]
        F = anc_new.shape[-1]
        mask = torch.cat([torch.ones(B, K, S, dtype=torch.bool, device=dev), anc_new,
                          torch.eye(K, dtype=torch.bool, device=dev).expand(B, K, K)], dim=2)
        positions = torch.full((B, K), S - 1 + depth, device=dev)

        def attend(q, k, v):
            keys = torch.cat([self.k_BKSE, *self.tree_k, k], 2)
            values = torch.cat([self.v_BKSE, *self.tree_v, v], 2)
            self.tree_k.append(k)
            self.tree_v.append(v)
            return cached_attention(q, self.attn.expand_kv(keys), self.attn.expand_kv(values), mask)

        hidden = self.head.step(tokens_BK, hidden_in, positions, attend, depth=depth)
        self.tree_hidden = hidden
        grown = torch.zeros(B, F + K, F + K, dtype=torch.bool, device=dev)
        if F:
            grown[:, :F, :F] = self.tree_anc
        grown[:, F:, :F] = anc_new
        self.tree_anc = grown
        return self._target_logprobs(hidden, depth)


@dataclass
class GenerationStats:
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per verification round
    target_forwards: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0


def _stop(tokens: list[int], eos: set[int], max_new: int) -> bool:
    return len(tokens) >= max_new or any(t in eos for t in tokens)


def _trim(tokens: list[int], eos: set[int], max_new: int) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in eos:
            break
    return out


@torch.inference_mode()
def speculative_generate(runner: TargetRunner, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int,
                         depth: int, topk: int, num_nodes: int, eos: set[int]) -> GenerationStats:
    """Greedy (temperature 0) speculative generation of one prompt; lossless by construction."""
    dev = drafter.head.d2t.device
    stats = GenerationStats()
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], device=dev)
    t0 = time.perf_counter()
    out = runner(ids, past_key_values=cache)
    stats.target_forwards += 1
    root = out.logits_BTV[:, -1].argmax(-1)  # [B]
    n = ids.shape[1]
    stats.verify_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    root_logp = drafter.extend(out.aux_BTA, out.last_BTH, torch.cat([ids[:, 1:], root[:, None]], 1), 0)
    stats.draft_s += time.perf_counter() - t0
    stats.tokens.append(int(root))
    while not _stop(stats.tokens, eos, max_new_tokens):
        t0 = time.perf_counter()
        tree: Tree = grow_dynamic_tree(root, root_logp, drafter.step, depth, topk, num_nodes)
        stats.draft_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        N = tree.tokens.shape[1]
        mask = torch.cat([torch.ones(1, N, n, dtype=torch.bool, device=dev), tree.attention_mask()], dim=2)
        out = runner(tree.tokens, attention_mask=mask[:, None], position_ids=tree.positions(n), past_key_values=cache)
        stats.target_forwards += 1
        verdict = verify_greedy(tree, out.logits_BTV)
        m = int(verdict.accept_len[0])
        path = verdict.accept_nodes[:, : m + 1]
        for layer in cache.layers:
            compact_kv(layer.keys, layer.values, n, verdict.accept_nodes)
        cache.crop(-(N - m - 1)) if N > m + 1 else None  # keep prefix + accepted path
        new_tokens = verdict.tokens[:, : m + 1]  # accepted draft tokens, then the bonus
        stats.verify_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        aux = out.aux_BTA.gather(1, path[..., None].expand(1, m + 1, out.aux_BTA.shape[-1]))
        last = out.last_BTH.gather(1, path[..., None].expand(1, m + 1, out.last_BTH.shape[-1]))
        drafter_logp = drafter.extend(aux, last, new_tokens, n)
        stats.draft_s += time.perf_counter() - t0
        stats.accepted.append(m)
        stats.tokens.extend(int(t) for t in new_tokens[0])
        root, root_logp, n = new_tokens[:, -1], drafter_logp, n + m + 1
    stats.tokens = _trim(stats.tokens, eos, max_new_tokens)
    return stats


@torch.inference_mode()
def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding with a KV cache: the baseline for speed and for the lossless check."""
    dev = next(model.parameters()).device
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], device=dev)
    tokens: list[int] = []
    while not _stop(tokens, eos, max_new_tokens):
        logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
        nxt = int(logits.argmax(-1))
        tokens.append(nxt)
        ids = torch.tensor([[nxt]], device=dev)
    return _trim(tokens, eos, max_new_tokens)
