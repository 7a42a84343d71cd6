"""Tree description (mask, positions, links) and tree growth (dynamic, static, chain)."""

import functools
import heapq

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specdistill.decode import kernels
from specdistill.decode.tree import Tree, chain_tree, grow_dynamic_tree, static_tree
from specdistill.target_runner import with_kv_cache

VOCAB = 12


@st.composite
def trees(draw, max_nodes=40, max_batch=3):
    """Random batches of trees: node i's parent is any earlier node."""
    batch = draw(st.integers(1, max_batch))
    nodes = draw(st.integers(1, max_nodes))
    parents = [[-1] + [draw(st.integers(0, i - 1)) for i in range(1, nodes)] for _ in range(batch)]
    tokens = [[draw(st.integers(0, VOCAB - 1)) for _ in range(nodes)] for _ in range(batch)]
    depths = [[0] * nodes for _ in range(batch)]
    for row, par in zip(depths, parents):
        for i in range(1, nodes):
            row[i] = row[par[i]] + 1
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.zeros(batch, nodes))


def ancestors_and_self(parents: list[int], i: int) -> set[int]:
    found = {i}
    while parents[i] >= 0:
        i = parents[i]
        found.add(i)
    return found


@settings(max_examples=60, deadline=None)
@given(tree=trees(), prefix=st.integers(0, 1000))
def test_mask_positions_links_match_brute_force(tree, prefix):
    t = tree.tensors
    positions = tree.positions(prefix)
    B, N = tree.tokens.shape
    assert t.mask_BNN.shape == (B, N, N)
    for b in range(B):
        parents = tree.parents[b].tolist()
        for i in range(N):
            assert set(t.mask_BNN[b, i].nonzero().flatten().tolist()) == ancestors_and_self(parents, i)
            assert int(positions[b, i]) == prefix + len(ancestors_and_self(parents, i)) - 1
            children = [j for j in range(N) if parents[j] == i]
            assert int(t.next_token_BN[b, i]) == (children[0] if children else -1)
            siblings = [j for j in range(i + 1, N) if parents[i] >= 0 and parents[j] == parents[i]]
            assert int(t.next_sibling_BN[b, i]) == (siblings[0] if siblings else -1)
    assert torch.equal(tree.attention_mask(), t.mask_BNN)
    assert all(torch.equal(a, b) for a, b in zip(tree.links(), (t.next_token_BN, t.next_sibling_BN)))


def test_the_target_and_the_verifier_share_one_build(monkeypatch):
    tree = Tree(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]),
                torch.zeros(1, 3))
    builds, build = [], kernels.build_tree_tensors
    monkeypatch.setattr(kernels, "build_tree_tensors", lambda parents: builds.append(1) or build(parents))
    mask, (next_token, _) = tree.attention_mask(), tree.links()
    assert len(builds) == 1 and mask[0, 2].tolist() == [True, True, True] and next_token[0].tolist() == [1, 2, -1]


def test_per_row_prefix_lengths_and_bad_parents():
    tree = Tree(torch.zeros(2, 3, dtype=torch.long), torch.tensor([[-1, 0, 1], [-1, 0, 0]]),
                torch.tensor([[0, 1, 2], [0, 1, 1]]), torch.zeros(2, 3))
    assert tree.positions(torch.tensor([5, 9])).tolist() == [[5, 6, 7], [9, 10, 10]]
    with pytest.raises(ValueError, match=r"parents\[1, 2\] = 2"):
        Tree(torch.zeros(2, 3, dtype=torch.long), torch.tensor([[-1, 0, 1], [-1, 0, 2]]),
             torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3))


# ---------------------------------------------------------------- the target sees the tree as sequences


@functools.lru_cache(maxsize=1)
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


