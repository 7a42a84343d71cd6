"""Sequence packing: a packed row trains exactly like its documents run one by one; the fused TTT
attention core equals the explicit one under a per-document mask, gradients included."""

import torch
from test_ttt import tiny_head

from specdistill.heads.layers import ttt_attention, ttt_attention_explicit
from specdistill.train.data import collate, pack_plan
from specdistill.train.loss import LOSSES
from specdistill.train.teacher import TeacherTargets
from specdistill.train.ttt import document_mask, unroll_ttt

STEPS = 3


def random_document(n: int, head, g: torch.Generator) -> dict:
    H = head.config.target_hidden_size
    return {"input_ids": torch.randint(0, head.config.vocab_size, (n,), generator=g),
            "loss_mask": (torch.rand(n, generator=g) < 0.8).long(), "aux": torch.randn(n, 3 * H, generator=g),
            "last": torch.randn(n, H, generator=g)}


def teacher_of(batch, head) -> TeacherTargets:
    """A teacher that is a fixed function of each token's features, so packing cannot change it."""
    V = head.config.draft_vocab_size
    logits = batch.last_BTH @ torch.linspace(-3, 3, batch.last_BTH.shape[-1] * V).view(-1, V)
    logp = torch.log_softmax(logits, -1)
    return TeacherTargets(logp, logp.exp() * 0.9, head.draft_to_target(logits.argmax(-1)),
                          torch.ones(logits.shape[:2], dtype=torch.bool))


def unroll(head, batch):
    return unroll_ttt(head, batch, teacher_of(batch, head), STEPS, 0.8, LOSSES["forward_kl"])


def test_packed_row_equals_documents_run_separately():
    """Per step, the packed row counts, hits and sums the loss over exactly its documents' positions."""
    head = tiny_head("eagle3")
    g = torch.Generator().manual_seed(3)
    docs = [random_document(n, head, g) for n in (6, 11, 8)]
    packed, _ = collate([docs], "cpu", packed=True)
    assert packed.position_ids_BT[0, 6].item() == 0 and packed.doc_BT[0, -1].item() == 2
    together = unroll(head, packed)
    hits, counted, loss_sum = torch.zeros(STEPS), torch.zeros(STEPS), torch.zeros(STEPS)
    for doc in docs:
        alone = unroll(head, collate([[doc]], "cpu", packed=False)[0])
        hits += alone.step_acc * alone.step_count
        counted += alone.step_count
        loss_sum += alone.step_loss * alone.step_count
    torch.testing.assert_close(together.step_count, counted.double())
    torch.testing.assert_close(together.step_acc * together.step_count, hits.double())
    torch.testing.assert_close(together.step_loss * together.step_count, loss_sum.double(), atol=1e-4, rtol=1e-5)


def test_fused_attention_equals_explicit_under_a_document_mask():
    torch.manual_seed(0)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    mask0 = document_mask(doc)
    B, N, T, E = 2, 3, doc.shape[1], 8
    for steps in (1, 3):
        q = torch.randn(B, N, T, E, dtype=torch.float64, requires_grad=True)
        keys = [torch.randn(B, N, T, E, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
        values = [torch.randn(B, N, T, E, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
        for mask in (mask0, None):
            fused = ttt_attention(q, keys, values, mask)
            explicit = ttt_attention_explicit(q, keys, values, mask)
            torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
            weights = torch.randn_like(fused)
            for a, b in zip(torch.autograd.grad((fused * weights).sum(), [q, *keys, *values]),
                            torch.autograd.grad((explicit * weights).sum(), [q, *keys, *values])):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_pack_plan_fills_rows_and_uses_every_sample_once():
    lengths = {i: n for i, n in enumerate([300, 50, 700, 120, 90, 400, 30, 1500])}
    plan = pack_plan(lengths, 512, seed=0, epoch=0)
    rows = [row for batch in plan for row in batch]
    assert sorted(i for row in rows for i in row) == sorted(lengths)
    assert all(sum(lengths[i] for i in row) <= 512 or len(row) == 1 for row in rows)
    assert len(rows) == 4  # first-fit decreasing: 1500 | 700 | 400+90 | 300+120+50+30
    assert pack_plan(lengths, 512, seed=0, epoch=1) != plan or len(plan) == 1
