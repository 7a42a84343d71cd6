"""Verification (greedy against a brute-force walk; rejection sampling keeps the target distribution,
by chi-square) and KV compaction (a compacted cache continues exactly like a plain run)."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specdistill.decode.kv import compact_cache, compact_kv
from specdistill.decode.tree import Tree, grow_dynamic_tree, random_tree, static_tree
from specdistill.decode.verify import verify_greedy, verify_rejection
from specdistill.target_runner import with_kv_cache

V = 6
DRAWS = 20_000


def brute_force_greedy(tokens: list[int], parents: list[int], argmax: list[int]) -> tuple[list[int], list[int]]:
    path, current = [0], 0
    while True:
        children = [j for j in range(len(tokens)) if parents[j] == current and tokens[j] == argmax[current]]
        if not children:
            break
        current = children[0]
        path.append(current)
    return path, [tokens[n] for n in path[1:]] + [argmax[current]]


@pytest.mark.parametrize("seed", range(6))
def test_greedy_matches_brute_force_walk(seed):
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(8, 5 + 7 * seed, 3, gen)
    logits = torch.randn(8, tree.num_nodes, 3, generator=gen)
    verdict = verify_greedy(tree, logits)
    S = tree.depth + 1
    assert verdict.accept_nodes.shape == verdict.tokens.shape == (8, S)
    for b in range(8):
        path, committed = brute_force_greedy(tree.tokens[b].tolist(), tree.parents[b].tolist(),
                                             logits[b].argmax(-1).tolist())
        assert verdict.accept_nodes[b].tolist() == path + [-1] * (S - len(path))
        assert int(verdict.accept_len[b]) == len(path) - 1
        assert verdict.tokens[b].tolist() == committed + [-1] * (S - len(committed))
    if seed == 5:
        assert int(verdict.accept_len.max()) >= 2


def test_verify_rejects_mismatched_logits_and_top_k_tree_with_draft_probs():
    tree = random_tree(2, 4, V, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"expected shape \(2, 4, V\)"):
        verify_greedy(tree, torch.zeros(2, 5, V))
    with pytest.raises(ValueError, match="sample=True, keep_probs=True"):
        verify_rejection(tree, torch.zeros(2, 4, V), temperature=1.0, draft_probs=True)


# ---------------------------------------------------------------- rejection sampling is lossless


def expected_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling distribution, computed the plain way, one row."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order[:top_k] if top_k else order)
    weights = {i: torch.tensor(scaled[i]).exp().item() for i in keep}
    total = sum(weights.values())
    kept_p, mass = {}, 0.0
    for i in sorted(weights, key=lambda i: -weights[i]):
        if mass >= top_p:
            break
        kept_p[i] = weights[i] / total
        mass += kept_p[i]
    out = torch.zeros(len(logits), dtype=torch.float64)
    for i, p in kept_p.items():
        out[i] = p / mass
    return out


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square; cells with zero expected mass must be empty."""
    assert int(counts[probs == 0].sum()) == 0, "a token of zero target probability was produced"
    support = probs > 0
    expected = probs[support] * counts.sum()
    statistic = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


TARGET = torch.randn(V, V, generator=torch.Generator().manual_seed(11)) * 1.5  # target logits after a token
DRAFT = (TARGET + torch.randn(V, V, generator=torch.Generator().manual_seed(12))).log_softmax(-1)  # a draft


def draft_step(frontier_tokens, frontier_parent, depth):
    return DRAFT[frontier_tokens]


def grow(kind: str, roots: torch.Tensor, gen: torch.Generator) -> Tree:
    if kind == "chain_sampled":
        return static_tree(roots, DRAFT[roots], draft_step, [1, 1], keep_probs=True, sample=True, generator=gen)
    if kind == "multi_sampled":
        return static_tree(roots, DRAFT[roots], draft_step, [3, 2], keep_probs=True, sample=True, generator=gen)
    if kind == "static_topk":
        return static_tree(roots, DRAFT[roots], draft_step, [3, 2])
    return grow_dynamic_tree(roots, DRAFT[roots], draft_step, depth=3, topk=3, num_nodes=8)


