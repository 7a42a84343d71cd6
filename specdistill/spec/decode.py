"""Speculative generation on a real target: draft a tree, verify it in one target forward with tree
attention, keep the accepted path's KV, repeat (gpt-fast's plain loop, with trees and batches).

Positions: committed tokens x_0..x_{n-1} sit in both KV caches; the root x_n (the last token the
target chose) is not yet in either. The draft cache entry t is the head's step-0 input at position t:
(embedding of x_{t+1}, target features at t). A tree node at depth d sits at position n + d for the
target and n - 1 + d for the head, exactly as in the Training-Time Test.

Batches: prompts are left-padded to one length. Both caches share one slot layout and one validity
mask `valid_BL`: pad slots, and the stale slots that compaction leaves in rows that accepted fewer
tokens than the batch's longest row, are False and masked out of every later attention. A row's
committed count (its number of valid slots) is its next position. Finished rows leave the batch.

Drafters (`HeadProposer`: the head as a dynamic tree, a chain or a sampled tree; `LookupProposer`:
prompt lookup) all answer `propose -> Tree`; the loop and the verifier are the same for every one.

Shapes: B batch, L cache slots, T new tokens, K frontier, N tree nodes, S verdict slots, A aux
features, D head hidden, V target vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache

from specdistill.heads.layers import cached_attention
from specdistill.spec.kv import ReplayCache, compact_cache
from specdistill.spec.tree import Tree, chain_tree, grow_dynamic_tree, static_tree
from specdistill.spec.verify import Verdict, sampling_probs, verify_greedy, verify_rejection
from specdistill.target import (
    TargetOutput,
    TargetRunner,
    keeps_recurrent_state,
    require_kv_cache,
    with_kv_cache,
)

HEAD_SHAPES = ("tree", "chain", "sampled")


class Drafter:
    """The head plus its KV cache: committed entries (with their validity) and the tree being drafted."""

    def __init__(self, head, target_vocab: int):
        self.head = head
        self.attn = head.attention()
        self.target_vocab = target_vocab
        self.draft_ids = torch.arange(len(head.d2t), device=head.d2t.device) + head.d2t
        self.k_BKLE = self.v_BKLE = self.valid_BL = None
        self.root_hidden_BD = None

    def _target_logprobs(self, hidden, depth: int) -> Tensor:
        """Head log-probs over the draft vocab, placed in target-vocab ids (-inf elsewhere)."""
        logp = torch.log_softmax(self.head.logits(hidden, depth).float(), -1)
        out = torch.full((*logp.shape[:-1], self.target_vocab), float("-inf"), device=logp.device)
        out[..., self.draft_ids] = logp
        return out

    def select_rows(self, rows_R: Tensor) -> None:
        """Keep only these batch rows (finished rows leave the batch)."""
        self.k_BKLE, self.v_BKLE = self.k_BKLE[rows_R], self.v_BKLE[rows_R]
        self.valid_BL, self.root_hidden_BD = self.valid_BL[rows_R], self.root_hidden_BD[rows_R]

    @torch.inference_mode()
    def extend(self, aux_BTA, last_BTH, next_tokens_BT, start: int | Tensor, valid_BT: Tensor | None = None) -> Tensor:
        """Append committed entries; `start` is the position of the first valid one (int or [B]) and
        `valid_BT` marks the real entries (default all). Returns the log-probs of the root's children,
        the root following each row's last valid new entry."""
        B, T = next_tokens_BT.shape
        dev = next_tokens_BT.device
        valid_BT = torch.ones(B, T, dtype=torch.bool, device=dev) if valid_BT is None else valid_BT
        start_B = torch.as_tensor(start, device=dev).expand(B)
        positions_BT = start_B[:, None] + (valid_BT.long().cumsum(1) - 1).clamp(min=0)
        prev_valid_BL = torch.zeros(B, 0, dtype=torch.bool, device=dev) if self.valid_BL is None else self.valid_BL
        eye_TT = torch.eye(T, dtype=torch.bool, device=dev)
        new_BTT = (torch.ones(T, T, dtype=torch.bool, device=dev).tril() & valid_BT[:, None, :]) | eye_TT
        mask = torch.cat([prev_valid_BL[:, None].expand(B, T, -1), new_BTT], dim=2)
        prev_k, prev_v = self.k_BKLE, self.v_BKLE

        def attend(q, k, v):
            self.k_BKLE = k if prev_k is None else torch.cat([prev_k, k], 2)
            self.v_BKLE = v if prev_v is None else torch.cat([prev_v, v], 2)
            return cached_attention(q, self.attn.expand_kv(self.k_BKLE), self.attn.expand_kv(self.v_BKLE), mask)

        hidden_BTD = self.head.step(next_tokens_BT, self.head.initial_hidden(aux_BTA, last_BTH), positions_BT, attend)
        self.valid_BL = torch.cat([prev_valid_BL, valid_BT], 1)
        last_B = (valid_BT.long() * torch.arange(T, device=dev)).argmax(1)
        self.root_hidden_BD = hidden_BTD[torch.arange(B, device=dev), last_B]
        self.tree_k, self.tree_v, self.tree_hidden, self.tree_anc = [], [], None, None
        return self._target_logprobs(self.root_hidden_BD, 0)

    @torch.inference_mode()
    def step(self, tokens_BK, parent_BK, depth: int) -> Tensor:
        """Run one frontier of the tree (the `step_fn` of the tree growers)."""
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
        F = anc_new.shape[-1]
        mask = torch.cat([self.valid_BL[:, None].expand(B, K, -1), anc_new,
                          torch.eye(K, dtype=torch.bool, device=dev).expand(B, K, K)], dim=2)
        committed_B = self.valid_BL.sum(1)
        positions = (committed_B - 1 + depth)[:, None].expand(B, K)

        def attend(q, k, v):
            keys = torch.cat([self.k_BKLE, *self.tree_k, k], 2)
            values = torch.cat([self.v_BKLE, *self.tree_v, v], 2)
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


