"""Draft vocabulary: top-N loss-masked tokens sorted by id, d2t offsets, t2d, coverage, padding."""

import pytest
import torch

from specdistill.data.vocab import DraftVocab, build_draft_vocab, count_tokens


def test_counts_only_loss_masked_tokens():
    counts = count_tokens([[1, 2, 2, 3], [3, 3]], [[0, 1, 1, 0], [1, 0]], vocab_size=5)
    assert counts.tolist() == [0, 0, 2, 1, 0]


def test_top_n_sorted_by_id_with_offsets_and_coverage():
    counts = torch.tensor([5, 0, 9, 1, 7, 0, 3], dtype=torch.int64)
    vocab = build_draft_vocab(counts, 3)
    assert vocab.target_ids_N.tolist() == [0, 2, 4]  # the three most frequent, ascending
    assert vocab.d2t_N.tolist() == [0, 1, 2]  # target_id - draft_index
    assert vocab.t2d_V.tolist() == [True, False, True, False, True, False, False]
    assert vocab.coverage == pytest.approx(21 / 25)
    assert vocab.d2t_N.dtype == torch.int64 and vocab.t2d_V.dtype == torch.bool


def test_ties_prefer_lower_ids():
    vocab = build_draft_vocab(torch.tensor([1, 4, 4, 4, 0]), 2)
    assert vocab.target_ids_N.tolist() == [1, 2]


def test_size_beyond_distinct_tokens_pads_with_lowest_unseen_ids():
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[7, 9]] = torch.tensor([3, 5])
    vocab = build_draft_vocab(counts, 4)
    assert vocab.size == 4
    assert vocab.target_ids_N.tolist() == [0, 1, 7, 9]
    assert vocab.coverage == 1.0


def test_size_out_of_range_is_refused():
    with pytest.raises(ValueError, match="draft vocab size 11"):
        build_draft_vocab(torch.ones(10, dtype=torch.int64), 11)


def test_save_load_round_trip(tmp_path):
    vocab = build_draft_vocab(torch.tensor([3, 1, 0, 8, 2]), 3)
    vocab.save(tmp_path / "vocab.safetensors")
    back = DraftVocab.load(tmp_path / "vocab.safetensors")
    assert torch.equal(back.d2t_N, vocab.d2t_N) and torch.equal(back.t2d_V, vocab.t2d_V)
    assert torch.equal(back.counts_V, vocab.counts_V)
