"""Drafters for the speculative loop (`decode/loop.py`): each answers `propose -> Tree` from the roots the
target chose, and keeps what it needs between rounds (`start` after the prefill, `commit` after each verdict,
`select_rows` when finished rows leave the batch).

- `HeadProposer`: a trained head as an EAGLE-2 dynamic tree, a chain, or a sampled static tree; its `Drafter`
  holds the head's KV cache (committed entries with their validity, and the tree being drafted).
- `BlockProposer`: a DFlash head, a chain drafted by one forward of its block (the bonus, then mask slots).
- `LookupProposer`: prompt lookup (n-gram), no model at all.

Positions follow the Training-Time Test: the draft cache entry t is the head's step-0 input at position t
(embedding of x_{t+1}, target features at t); a tree node at depth d sits at position n - 1 + d for the head.
Shapes: B batch, L cache slots, T new tokens, K frontier, N tree nodes, A aux features, D head hidden, V target
vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdistill.decode.tree import Tree, chain_tree, grow_dynamic_tree, static_tree
from specdistill.decode.verify import Sampling, Verdict
from specdistill.heads.dflash import dense_attention
from specdistill.heads.layers import cached_attention
from specdistill.target_runner import TargetOutput

HEAD_SHAPES = ("tree", "chain", "sampled")


def target_logprobs(logits_BV: Tensor, draft_ids: Tensor, target_vocab: int) -> Tensor:
    """Head log-probs over the draft vocab, placed in target-vocab ids (-inf elsewhere)."""
    logp = torch.log_softmax(logits_BV.float(), -1)
    out = torch.full((*logp.shape[:-1], target_vocab), float("-inf"), device=logp.device)
    out[..., draft_ids] = logp
    return out


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
        return target_logprobs(self.head.logits(hidden, depth), self.draft_ids, self.target_vocab)

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

        hidden = self.head.step(*self.head.step_input(tokens_BK, hidden_in, depth), positions, attend, depth=depth)
        self.tree_hidden = hidden
        grown = torch.zeros(B, F + K, F + K, dtype=torch.bool, device=dev)
        if F:
            grown[:, :F, :F] = self.tree_anc
        grown[:, F:, :F] = anc_new
        self.tree_anc = grown
        return self._target_logprobs(hidden, depth)



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
            return chain_tree(roots_B, *self.chain_parts(roots_B), self.depth, keep_probs=sample, sample=sample,
                              generator=generator)
        return static_tree(roots_B, self.root_logp_BV, step, self.branching, keep_probs=True, sample=True,
                           generator=generator)

    def chain_parts(self, roots_B: Tensor):
        """A chain's root log-probs and its step function (`tree.chain_tree`'s inputs)."""
        return self.root_logp_BV, self.drafter.step

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


class BlockProposer:
    """Drafts with a DFlash head as vLLM does: a chain of `depth`, one forward of the block [bonus, mask x depth] at
    the positions after the committed prefix, over each layer's keys and values of every committed position (their
    captured layers). Sampling draws each slot from its own distribution, which verification then uses."""

    def __init__(self, head, target_vocab: int, depth: int):
        if not 1 <= depth < head.config.block_size:
            raise ValueError(f"a DFlash head trained on blocks of {head.config.block_size} drafts 1 to "
                             f"{head.config.block_size - 1} tokens a round, not {depth}")
        self.head, self.target_vocab, self.depth = head, target_vocab, depth
        self.draft_ids = torch.arange(len(head.d2t), device=head.d2t.device) + head.d2t
        self.kv, self.valid_BL = None, None

    @torch.inference_mode()
    def extend(self, aux_BTA: Tensor, start: int | Tensor, valid_BT: Tensor) -> None:
        """Append committed positions' keys and values; `start` is the position of the first valid entry."""
        B = valid_BT.shape[0]
        start_B = torch.as_tensor(start, device=valid_BT.device).expand(B)
        positions_BT = start_B[:, None] + (valid_BT.long().cumsum(1) - 1).clamp(min=0)
        new = self.head.context_kv(aux_BTA, positions_BT)
        self.kv = new if self.kv is None else [(torch.cat([k, nk], 2), torch.cat([v, nv], 2))
                                               for (k, v), (nk, nv) in zip(self.kv, new)]
        self.valid_BL = valid_BT if self.valid_BL is None else torch.cat([self.valid_BL, valid_BT], 1)

    def start(self, out: TargetOutput, next_tokens_BT: Tensor, valid_BT: Tensor) -> None:
        self.kv = self.valid_BL = None
        self.extend(out.aux_BTA, 0, valid_BT)

    def propose(self, roots_B: Tensor, contexts: list[list[int]], sampling: Sampling,
                generator: torch.Generator | None) -> Tree:
        sample = sampling.temperature > 0
        return chain_tree(roots_B, *self.chain_parts(roots_B), self.depth, keep_probs=sample, sample=sample,
                          generator=generator)

    @torch.inference_mode()
    def chain_parts(self, roots_B: Tensor):
        """The block's forward: the first slot's log-probs and a step function handing out the later slots'."""
        B, W = len(roots_B), self.depth + 1
        dev = roots_B.device
        positions_BW = self.valid_BL.sum(1)[:, None] + torch.arange(W, device=dev)
        mask_BWS = torch.cat([self.valid_BL[:, None].expand(B, W, -1),
                              torch.ones(B, W, W, dtype=torch.bool, device=dev)], 2)
        hidden_BWD = self.head.block(self.head.block_input(roots_B, W), positions_BW, self.kv, dense_attention(mask_BWS))
        logp_BKV = target_logprobs(self.head.logits(hidden_BWD[:, 1:]), self.draft_ids, self.target_vocab)

        def slot(tokens_BK, parent_BK, depth: int) -> Tensor:  # the chain's node at `depth` drafts slot depth + 1
            return logp_BKV[:, depth, None]

        return logp_BKV[:, 0], slot

    def commit(self, out: TargetOutput, verdict: Verdict, committed_B: Tensor, new_valid_BS: Tensor) -> None:
        """The accepted path's positions (root + accepted nodes) join the context."""
        S = new_valid_BS.shape[1]
        path_BS = verdict.accept_nodes[:, :S].clamp(min=0)
        aux = out.aux_BTA.gather(1, path_BS[..., None].expand(-1, -1, out.aux_BTA.shape[-1]))
        self.extend(aux, committed_B, new_valid_BS)

    def select_rows(self, rows_R: Tensor) -> None:
        self.kv = [(k[rows_R], v[rows_R]) for k, v in self.kv]
        self.valid_BL = self.valid_BL[rows_R]


def chain_proposer(head, target_vocab: int, depth: int):
    """A chain of `depth` drafted the way engines draft this head: step by step, or (DFlash) as one block."""
    if head.config.kind == "dflash":
        return BlockProposer(head, target_vocab, depth)
    return HeadProposer(head, target_vocab, "chain", depth)


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