# ---------------------------------------------------------------- sampling


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: temperature 0 is greedy (verified greedily, lossless token for token)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def pick(self, logits_BV: Tensor, generator: torch.Generator | None) -> Tensor:
        if self.temperature == 0:
            return logits_BV.argmax(-1)
        probs_BV = sampling_probs(logits_BV[:, None], self.temperature, self.top_k, self.top_p)[:, 0]
        return torch.multinomial(probs_BV, 1, generator=generator)[:, 0]

    def verify(self, tree: Tree, logits_BNV: Tensor, generator: torch.Generator | None) -> Verdict:
        """Greedy at temperature 0; otherwise rejection sampling, multi-candidate when the tree was sampled."""
        if self.temperature == 0:
            return verify_greedy(tree, logits_BNV)
        return verify_rejection(tree, logits_BNV, self.temperature, self.top_k, self.top_p, generator,
                                draft_probs=tree.sampled)


GREEDY = Sampling()


# ---------------------------------------------------------------- drafters


class HeadProposer:
    """Drafts with a head. shape: `tree` (EAGLE-2 dynamic top-k tree), `chain` (one candidate per
    depth; drawn from the draft when sampling, so multi-candidate verification stays exact) or
    `sampled` (a static tree of `branching` children drawn from the draft)."""

    def __init__(self, head, target_vocab: int, shape: str, depth: int, topk: int = 1, num_nodes: int = 1,
                 branching: list[int] | None = None):
        if shape not in HEAD_SHAPES:
            raise ValueError(f"head draft shape {shape!r} is unknown; expected one of {list(HEAD_SHAPES)}")
        self.drafter = Drafter(head, target_vocab)
        self.shape, self.depth, self.topk, self.num_nodes = shape, depth, topk, num_nodes
        self.branching = list(branching or [])
        self.root_logp_BV = None

    def start(self, out: TargetOutput, next_tokens_BT: Tensor, valid_BT: Tensor) -> None:
        self.drafter.k_BKLE = self.drafter.v_BKLE = self.drafter.valid_BL = None
        self.root_logp_BV = self.drafter.extend(out.aux_BTA, out.last_BTH, next_tokens_BT, 0, valid_BT)

    def propose(self, roots_B: Tensor, contexts: list[list[int]], sampling: Sampling,
                generator: torch.Generator | None) -> Tree:
        step = self.drafter.step
        if self.shape == "tree":
            return grow_dynamic_tree(roots_B, self.root_logp_BV, step, self.depth, self.topk, self.num_nodes)
        sample = sampling.temperature > 0
        if self.shape == "chain":
            return chain_tree(roots_B, self.root_logp_BV, step, self.depth, keep_probs=sample, sample=sample,
                              generator=generator)
        return static_tree(roots_B, self.root_logp_BV, step, self.branching, keep_probs=True, sample=True,
                           generator=generator)

    def commit(self, out: TargetOutput, verdict: Verdict, committed_B: Tensor, new_valid_BS: Tensor) -> None:
        """Append the accepted path (root + accepted nodes) to the head's cache."""
        S = new_valid_BS.shape[1]
        path_BS = verdict.accept_nodes[:, :S].clamp(min=0)
        aux = out.aux_BTA.gather(1, path_BS[..., None].expand(-1, -1, out.aux_BTA.shape[-1]))
        last = out.last_BTH.gather(1, path_BS[..., None].expand(-1, -1, out.last_BTH.shape[-1]))
        next_tokens_BS = verdict.tokens[:, :S].clamp(min=0)  # accepted drafts then the bonus
        self.root_logp_BV = self.drafter.extend(aux, last, next_tokens_BS, committed_B, new_valid_BS)

    def select_rows(self, rows_R: Tensor) -> None:
        self.drafter.select_rows(rows_R)
        self.root_logp_BV = self.root_logp_BV[rows_R]


