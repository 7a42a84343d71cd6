"""Speculative generation on a real (tiny random) target: lossless at temperature 0 for every drafter,
batch 1 and batch > 1; the target's distribution at temperature > 0 (chi-square on a tiny vocabulary)."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.config import HeadConfig, TargetConfig
from specdistill.decode.drafters import Drafter, HeadProposer, LookupProposer
from specdistill.decode.loop import GenerationStats, _record_hits, plain_generate, speculative_generate
from specdistill.decode.tree import Tree
from specdistill.decode.verify import GREEDY, Sampling, Verdict
from specdistill.heads.build import build_head
from specdistill.target import Target, load_target
from specdistill.target_runner import TargetRunner

TEXTS = ["Tell me a story about a dragon", "2+2=", "Write a poem about the sea, the sky and the wind"]
MAX_NEW = 16


@pytest.fixture(scope="module")
def setup():
    target = load_target(TargetConfig(name="random"))
    prompts = [target.prompt_ids(t) for t in TEXTS]
    reference = [plain_generate(target.model, [p], MAX_NEW, target.eos_ids)[0] for p in prompts]
    return target, TargetRunner(target), prompts, reference


def head_for(target: Target, kind: str, reference: list[list[int]], **head_fields):
    """A random head whose draft vocabulary is what the target writes, so some drafts get accepted."""
    ids = torch.tensor(sorted({t for r in reference for t in r} | {0, 1, 2}))
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    torch.manual_seed(0)
    return build_head(HeadConfig(kind=kind, **head_fields), target, ids - torch.arange(len(ids)), t2d).eval()


def decode_all(runner, proposer, prompts, batch_size, eos, sampling=GREEDY):
    tokens, accepted = [], []
    for i in range(0, len(prompts), batch_size):
        stats = speculative_generate(runner, proposer, prompts[i : i + batch_size], MAX_NEW, eos, sampling)
        assert stats.target_forwards == 1 + max(len(a) for a in stats.accepted)
        tokens += stats.tokens
        accepted += stats.accepted
    return tokens, accepted


def test_batched_plain_decoding_equals_one_prompt_at_a_time(setup):
    target, _, prompts, reference = setup
    assert plain_generate(target.model, prompts, MAX_NEW, target.eos_ids) == reference
    assert all(len(r) == MAX_NEW for r in reference)


@pytest.mark.parametrize("kind, batch_size", [("eagle3", 1), ("eagle3", 3), ("mtp", 3)])
def test_tree_speculation_equals_greedy_decoding(setup, kind, batch_size):
    target, runner, prompts, reference = setup
    proposer = HeadProposer(head_for(target, kind, reference), target.vocab_size, "tree", 3, 4, 12)
    tokens, accepted = decode_all(runner, proposer, prompts, batch_size, target.eos_ids)
    assert tokens == reference
    assert sum(map(sum, accepted)) > 0  # drafts were accepted, so compaction and stale slots were exercised


def test_head_chain_equals_greedy_decoding_in_a_batch(setup):
    target, runner, prompts, reference = setup
    proposer = HeadProposer(head_for(target, "eagle3", reference), target.vocab_size, "chain", 4)
    tokens, _ = decode_all(runner, proposer, prompts, 3, target.eos_ids)
    assert tokens == reference


def test_the_drafter_reads_the_features_through_an_eagle31_heads_norms(setup):
    target, runner, prompts, reference = setup
    head = head_for(target, "eagle3", reference, fc_norm=True)  # built from `head.fc_norm=true`
    with torch.no_grad():
        for norm in head.fc_norm:
            norm.weight.copy_(1 + 0.3 * torch.randn_like(norm.weight))
    aux = runner(torch.tensor([prompts[0]]), with_logits=False).aux_BTA  # the target's captured layers

    def drafted(h, aux_BTA):
        """The log-probs of the first draft after the prompt."""
        return Drafter(h, target.vocab_size).extend(aux_BTA, None, torch.tensor([prompts[0][1:] + [0]]), 0)

    ours = drafted(head, aux)
    # a captured layer's scale stops at its norm, so it cannot outweigh the others in fc
    scaled = aux * torch.tensor([5.0, 1.0, 3.0]).repeat_interleave(target.hidden_size)
    torch.testing.assert_close(drafted(head, scaled), ours, rtol=1e-4, atol=1e-4)
    # the norms' weights reach the draft: folded into fc instead, the same drafts
    folded = copy.deepcopy(head)
    with torch.no_grad():
        folded.fc.weight.mul_(torch.cat([norm.weight for norm in head.fc_norm]))
        for norm in folded.fc_norm:
            norm.weight.fill_(1.0)
    torch.testing.assert_close(drafted(folded, aux), ours, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(drafted(head_for(target, "eagle3", reference), aux), ours)  # without: others


def test_prompt_lookup_is_lossless_and_accepts_repeats(setup):
    target, runner, prompts, reference = setup
    tokens, accepted = decode_all(runner, LookupProposer(5, 3), prompts, 3, target.eos_ids)
    assert tokens == reference
    per_row = [sum(a) / len(a) for a in accepted]
    assert max(per_row) > 1.0 and len(set(per_row)) > 1  # rows accept different lengths


def test_hits_rank_the_target_token_in_the_drafters_top_k_not_among_the_kept_children():
    # root 9 -> node 1 (token 4) -> node 2 (token 6); the drafter ranked [4, 5, 7] at the root and
    # [3, 6, 8] at node 1, of which the tree kept one child each; node 2 was never expanded
    tree = Tree(torch.tensor([[9, 4, 6]]), torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]), torch.zeros(1, 3),
                child_ranked=torch.tensor([[[4, 5, 7], [3, 6, 8], [-1, -1, -1]]]))
    stats = GenerationStats(tokens=[[]], accepted=[[]])
    # the target took 4, then 8: the drafter's third choice at node 1, which the tree did not keep
    _record_hits(stats, tree, Verdict(torch.tensor([[0, 1, -1]]), torch.tensor([1]), torch.tensor([[4, 8, -1]])), 0)
    assert stats.hits == [(1, 3, 0), (2, 3, 2)]
    stats.hits.clear()  # the whole chain accepted: node 2's children were never ranked, so no depth-3 hit
    _record_hits(stats, tree, Verdict(torch.tensor([[0, 1, 2]]), torch.tensor([2]), torch.tensor([[4, 6, 11]])), 0)
    assert stats.hits == [(1, 3, 0), (2, 3, 1)]


def test_lookup_continuation_takes_the_latest_match():
    lookup = LookupProposer(num_tokens=3, max_ngram=2)
    assert lookup.continuation([5, 6, 7, 8, 5, 6, 9, 1, 5, 6]) == [9, 1, 5]
    assert lookup.continuation([1, 2, 3]) == []


# ---------------------------------------------------------------- sampling keeps the target distribution

VOCAB = 8


@pytest.fixture(scope="module")
def tiny_vocab():
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    model.lm_head.weight.mul_(60)  # peaked, distinct distributions: a biased sampler shows
    target = Target(model=model, tokenizer=None, name="tiny", revision=None, layer_ids=(1, 2, 3))
    head = build_head(HeadConfig(kind="eagle3"), target, torch.zeros(VOCAB, dtype=torch.long),
                      torch.ones(VOCAB, dtype=torch.bool)).eval()
    return target, head


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 1e-4
    assert int(counts[~support].sum()) <= 2, "tokens of ~zero target probability were produced"
    expected = probs[support] * counts.sum()
    statistic = ((counts[support].double() - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64), statistic / 2))


@pytest.mark.parametrize("shape", ["tree", "sampled", "chain"])
def test_sampling_keeps_the_target_distribution(tiny_vocab, shape):
    """The second generated token (the first one a verifier decides) must follow the target's marginal
    sum_x1 p(x1 | prompt) p(x2 | prompt, x1), whatever the drafter proposes."""
    target, head = tiny_vocab
    prompt = [1, 5, 2, 7]
    with torch.no_grad():
        p1 = target.model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        after = torch.tensor([prompt + [x] for x in range(VOCAB)])
        p2 = (p1[:, None] * target.model(after).logits[:, -1].softmax(-1)).sum(0)
    proposer = HeadProposer(head, VOCAB, shape, depth=2, topk=3, num_nodes=5, branching=[2, 2])
    draws = 600
    stats = speculative_generate(TargetRunner(target), proposer, [prompt] * draws, 3, set(), Sampling(1.0),
                                 torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor([t[1] for t in stats.tokens]), minlength=VOCAB)
    assert chi_square_p_value(counts, p2) > 1e-3, (counts.tolist(), (p2 * draws).round().tolist())
    assert sum(map(sum, stats.accepted)) > 0  # drafts were accepted, not only bonus tokens