@settings(max_examples=12, deadline=None)
@given(tree=trees(max_nodes=10, max_batch=2), prefix_len=st.integers(1, 6), seed=st.integers(0, 2**16))
@torch.no_grad()
def test_tree_forward_equals_each_path_as_a_sequence(tree, prefix_len, seed):
    model = tiny_llama()
    B, N = tree.tokens.shape
    prefix = torch.randint(0, VOCAB, (B, prefix_len), generator=torch.Generator().manual_seed(seed))
    cache = DynamicCache()
    model(input_ids=prefix, **with_kv_cache(model, cache))
    mask = torch.cat([torch.ones(B, N, prefix_len, dtype=torch.bool), tree.attention_mask()], -1)[:, None]
    tree_logits = model(input_ids=tree.tokens, attention_mask=mask, position_ids=tree.positions(prefix_len),
                        **with_kv_cache(model, cache)).logits
    for b in range(B):
        parents = tree.parents[b].tolist()
        for i in range(N):
            path = sorted(ancestors_and_self(parents, i))
            sequence = torch.cat([prefix[b], tree.tokens[b, path]])[None]
            plain = model(input_ids=sequence).logits[0, -1]
            torch.testing.assert_close(tree_logits[b, i], plain, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- growth


def bigram_step(table_VV):
    """A stateless draft: each node's children depend on its own token only."""
    calls = []

    def step(frontier_tokens, frontier_parent, depth):
        calls.append((frontier_tokens.clone(), frontier_parent.clone(), depth))
        return table_VV[frontier_tokens]

    return step, calls


def brute_force_dynamic(root_token, table, depth, topk, num_nodes):
    """EAGLE-2 by hand for one row: the kept candidates as (score, creation id, token, parent id, depth),
    and the ids of the candidates that were expanded."""
    created, expanded = [], set()  # (score, id, token, parent_id, depth)
    top = heapq.nlargest(topk, range(VOCAB), key=lambda v: (table[root_token][v], -v))
    frontier = []
    for v in top:
        created.append((table[root_token][v], len(created), v, -1, 1))
        frontier.append(created[-1])
    for d in range(2, depth + 1):
        expanded |= {c[1] for c in frontier}
        children = []
        for score, cid, token, _, _ in frontier:
            for v in heapq.nlargest(topk, range(VOCAB), key=lambda v, t=token: (table[t][v], -v)):
                created.append((score + table[token][v], len(created), v, cid, d))
                children.append(created[-1])
        frontier = sorted(children, key=lambda c: (-c[0], c[1]))[:topk]
    return sorted(sorted(created, key=lambda c: (-c[0], c[1]))[:num_nodes], key=lambda c: c[1]), expanded


@pytest.mark.parametrize("depth,topk,num_nodes", [(1, 3, 2), (3, 3, 8), (4, 4, 20), (5, 2, 13)])
def test_dynamic_tree_matches_brute_force(depth, topk, num_nodes):
    gen = torch.Generator().manual_seed(depth * 10 + topk)
    table = torch.randn(VOCAB, VOCAB, generator=gen).mul(2).log_softmax(-1)
    step, calls = bigram_step(table)
    roots = torch.tensor([3, 7])
    tree = grow_dynamic_tree(roots, table[roots], step, depth, topk, num_nodes, keep_probs=True)
    assert len(calls) == depth - 1 and [c[2] for c in calls] == list(range(1, depth))
    assert (calls[0][1] == -1).all() if calls else True
    assert tree.tokens.shape == (2, num_nodes + 1)
    tl = table.tolist()
    for b, root in enumerate(roots.tolist()):
        kept, expanded = brute_force_dynamic(root, tl, depth, topk, num_nodes)
        node_of = {c[1]: n + 1 for n, c in enumerate(kept)}
        assert tree.tokens[b, 1:].tolist() == [c[2] for c in kept]
        assert tree.parents[b, 1:].tolist() == [node_of.get(c[3], 0) if c[3] >= 0 else 0 for c in kept]
        assert all(c[3] < 0 or c[3] in node_of for c in kept)  # ancestors kept
        assert tree.depths[b, 1:].tolist() == [c[4] for c in kept]
        torch.testing.assert_close(tree.scores[b, 1:], torch.tensor([c[0] for c in kept]))
        # child_probs: the draft distribution at every node that was expanded, zeros elsewhere
        for n in range(num_nodes + 1):
            probs = tree.child_probs[b, n]
            was_expanded = n == 0 or kept[n - 1][1] in expanded
            want = table[tree.tokens[b, n]].exp() if was_expanded else torch.zeros(VOCAB)
            torch.testing.assert_close(probs, want)
            # child_ranked: the drafter's whole top-k there, best first, kept as children or not
            ranked = table[tree.tokens[b, n]].topk(topk).indices.tolist() if was_expanded else [-1] * topk
            assert tree.child_ranked[b, n].tolist() == ranked


def test_dynamic_tree_frontier_parents_index_the_previous_frontier():
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1)).log_softmax(-1)
    step, calls = bigram_step(table)
    grow_dynamic_tree(torch.tensor([1]), table[[1]], step, depth=3, topk=3, num_nodes=6)
    (tokens1, _, _), (tokens2, parent2, _) = calls
    for k in range(3):
        assert int(tokens2[0, k]) in table[tokens1[0, parent2[0, k]]].topk(3).indices.tolist()