class LookupProposer:
    """Prompt lookup (n-gram) drafting: a chain copied from what followed the latest earlier
    occurrence of the context's last n tokens (n from `max_ngram` down to 1). No model at all."""

    def __init__(self, num_tokens: int = 5, max_ngram: int = 3):
        if num_tokens < 1 or max_ngram < 1:
            raise ValueError(f"prompt lookup needs num_tokens >= 1 and max_ngram >= 1, got {num_tokens}, {max_ngram}")
        self.num_tokens, self.max_ngram = num_tokens, max_ngram

    def continuation(self, context: list[int]) -> list[int]:
        for n in range(min(self.max_ngram, len(context) - 1), 0, -1):
            pattern = context[-n:]
            for i in range(len(context) - n - 1, -1, -1):
                if context[i : i + n] == pattern:
                    return context[i + n : i + n + self.num_tokens]
        return []

    def start(self, out: TargetOutput, next_tokens_BT: Tensor, valid_BT: Tensor) -> None:
        pass

    def propose(self, roots_B: Tensor, contexts: list[list[int]], sampling: Sampling,
                generator: torch.Generator | None) -> Tree:
        rows = []
        for context in contexts:
            found = self.continuation(context)
            filler = found[-1] if found else context[-1]  # same-length chains across the batch
            rows.append([context[-1], *found, *[filler] * (self.num_tokens - len(found))])
        tokens_BN = torch.tensor(rows, device=roots_B.device)
        B, N = tokens_BN.shape
        depths_BN = torch.arange(N, device=roots_B.device).expand(B, N)
        return Tree(tokens_BN, depths_BN - 1, depths_BN, torch.zeros(B, N, device=roots_B.device))

    def commit(self, out: TargetOutput, verdict: Verdict, committed_B: Tensor, new_valid_BS: Tensor) -> None:
        pass

    def select_rows(self, rows_R: Tensor) -> None:
        pass


# ---------------------------------------------------------------- the loops


@dataclass
class GenerationStats:
    """One batch's results: per-row tokens and accepted counts, and batch-wide costs."""

    tokens: list[list[int]]
    accepted: list[list[int]]  # accepted draft tokens per verification round, per row
    hits: list[tuple[int, int, int]] = field(default_factory=list)  # (depth, tokens ranked, rank or -1)
    target_forwards: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0


