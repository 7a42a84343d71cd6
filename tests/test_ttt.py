"""The Training-Time Test: attention against an explicit-mask reference, gradients, and train/draft agreement."""

import dataclasses

import pytest
import torch

from specdistill.decode.drafters import Drafter
from specdistill.heads.dflash import DFlashConfig, DFlashHead
from specdistill.heads.eagle3 import Eagle3Config, Eagle3Head
from specdistill.heads.layers import HeadArch, ttt_attention
from specdistill.heads.mtp import MTPConfig, MTPHead
from specdistill.train.loss import LOSSES
from specdistill.train.teacher import Teacher, TeacherTargets
from specdistill.train.ttt import TTTBatch, causal_mask, teacher_rows, trained_window, unroll_ttt

HEAD_KINDS = ["eagle3", "peagle", "mtp", "mtp3"]


def tiny_head(kind="eagle3", vocab=96, draft=48, hidden=32, seed=0, num_layers=2):
    torch.manual_seed(seed)
    arch = HeadArch(hidden_size=hidden, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    common = dict(arch=arch, vocab_size=vocab, draft_vocab_size=draft, target_hidden_size=hidden,
                  aux_layer_ids=[1, 2, 3], target_num_layers=6)
    if kind in ("eagle3", "peagle"):
        parallel = {"parallel_drafting": True, "mask_token_id": vocab - 1} if kind == "peagle" else {}
        head = Eagle3Head(Eagle3Config(**common, **parallel))
    elif kind == "dflash":  # blocks of the bonus and 3 masks; `num_layers` its layers
        head = DFlashHead(DFlashConfig(**common, mask_token_id=vocab - 1, block_size=4, num_layers=num_layers))
    else:
        head = MTPHead(MTPConfig(**common, num_modules=3 if kind == "mtp3" else 1))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ids = torch.sort(torch.randperm(vocab)[:draft]).values
    head.d2t.copy_(ids - torch.arange(draft))
    head.t2d.zero_()
    head.t2d[ids] = True
    return head


def naive_ttt_attention(q, keys, values, mask0):
    """Explicit mask over the concatenated keys of all steps: causal on step 0, diagonal on the rest."""
    T = q.shape[2]
    eye = torch.eye(T, dtype=torch.bool)
    mask = torch.cat([mask0] + [eye.expand_as(mask0)] * (len(keys) - 1), dim=-1)
    scores = q @ torch.cat(keys, 2).transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ torch.cat(values, 2)


def test_ttt_attention_equals_explicit_mask_and_its_gradients():
    torch.manual_seed(0)
    B, N, T, E = 2, 3, 7, 8
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 5:] = False
    mask0 = causal_mask(valid)
    for steps in (1, 2, 4):
        q = torch.randn(B, N, T, E, dtype=torch.float64, requires_grad=True)
        keys = [torch.randn(B, N, T, E, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
        values = [torch.randn(B, N, T, E, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
        fast = ttt_attention(q, keys, values, mask0)
        slow = naive_ttt_attention(q, keys, values, mask0)
        rows = valid[:, None, :, None].expand_as(fast)
        torch.testing.assert_close(fast[rows], slow[rows], atol=1e-5, rtol=1e-5)
        grads_fast = torch.autograd.grad((fast[rows] ** 2).sum(), [q, *keys, *values])
        grads_slow = torch.autograd.grad((slow[rows] ** 2).sum(), [q, *keys, *values])
        for gf, gs in zip(grads_fast, grads_slow):
            torch.testing.assert_close(gf, gs, atol=1e-5, rtol=1e-5)


def random_teacher(B, T, head) -> TeacherTargets:
    logits = torch.randn(B, T, head.config.draft_vocab_size) * 10
    logp = torch.log_softmax(logits, -1)
    draft_arg = logits.argmax(-1)
    return TeacherTargets(logp, logp.exp() * 0.9, head.draft_to_target(draft_arg), torch.ones(B, T, dtype=torch.bool))


def random_batch(B, T, head, seed=1) -> TTTBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, head.config.vocab_size, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * head.config.target_hidden_size, generator=g)
    last = torch.randn(B, T, head.config.target_hidden_size, generator=g)
    return TTTBatch(ids, torch.ones(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.bool), aux, last)


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_unroll_learns_a_fixed_batch_for_every_loss(kind):
    for loss in LOSSES:
        head = tiny_head(kind)
        batch, teacher = random_batch(2, 12, head), None
        teacher = random_teacher(2, 12, head)
        opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
        first = None
        for _ in range(60):
            r = unroll_ttt(head, batch, teacher, steps=3, step_weight=0.8, loss_fn=LOSSES[loss])
            opt.zero_grad()
            r.loss.backward()
            opt.step()
            first = first if first is not None else float(r.loss.detach())
        assert float(r.loss.detach()) < 0.5 * first, (loss, first, float(r.loss.detach()))
        assert r.step_acc.shape == (3,) and 0 <= r.step_acc.min() and r.step_acc.max() <= 1
        assert head.embed_tokens.weight.grad is None  # the target embedding stays frozen


def naive_unroll(head, batch, teacher, steps, step_weight, loss_fn):
    """Every step at every position, explicit attention: what `unroll_ttt` must equal on right-padded rows."""
    ids, valid = batch.input_ids_BT, batch.valid_BT
    B, T = ids.shape
    mask0 = causal_mask(valid)
    attn, keys, values = head.attention(), [], []

    def attend(q, k, v):
        keys.append(attn.expand_kv(k))
        values.append(attn.expand_kv(v))
        return naive_ttt_attention(q, keys, values, mask0)

    hidden, total = head.initial_hidden(batch.aux_BTA, batch.last_BTH), 0.0
    for j in range(steps):
        tokens = torch.cat([ids[:, 1 + j:], torch.zeros(B, 1 + j, dtype=ids.dtype)], 1)
        if j:
            tokens, hidden = head.step_input(tokens, hidden, j)
        hidden = head.step(tokens, hidden, torch.arange(T).expand(B, T) + j, attend, depth=j)
        logits = head.logits(hidden, depth=j)[:, : T - 2 - j]
        counted = (batch.loss_mask_BT[:, 2 + j:] > 0) & valid[:, : T - 2 - j] & valid[:, 2 + j:]
        per_pos = loss_fn(logits, teacher.logp_BTV[:, 1 + j : T - 1])
        total = total + step_weight**j * (per_pos * counted).sum() / counted.sum().clamp(min=1)
    return total


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_later_steps_only_where_trained_equal_every_step_everywhere(kind):
    """Prompts without loss and padding: running steps >= 1 only over the trained range changes nothing."""
    head = tiny_head(kind)
    B, T, steps = 3, 18, 4
    batch, teacher = random_batch(B, T, head), random_teacher(B, T, head)
    batch.loss_mask_BT[:, :10] = 0  # a prompt: later steps start at position 10 - 2 - 3 = 5
    batch.loss_mask_BT[1, 13:] = 0  # a row whose only trained tokens sit early
    batch.valid_BT[2, 15:] = False  # padding
    batch.loss_mask_BT[2, 15:] = 0
    batch.loss_mask_BT[0] = 0  # and a row with nothing to train
    assert trained_window(batch.loss_mask_BT[:, 2 + 1:] > 0) != (0, T)  # the range is narrower than the row
    params = [p for p in head.parameters() if p.requires_grad]
    fast = unroll_ttt(head, batch, teacher, steps, 0.8, LOSSES["forward_kl"]).loss
    slow = naive_unroll(head, batch, teacher, steps, 0.8, LOSSES["forward_kl"])
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    for g_fast, g_slow in zip(torch.autograd.grad(fast, params), torch.autograd.grad(slow, params)):
        torch.testing.assert_close(g_fast, g_slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_drafting_reproduces_the_training_unroll(kind):
    """Chain-drafting along the ground-truth tokens must give the TTT unroll's logits at each step."""
    head = tiny_head(kind).eval()
    T, steps = 10, 3
    batch = random_batch(1, T, head)
    logits_per_step = []

    def record(fn):
        def loss_fn(logits, target):
            logits_per_step.append(logits.detach())
            return fn(logits, target)
        return loss_fn

    with torch.no_grad():
        unroll_ttt(head, batch, random_teacher(1, T, head), steps, 0.8, record(LOSSES["forward_kl"]))
    ids = batch.input_ids_BT
    t = 5  # a position with room for `steps` more tokens
    drafter = Drafter(head, head.config.vocab_size)
    root_logp = drafter.extend(batch.aux_BTA[:, : t + 1], batch.last_BTH[:, : t + 1], ids[:, 1 : t + 2], 0)
    expected = torch.log_softmax(logits_per_step[0][:, t], -1)
    torch.testing.assert_close(root_logp[..., head.draft_to_target(torch.arange(48))], expected, atol=1e-5, rtol=1e-5)
    parent = torch.full((1, 1), -1)
    for j in range(1, steps):
        logp = drafter.step(ids[:, t + 1 + j : t + 2 + j], parent, depth=j)
        expected = torch.log_softmax(logits_per_step[j][:, t], -1)
        torch.testing.assert_close(logp[..., head.draft_to_target(torch.arange(48))][:, 0], expected, atol=1e-5, rtol=1e-5)
        parent = torch.zeros(1, 1, dtype=torch.long)


def unrolled_logits(head, batch, steps):
    """The logits `unroll_ttt` computes at each step (one [B, M, V] per step)."""
    per_step = []

    def record(logits, target):
        per_step.append(logits.detach())
        return LOSSES["forward_kl"](logits, target)

    with torch.no_grad():
        unroll_ttt(head, batch, random_teacher(*batch.input_ids_BT.shape, head), steps, 0.8, record)
    return per_step


def test_peagle_steps_are_vllms_one_causal_forward_over_mask_slots():
    """P-EAGLE's step j at position t is what vLLM computes in one forward: slots 0..t read (x[s+1], fc(aux[s])),
    then j mask slots read (mask token, fc(mask_hidden)) at positions t+1..t+j, all under one causal mask. The
    same weights unrolled as EAGLE-3 (each step reading the previous draft) do not give it."""
    head = tiny_head("peagle").eval()
    T, steps, t = 10, 3, 5
    batch = random_batch(1, T, head)
    ids, mask_id = batch.input_ids_BT, head.config.mask_token_id
    with torch.no_grad():
        tokens = torch.cat([ids[:, 1 : t + 2], torch.full((1, steps - 1), mask_id)], 1)
        hidden = torch.cat([head.fc(batch.aux_BTA[:, : t + 1]), head.fc(head.mask_hidden)[None].expand(1, steps - 1, -1)], 1)
        attn = head.attention()
        causal = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q, attn.expand_kv(k), attn.expand_kv(v), is_causal=True)
        out = head.step(tokens, hidden, torch.arange(t + steps)[None], causal)
        served = [head.logits(out[:, t + j]) for j in range(steps)]
    unrolled = unrolled_logits(head, batch, steps)
    for j in range(steps):
        torch.testing.assert_close(unrolled[j][:, t], served[j], atol=1e-5, rtol=1e-5)
    head.config.parallel_drafting = False  # the same weights as EAGLE-3: later steps read the drafts instead
    as_eagle3 = unrolled_logits(head, batch, steps)
    torch.testing.assert_close(as_eagle3[0][:, t], served[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(as_eagle3[1][:, t], served[1], atol=1e-3)


def test_mtp_modules_shapes_and_separate_weights_per_step():
    head = tiny_head("mtp3")
    assert len(head.mtp) == 3
    assert head.mtp[0].eh_proj.weight.shape == (32, 64)
    dicts = head.module_state_dicts()
    assert len(dicts) == 3 and {"eh_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "lm_head.weight",
                                "embed_tokens.weight", "layers.0.self_attn.q_proj.weight"} <= dicts[0].keys()
    batch, teacher = random_batch(1, 8, head), random_teacher(1, 8, head)
    r = unroll_ttt(head, batch, teacher, steps=3, step_weight=0.8, loss_fn=LOSSES["forward_kl"])
    r.loss.backward()
    assert all(m.eh_proj.weight.grad is not None and m.eh_proj.weight.grad.abs().sum() > 0 for m in head.mtp)


def test_teacher_on_the_read_rows_only_changes_nothing_the_unroll_sees():
    """The teacher skips the prompt rows (`teacher_rows`): loss, metrics and gradients stay the same."""
    torch.manual_seed(0)
    head = tiny_head("eagle3", hidden=16)
    B, T, vocab = 2, 14, head.config.vocab_size
    batch = random_batch(B, T, head)
    batch.loss_mask_BT[:, :5] = 0  # a prompt
    batch.loss_mask_BT[1, 9:] = 0
    batch.valid_BT[1, 11:] = False  # padding
    teacher = Teacher(torch.nn.RMSNorm(16), torch.randn(vocab, 16), head.d2t, head.t2d, chunk=40)
    rows = teacher_rows(batch)
    assert rows[:, :4].sum() == 0 and rows[0, 4:13].all() and not rows[:, -1].any()
    full, picked = teacher.from_last(batch.last_BTH, torch.ones_like(rows)), teacher.from_last(batch.last_BTH, rows)
    logits = torch.nn.functional.linear(torch.nn.RMSNorm(16)(batch.last_BTH), teacher.lm_head_weight)
    assert torch.equal(full.argmax_BT, logits.argmax(-1))  # chunked argmax over the whole vocabulary
    for name in ("logp_BTV", "p_full_BTV", "argmax_BT", "covered_BT"):
        torch.testing.assert_close(getattr(picked, name)[rows], getattr(full, name)[rows])
    results = []
    for targets in (full, picked):
        head.zero_grad()
        r = unroll_ttt(head, batch, targets, steps=3, step_weight=0.8, loss_fn=LOSSES["forward_kl"])
        r.loss.backward()
        results.append((r, [p.grad.clone() for p in head.parameters() if p.requires_grad]))
    (a, grads_a), (b, grads_b) = results
    torch.testing.assert_close(a.loss, b.loss)
    for x, y in [(a.step_loss, b.step_loss), (a.step_acc, b.step_acc), (a.step_accept, b.step_accept)]:
        torch.testing.assert_close(x, y)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want).norm() / want.norm())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
def test_fused_attention_on_cuda_equals_explicit_in_float64(dtype, tolerance):
    """The CUDA core (memory-efficient kernel, padded log-sum-exp rows, aligned bias shared by heads)
    against the explicit attention in float64 on the CPU: causal, per-document, and queries on a window
    of the positions under a mask broadcast over the batch; outputs and every gradient."""
    from specdistill.heads.layers import ttt_attention_explicit
    from specdistill.train.ttt import document_mask

    g = torch.Generator().manual_seed(0)
    B, N, T, E, lo = 2, 4, 45, 64, 13  # T and T - lo off every kernel block size
    doc = torch.tensor([[0] * 20 + [1] * 19 + [-1] * 6, [0] * 45])
    window = (torch.arange(T)[None] <= torch.arange(lo, T)[:, None])[None]
    for steps in (1, 3):
        for mask, Q in ((None, T), (document_mask(doc), T), (window, T - lo)):
            shapes = [(B, N, Q, E), (B, N, T, E), *[(B, N, Q, E)] * (steps - 1), (B, N, T, E),
                      *[(B, N, Q, E)] * (steps - 1)]
            want = [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes]
            got = [x.detach().to("cuda", dtype).requires_grad_() for x in want]
            ref = ttt_attention_explicit(want[0], want[1 : 1 + steps], want[1 + steps :], mask)
            out = ttt_attention(got[0], got[1 : 1 + steps], got[1 + steps :], None if mask is None else mask.cuda())
            assert relative_error(out, ref) < tolerance
            weights = torch.randn(ref.shape, generator=g, dtype=torch.float64)
            ref_grads = torch.autograd.grad((ref * weights).sum(), want)
            out_grads = torch.autograd.grad((out * weights.to("cuda", dtype)).sum(), got)
            for a, b in zip(out_grads, ref_grads):
                assert relative_error(a, b) < tolerance


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_unroll_on_cuda_equals_cpu(kind):
    """A whole TTT unroll (prompt, padding, later steps over a window) gives the CPU's loss and gradients."""
    head = tiny_head(kind)
    B, T, steps = 3, 18, 4
    batch, teacher = random_batch(B, T, head), random_teacher(B, T, head)
    batch.loss_mask_BT[:, :10] = 0
    batch.valid_BT[2, 15:] = False
    batch.loss_mask_BT[2, 15:] = 0
    params = [p for p in head.parameters() if p.requires_grad]
    cpu = unroll_ttt(head, batch, teacher, steps, 0.8, LOSSES["forward_kl"]).loss
    cpu_grads = torch.autograd.grad(cpu, params)
    head.cuda()
    gpu = unroll_ttt(head, on_cuda(batch), on_cuda(teacher), steps, 0.8, LOSSES["forward_kl"]).loss
    assert relative_error(gpu, cpu.double()) < 1e-3
    for a, b in zip(torch.autograd.grad(gpu, params), cpu_grads):
        assert relative_error(a, b.double()) < 1e-3


def on_cuda(tensors):
    """A copy of a dataclass of tensors with every tensor on the GPU."""
    return type(tensors)(**{f.name: getattr(tensors, f.name).cuda() if isinstance(getattr(tensors, f.name), torch.Tensor)
                            else getattr(tensors, f.name) for f in dataclasses.fields(tensors)})
