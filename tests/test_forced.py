"""Our chain replayed along an engine's output (the bfloat16 engine check's yardstick), on a real (random) target and
head: along our own greedy output it is our free decode round for round, along another output it commits that output
and drafts at its contexts, and an output it cannot follow is an error, not a quiet count."""

import pytest

from specdistill.decode.drafters import HeadProposer
from specdistill.decode.loop import plain_generate, speculative_generate
from specdistill.engines import EngineError
from specdistill.evaluate.forced import chain_along, detectable_tau_loss, replay_bound
from specdistill.target_runner import TargetRunner
from tests.test_decode import MAX_NEW, tiny_vocab  # noqa: F401 (the module fixture: 8 tokens, so drafts get accepted)

K = 3
PROMPTS = [[1, 5, 2, 7], [3, 3, 6], [4, 0, 1, 6, 5]]


@pytest.fixture(scope="module")
def setup(tiny_vocab):  # noqa: F811
    target, head = tiny_vocab
    reference = [plain_generate(target.model, [p], MAX_NEW, target.eos_ids)[0] for p in PROMPTS]
    return target, head, reference


def test_along_our_own_greedy_output_the_replay_is_our_decode(setup):
    target, head, reference = setup
    free = [speculative_generate(TargetRunner(target), HeadProposer(head, target.vocab_size, "chain", K), [p],
                                 MAX_NEW, target.eos_ids).accepted[0] for p in PROMPTS]
    assert sum(map(sum, free)) > 0, "no draft accepted: the comparison would hold for any replay"
    assert chain_along(target, head, PROMPTS, reference, K, MAX_NEW) == free


def test_along_another_output_the_replay_commits_it(setup):
    target, head, reference = setup
    # each prompt followed by another prompt's answer: not what the target would write, committed all the same
    others = reference[1:] + reference[:1]
    rounds = chain_along(target, head, PROMPTS, others, K, MAX_NEW)
    assert [len(r) + sum(r) for r in rounds] == [len(o) - 1 for o in others]  # the root, then rounds of 1 + accepted


def test_an_output_the_replay_cannot_follow_is_an_error(setup):
    target, head, reference = setup
    eos = min(target.eos_ids)
    cut = [reference[0][:3] + [eos] + reference[0][3:]]  # an end of sequence the engine would not have gone past
    with pytest.raises(EngineError, match="for prompt 0: the replay left it at token 4 of 17"):
        chain_along(target, head, PROMPTS[:1], cut, K, MAX_NEW)


def test_the_bound_shrinks_with_the_square_root_of_the_drafts():
    bound, spread = replay_bound(400)
    assert replay_bound(1600) == pytest.approx((bound / 2, spread / 2))
    assert detectable_tau_loss(400) == pytest.approx(bound + 1.645 * spread)
    assert replay_bound(0) is None