CASES = [  # tree, draft_probs, temperature, top_k, top_p
    ("chain_sampled", True, 1.0, 0, 1.0),
    ("multi_sampled", True, 0.8, 0, 0.8),
    ("multi_sampled", True, 1.0, 4, 1.0),
    ("chain_sampled", False, 1.0, 0, 0.7),
    ("static_topk", False, 1.2, 0, 0.9),
    ("dynamic", False, 1.0, 3, 1.0),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_rejection_sampling_keeps_the_target_distribution(case):
    """Joint of the first two committed tokens == p(t1 | root) p(t2 | t1). When a round commits only
    one token, the second comes from the next round's root, which samples the target directly."""
    kind, draft_probs, temperature, top_k, top_p = CASES[case]
    gen = torch.Generator().manual_seed(case)
    root = 2
    roots = torch.full((DRAWS,), root)
    tree = grow(kind, roots, gen)
    verdict = verify_rejection(tree, TARGET[tree.tokens], temperature, top_k, top_p, generator=gen,
                               draft_probs=draft_probs)
    assert bool((verdict.accept_len >= 0).all()) and bool((verdict.accept_len <= tree.depth).all())
    probs = torch.stack([expected_probs(TARGET[v].tolist(), temperature, top_k, top_p) for v in range(V)])
    first, second = verdict.tokens[:, 0], verdict.tokens[:, 1]
    next_round = torch.multinomial(probs[first.clamp(min=0)].float(), 1, generator=gen)[:, 0]
    second = torch.where(verdict.accept_len >= 1, second, next_round)
    counts = torch.bincount(first * V + second, minlength=V * V)
    joint = (probs[root][:, None] * probs).flatten()
    assert chi_square_p_value(counts, joint) > 0.001
    assert float(verdict.accept_len.float().mean()) > 0.3  # drafts do get accepted


def test_multi_candidate_accepts_more_than_a_single_candidate():
    gen = torch.Generator().manual_seed(5)
    roots = torch.full((DRAWS,), 2)
    mean_accept = {}
    for kind in ("chain_sampled", "multi_sampled"):
        tree = grow(kind, roots, gen)
        mean_accept[kind] = float(verify_rejection(tree, TARGET[tree.tokens], 1.0, generator=gen).accept_len.float().mean())
    assert mean_accept["multi_sampled"] > mean_accept["chain_sampled"] + 0.1


# ---------------------------------------------------------------- KV compaction


def accepted_path(tree: Tree, node_BN: torch.Tensor) -> torch.Tensor:
    """The root path to a chosen node per row, as a verdict's accept_nodes (ascending, -1 padded)."""
    S = tree.depth + 1
    out = torch.full((tree.batch_size, S), -1, dtype=torch.long)
    for b in range(tree.batch_size):
        path, n = [], int(node_BN[b])
        while n >= 0:
            path.append(n)
            n = int(tree.parents[b, n])
        out[b, : len(path)] = torch.tensor(path[::-1])
    return out


@pytest.mark.parametrize("value_dim", [8, 6])  # 6: keys and values of different widths, as MLA caches them
def test_compact_kv_moves_accepted_entries_and_keeps_the_prefix(value_dim):
    gen = torch.Generator().manual_seed(0)
    tree = random_tree(4, 16, V, gen)
    accept = accepted_path(tree, torch.tensor([15, 0, 9, 4]))
    keys = torch.randn(4, 2, 5 + 16 + 3, 8, generator=gen)
    values = torch.randn(4, 2, 5 + 16 + 3, value_dim, generator=gen)
    new_k, new_v = keys.clone(), values.clone()
    compact_kv(new_k, new_v, 5, accept)
    assert torch.equal(new_k[:, :, :5], keys[:, :, :5])
    for b in range(4):
        for s, node in enumerate(accept[b].tolist()):
            if node >= 0:
                assert torch.equal(new_k[b, :, 5 + s], keys[b, :, 5 + node])
                assert torch.equal(new_v[b, :, 5 + s], values[b, :, 5 + node])
    with pytest.raises(ValueError, match="does not fit a cache of length"):
        compact_kv(new_k, new_v, 20, accept)
    with pytest.raises(ValueError, match="the same B, H, L"):
        compact_kv(new_k, new_v[:, :1], 5, accept)


@torch.no_grad()
def test_compacted_cache_continues_like_a_plain_run():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V * 4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    gen = torch.Generator().manual_seed(1)
    tree = random_tree(1, 12, V * 4, gen)
    prefix = torch.randint(0, V * 4, (1, 7), generator=gen)
    cache = DynamicCache()
    model(input_ids=prefix, **with_kv_cache(model, cache))
    mask = torch.cat([torch.ones(1, 12, 7, dtype=torch.bool), tree.attention_mask()], -1)[:, None]
    model(input_ids=tree.tokens, attention_mask=mask, position_ids=tree.positions(7), **with_kv_cache(model, cache))
    deepest = int(tree.depths[0].argmax())
    accept = accepted_path(tree, torch.tensor([deepest]))
    accept_len = (accept >= 0).sum(-1) - 1
    new_length = compact_cache(cache, 7, accept, accept_len)
    assert new_length == cache.get_seq_length() == 7 + int(accept_len) + 1 and int(accept_len) >= 2

    next_token = torch.tensor([[3]])
    continued = model(input_ids=next_token, **with_kv_cache(model, cache)).logits[0, -1]
    path_tokens = tree.tokens[0, accept[0, : int(accept_len) + 1]]
    plain = model(input_ids=torch.cat([prefix[0], path_tokens, next_token[0]])[None]).logits[0, -1]
    torch.testing.assert_close(continued, plain, atol=1e-4, rtol=1e-4)