def test_static_and_chain_shapes():
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(2)).log_softmax(-1)
    step, calls = bigram_step(table)
    tree = static_tree(torch.tensor([0, 5]), table[[0, 5]], step, [2, 2, 1, 1])
    assert tree.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert tree.depths[0].tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4]
    assert [c[0].shape[1] for c in calls] == [2, 4, 4] and calls[0][1].eq(-1).all()
    assert calls[1][1][0].tolist() == [0, 0, 1, 1]  # index into the previous frontier
    for b in range(2):
        for i in range(1, tree.num_nodes):
            parent = int(tree.parents[b, i])
            lp = table[tree.tokens[b, parent], tree.tokens[b, i]]
            torch.testing.assert_close(tree.scores[b, i], tree.scores[b, parent] + lp)
        assert tree.tokens[b, 1:3].tolist() == table[tree.tokens[b, 0]].topk(2).indices.tolist()
        for i in range(tree.num_nodes):  # every node above the last depth ranked its top-2; leaves -1
            ranked = table[tree.tokens[b, i]].topk(2).indices.tolist() if tree.depths[b, i] < 4 else [-1, -1]
            assert tree.child_ranked[b, i].tolist() == ranked
    chain = chain_tree(torch.tensor([4]), table[[4]], step, 5)
    assert chain.parents[0].tolist() == [-1, 0, 1, 2, 3, 4] and chain.depth == 5
    for i in range(1, 6):
        assert int(chain.tokens[0, i]) == int(table[chain.tokens[0, i - 1]].argmax())


def test_sampled_static_tree_draws_distinct_children_from_the_draft():
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3)).log_softmax(-1)
    step, _ = bigram_step(table)
    roots = torch.full((4000,), 2)
    tree = static_tree(roots, table[roots], step, [3], keep_probs=True, sample=True,
                       generator=torch.Generator().manual_seed(0))
    assert tree.sampled and torch.allclose(tree.child_probs[:, 0], table[2].exp().expand(4000, -1))
    children = tree.tokens[:, 1:]
    assert bool((children[:, 0] != children[:, 1]).all() & (children[:, 1] != children[:, 2]).all())
    first_draw = torch.bincount(children[:, 0], minlength=VOCAB).float() / 4000
    assert (first_draw - table[2].exp()).abs().max() < 0.03  # the first draw follows q


def test_growth_rejects_bad_arguments():
    table = torch.zeros(VOCAB, VOCAB).log_softmax(-1)
    step, _ = bigram_step(table)
    with pytest.raises(ValueError, match="num_nodes"):
        grow_dynamic_tree(torch.tensor([0]), table[[0]], step, depth=2, topk=2, num_nodes=7)
    with pytest.raises(ValueError, match="branching"):
        static_tree(torch.tensor([0]), table[[0]], step, [2, 0])
    with pytest.raises(ValueError, match="step_fn at depth 1"):
        static_tree(torch.tensor([0]), table[[0]], lambda t, p, d: table[:5], [2, 2])
