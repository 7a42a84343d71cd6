"""Each Triton kernel equals its torch reference on random inputs (Triton interpreted on CPU)."""

import pytest
import torch

from specdistill.decode import kernels
from specdistill.decode.kernels import reference
from specdistill.decode.kernels import triton_kernels as triton_impl
from specdistill.decode.tree import random_tree

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 1), (2, 7), (3, 33), (2, 70)]  # (batch, nodes): a lone root, < 32, just over 32, > 64


def _links(tree):
    _, next_token, next_sibling = reference.build_tree_tensors(tree.parents)
    return next_token, next_sibling


@pytest.mark.parametrize("batch,nodes", SHAPES)
def test_build_tree_tensors_matches_reference(batch, nodes):
    tree = random_tree(batch, nodes, 50, torch.Generator().manual_seed(nodes), device=DEVICE)
    expected = reference.build_tree_tensors(tree.parents)
    got = triton_impl.build_tree_tensors(tree.parents)
    names = ("mask", "next_token", "next_sibling")
    for name, want, have in zip(names, expected, got):
        assert have.dtype == want.dtype, name
        assert torch.equal(have, want), name


def _path_following_argmax(tree, generator, vocab):
    """Target argmax that agrees with the tree along a random path most of the time, so walks go deep."""
    argmax = torch.randint(0, vocab, tree.tokens.shape, generator=generator).to(DEVICE)
    child_token = torch.full_like(argmax, -1)
    child_token.scatter_(1, tree.parents[:, 1:].clamp(min=0), tree.tokens[:, 1:])  # some child's token
    follow = torch.rand(tree.tokens.shape, generator=generator).to(DEVICE) < 0.8
    return torch.where(follow & (child_token >= 0), child_token, argmax)


@pytest.mark.parametrize("batch,nodes", SHAPES)
def test_greedy_verify_matches_reference(batch, nodes):
    gen = torch.Generator().manual_seed(100 + nodes)
    tree = random_tree(batch, nodes, 4, gen, device=DEVICE)
    argmax = _path_following_argmax(tree, gen, 4)
    next_token, next_sibling = _links(tree)
    for slots in (tree.depth + 1, 2):  # full depth, and a verdict cut short
        expected = reference.greedy_verify(tree.tokens, next_token, next_sibling, argmax, slots)
        got = triton_impl.greedy_verify(tree.tokens, next_token, next_sibling, argmax, slots)
        for want, have in zip(expected, got):
            assert torch.equal(have, want)
    assert int(expected[1].max()) >= 1 or nodes == 1  # the inputs do exercise acceptance


@pytest.mark.parametrize("with_draft", [False, True])
@pytest.mark.parametrize("batch,nodes,vocab", [(1, 1, 5), (4, 9, 7), (3, 20, 1500)])
def test_rejection_sample_matches_reference(batch, nodes, vocab, with_draft):
    gen = torch.Generator().manual_seed(nodes * vocab)
    tree = random_tree(batch, nodes, min(vocab, 6), gen, device=DEVICE)
    target = (torch.rand(batch, nodes, vocab, generator=gen) ** 3).to(DEVICE)
    target[..., 0] = 0.0  # a token the target never takes
    target = target / target.sum(-1, keepdim=True)
    target[..., 1:6] += 1.0  # most of the mass on the tokens trees hold, so candidates get accepted
    target = target / target.sum(-1, keepdim=True)
    draft = torch.rand(batch, nodes, vocab, generator=gen).to(DEVICE)
    draft = draft / draft.sum(-1, keepdim=True) if with_draft else None
    next_token, next_sibling = _links(tree)
    accepted = 0
    for _ in range(8):
        coins = torch.rand(batch, nodes, generator=gen).to(DEVICE)
        final_u = torch.rand(batch, generator=gen).to(DEVICE)
        args = (tree.tokens, next_token, next_sibling, target, draft, coins, final_u, tree.depth + 1)
        expected = reference.rejection_sample(*args)
        got = triton_impl.rejection_sample(*args)
        for want, have in zip(expected, got):
            assert torch.equal(have, want)
        accepted += int(expected[1].sum())
        assert not bool((expected[2][torch.arange(batch), expected[1]] == 0).any())  # bonus never the 0-prob token
    assert accepted > 0 or nodes == 1


@pytest.mark.parametrize("batch,heads,length,dim", [(1, 1, 12, 4), (3, 2, 40, 16), (2, 3, 80, 20)])
def test_compact_kv_matches_reference(batch, heads, length, dim):
    gen = torch.Generator().manual_seed(length)
    tree_start = length // 4
    tree = random_tree(batch, length - tree_start, 50, gen, device=DEVICE)
    argmax = _path_following_argmax(tree, gen, 50)
    next_token, next_sibling = _links(tree)
    accept_nodes, _, _ = reference.greedy_verify(tree.tokens, next_token, next_sibling, argmax, tree.depth + 1)
    keys = torch.randn(batch, heads, length, dim, generator=gen).to(DEVICE)
    values = torch.randn(batch, heads, length, dim, generator=gen).to(DEVICE)
    want_k, want_v, have_k, have_v = keys.clone(), values.clone(), keys.clone(), values.clone()
    reference.compact_kv(want_k, want_v, tree_start, accept_nodes)
    triton_impl.compact_kv(have_k, have_v, tree_start, accept_nodes)
    assert torch.equal(have_k, want_k) and torch.equal(have_v, want_v)
    slots = torch.arange(accept_nodes.shape[1], device=DEVICE)
    assert bool(((accept_nodes >= 0) & (accept_nodes != slots)).any())  # something did move


def test_dispatch_follows_device_and_forced_backend():
    tree = random_tree(2, 5, 10, torch.Generator().manual_seed(0), device=DEVICE)
    try:
        for backend in ("auto", "torch", "triton"):
            kernels.set_backend(backend)
            assert torch.equal(kernels.build_tree_tensors(tree.parents)[0], reference.build_tree_tensors(tree.parents)[0])
        kernels.set_backend("triton")
        assert kernels._implementation(tree.parents) is triton_impl
        kernels.set_backend("auto")
        assert kernels._implementation(tree.parents) is (triton_impl if DEVICE == "cuda" else reference)
        with pytest.raises(ValueError, match="expected one of"):
            kernels.set_backend("cuda")
    finally:
        kernels.set_backend("auto")