class _Clock:
    """Wall time of code sections, synchronising CUDA so the split is real."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()

    def lap(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        seconds, self.t0 = now - self.t0, now
        return seconds


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[Tensor, Tensor]:
    """(ids_BT, valid_BT): prompts right-aligned, pads on the left."""
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("every prompt needs at least one token")
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), T, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p)
        valid[b, T - len(p):] = True
    return ids.to(device), valid.to(device)


def prefill_inputs(valid_BT: Tensor) -> tuple[Tensor | None, Tensor]:
    """(4D mask or None when nothing is padded, position ids) for a left-padded prompt batch. Pad
    queries see themselves, so no row of the attention is empty (an empty row gives NaN keys later)."""
    positions_BT = (valid_BT.long().cumsum(1) - 1).clamp(min=0)
    if bool(valid_BT.all()):
        return None, positions_BT
    T = valid_BT.shape[1]
    eye_TT = torch.eye(T, dtype=torch.bool, device=valid_BT.device)
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=valid_BT.device).tril()
    return ((causal_TT & valid_BT[:, None, :]) | eye_TT)[:, None], positions_BT


def _stopped(tokens: list[int], eos: set[int], max_new: int) -> bool:
    return len(tokens) >= max_new or any(t in eos for t in tokens)


def _trim(tokens: list[int], eos: set[int], max_new: int) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in eos:
            break
    return out


def _record_hits(stats: GenerationStats, tree: Tree, verdict: Verdict, b: int) -> None:
    """Along row b's accepted path, at each expanded node: how many of the drafter's top tokens it
    ranked, and where among them the target's next token was (-1: not among them). Ranks come from
    the drafter's whole top-k at the node, not from the children the tree kept: a tree keeps fewer
    children under a confident parent, so kept-children ranks would measure wide tops only where the
    drafter was unsure. Feeds the serving-advice model."""
    if tree.child_ranked is None:
        return
    path = [n for n in verdict.accept_nodes[b].tolist() if n >= 0]
    following = verdict.tokens[b].tolist()  # the target's token after each path node
    for d, parent in enumerate(path, start=1):
        ranked = [t for t in tree.child_ranked[b, parent].tolist() if t >= 0]
        if not ranked:
            break
        token = following[d - 1]
        stats.hits.append((d, len(ranked), ranked.index(token) if token in ranked else -1))


@torch.inference_mode()
def speculative_generate(runner: TargetRunner, proposer, prompts: list[list[int]], max_new_tokens: int,
                         eos: set[int], sampling: Sampling = GREEDY, generator: torch.Generator | None = None,
                         pad_id: int = 0) -> GenerationStats:
    """Speculative generation of a batch of prompts. Temperature 0 equals plain greedy decoding; above
    0, the committed tokens are distributed as sampling from the target."""
    model = runner.target.model
    recurrent = keeps_recurrent_state(model)
    if recurrent and len(prompts) > 1:
        require_kv_cache(model, "speculative decoding of a batch")
    device = next(model.parameters()).device
    clock = _Clock(device)
    stats = GenerationStats(tokens=[[] for _ in prompts], accepted=[[] for _ in prompts])
    cache = ReplayCache() if recurrent else DynamicCache()
    ids_BT, valid_BL = left_pad(prompts, pad_id, device)
    mask, positions = prefill_inputs(valid_BL)
    out = runner(ids_BT, attention_mask=mask, position_ids=positions, cache=cache)
    stats.target_forwards += 1
    roots_B = sampling.pick(out.logits_BTV[:, -1], generator)
    committed_B = valid_BL.sum(1)
    stats.verify_s += clock.lap()
    proposer.start(out, torch.cat([ids_BT[:, 1:], roots_B[:, None]], 1), valid_BL)
    stats.draft_s += clock.lap()
    rows = list(range(len(prompts)))  # original index of each live row
    contexts = [list(p) for p in prompts]
    new_tokens = [[int(t)] for t in roots_B]
    while True:
        for b, row in enumerate(rows):
            stats.tokens[row].extend(new_tokens[b])
            contexts[row].extend(new_tokens[b])
        keep = [b for b, row in enumerate(rows) if not _stopped(stats.tokens[row], eos, max_new_tokens)]
        if not keep:
            break
        if len(keep) < len(rows):
            keep_R = torch.tensor(keep, device=device)
            cache.batch_select_indices(keep_R)
            proposer.select_rows(keep_R)
            valid_BL, committed_B, roots_B = valid_BL[keep_R], committed_B[keep_R], roots_B[keep_R]
            rows = [rows[b] for b in keep]
        stats.verify_s += clock.lap()

        tree = proposer.propose(roots_B, [contexts[row] for row in rows], sampling, generator)
        stats.draft_s += clock.lap()
        B, N, L = tree.batch_size, tree.num_nodes, valid_BL.shape[1]
        mask = torch.cat([valid_BL[:, None].expand(B, N, L), tree.attention_mask()], dim=2)[:, None]
        out = runner(tree.tokens, attention_mask=mask, position_ids=tree.positions(committed_B), cache=cache)
        stats.target_forwards += 1
        verdict = sampling.verify(tree, out.logits_BTV, generator)
        compact_cache(cache, L, verdict.accept_nodes, verdict.accept_len)
        S = int(verdict.accept_len.max()) + 1
        new_valid_BS = torch.arange(S, device=device) <= verdict.accept_len[:, None]
        valid_BL = torch.cat([valid_BL, new_valid_BS], 1)
        stats.verify_s += clock.lap()
        proposer.commit(out, verdict, committed_B, new_valid_BS)
        stats.draft_s += clock.lap()
        committed_B = committed_B + verdict.accept_len + 1
        roots_B = verdict.tokens.gather(1, verdict.accept_len[:, None])[:, 0]
        lengths = (verdict.accept_len + 1).tolist()
        new_tokens = [t[:n] for t, n in zip(verdict.tokens.tolist(), lengths)]
        for b, row in enumerate(rows):
            stats.accepted[row].append(lengths[b] - 1)
            _record_hits(stats, tree, verdict, b)
    stats.tokens = [_trim(t, eos, max_new_tokens) for t in stats.tokens]
    return stats


@torch.inference_mode()
def plain_generate(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int],
                   sampling: Sampling = GREEDY, generator: torch.Generator | None = None,
                   pad_id: int = 0) -> list[list[int]]:
    """Plain decoding with a KV cache, one token per forward: the baseline for speed and, at
    temperature 0, the reference for the lossless check."""
    require_kv_cache(model, "plain decoding")
    device = next(model.parameters()).device
    cache = DynamicCache()
    ids_BT, valid_BL = left_pad(prompts, pad_id, device)
    mask, positions_BT = prefill_inputs(valid_BL)
    logits_BV = model(ids_BT, attention_mask=mask, position_ids=positions_BT, **with_kv_cache(model, cache),
                      logits_to_keep=1).logits[:, -1]
    committed_B = valid_BL.sum(1)
    tokens: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))
    padded = mask is not None
    while True:
        next_B = sampling.pick(logits_BV, generator)
        for b, row in enumerate(rows):
            tokens[row].append(int(next_B[b]))
        keep = [b for b, row in enumerate(rows) if not _stopped(tokens[row], eos, max_new_tokens)]
        if not keep:
            break
        if len(keep) < len(rows):
            keep_R = torch.tensor(keep, device=device)
            cache.batch_select_indices(keep_R)
            valid_BL, committed_B, next_B = valid_BL[keep_R], committed_B[keep_R], next_B[keep_R]
            rows = [rows[b] for b in keep]
        valid_BL = torch.cat([valid_BL, torch.ones_like(valid_BL[:, :1])], 1)
        mask = valid_BL[:, None, None] if padded else None
        logits_BV = model(next_B[:, None], attention_mask=mask, position_ids=committed_B[:, None],
                          **with_kv_cache(model, cache)).logits[:, -1]
        committed_B = committed_B + 1
    return [_trim(t, eos, max_new_tokens) for t in tokens]
