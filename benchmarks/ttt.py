"""One TTT training step (k = 7, an EAGLE-3 head for SmolLM2 or Llama-3.1-8B, seq 1024, the first 45% of it a
prompt as in the default data): tokens/s and peak memory of specdistill's unroll against a re-implementation
of the anchors' slow path written here (not the anchors' own code), on the CPU or a GPU.

Baseline ("naive", a re-implementation of the anchors' slow path): teacher logits materialised over the
full target vocabulary ([T, V] fp32, then softmax / log_softmax over it), and per step the full [T, T]
step-0 score matrix concatenated with the diagonal terms of later steps, soft cross-entropy through
autograd's log_softmax.
Ours: `Teacher.from_last` (vocabulary chunks, draft vocab only, only the rows the loss reads: not the
prompt's), `unroll_ttt` with the fused TTT attention (CPU flash or CUDA memory-efficient kernel) and the
soft cross-entropy that keeps no [T, V] copies; fp32, and optionally bf16 autocast.

Method: each variant runs in its own subprocess (so peaks do not mix): build the head and inputs, note
the memory in use (CPU: the resident set size, /proc/self/statm; GPU: allocated bytes), run one step
(teacher + forward + backward), read the peak (CPU: getrusage ru_maxrss; GPU: max_memory_allocated);
peak memory = peak - memory before the step. Then `--repeats` more steps are timed (best of) for
tokens/s. Same config, same seed, same run.

    python benchmarks/ttt.py [--seq 1024] [--repeats 2] [--prompt-share 0.45] [--device cuda] [--scale llama8b]
Ends with: RESULT speedup=<ours/naive tokens/s> memory_ratio=<ours/naive peak>, both in fp32, and
bf16_speedup, bf16_memory_ratio: both in bf16 autocast. Every ratio compares the same precision.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from specdistill.heads.eagle3 import Eagle3Config, Eagle3Head
from specdistill.heads.layers import HeadArch
from specdistill.train.loss import LOSSES
from specdistill.train.teacher import Teacher
from specdistill.train.ttt import TTTBatch, teacher_rows, unroll_ttt

STEPS = 7
BASELINE = "a re-implementation of the anchors' slow path (this file's naive_step), not the anchors' own code"
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SCALES = {  # target vocab, draft vocab, capture layers, target layers, head shape and RoPE (the target's)
    "smollm2": (49152, 8192, [1, 14, 26], 30, HeadArch(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                                       num_key_value_heads=3, head_dim=64,
                                                       rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "llama8b": (128256, 32000, [1, 15, 28], 32, HeadArch(hidden_size=4096, intermediate_size=14336,
                                                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                                         max_position_embeddings=131072, rope_parameters=LLAMA31_ROPE)),
}


def build(seq: int, prompt_share: float, scale: str, device: torch.device):
    torch.manual_seed(0)
    target_vocab, draft_vocab, aux_layers, num_layers, arch = SCALES[scale]
    hidden = arch.hidden_size
    head = Eagle3Head(Eagle3Config(arch=arch, vocab_size=target_vocab, draft_vocab_size=draft_vocab,
                                   target_hidden_size=hidden, aux_layer_ids=aux_layers, target_num_layers=num_layers))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.02)
    draft_ids = torch.sort(torch.randperm(target_vocab)[:draft_vocab]).values
    head.d2t.copy_(draft_ids - torch.arange(draft_vocab))
    head.t2d.zero_()
    head.t2d[draft_ids] = True
    lm_head_W = torch.randn(target_vocab, hidden) * 0.05
    norm = torch.nn.RMSNorm(hidden, eps=1e-5)
    loss_mask = (torch.arange(seq) >= int(prompt_share * seq)).long()[None]
    batch = TTTBatch(*(t.to(device) for t in (torch.randint(0, target_vocab, (1, seq)), loss_mask,
                                              torch.ones(1, seq, dtype=torch.bool), torch.randn(1, seq, 3 * hidden),
                                              torch.randn(1, seq, hidden))))
    return head.to(device), lm_head_W.to(device), norm.to(device), draft_ids.to(device), batch


# ------------------------------------------------------------------ the baseline, written plainly


def naive_attention(q, keys, values):
    """Full step-0 scores [T, T] (causal) concatenated with the diagonal scores of steps 1..j."""
    T = q.shape[2]
    scores = torch.matmul(q, keys[0].transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    diag = [(q * k).sum(-1, keepdim=True) / q.shape[-1] ** 0.5 for k in keys[1:]]
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
    out = torch.matmul(probs[..., :T], values[0])
    for i, v in enumerate(values[1:]):
        out = out + probs[..., T + i:T + i + 1] * v
    return out


def naive_step(head, lm_head_W, norm, draft_ids, batch) -> torch.Tensor:
    ids = batch.input_ids_BT
    B, T = ids.shape
    with torch.no_grad(), torch.autocast(ids.device.type, enabled=False):  # fp32, as the trainer's teacher
        target_logits = norm(batch.last_BTH) @ lm_head_W.T  # [B, T, V] fp32, materialised
        target_p = torch.softmax(target_logits, -1)
        target_argmax = target_logits.argmax(-1)
        covered = head.t2d[target_argmax]
        target_logp = torch.log_softmax(target_logits[..., draft_ids], -1)
    attn = head.attention()
    keys, values = [], []

    def attend(q, k, v):
        keys.append(attn.expand_kv(k))
        values.append(attn.expand_kv(v))
        return naive_attention(q, keys, values)

    def shift(x, s):
        return torch.cat([x[:, s:], torch.zeros_like(x[:, :s])], dim=1)

    hidden = head.initial_hidden(batch.aux_BTA)
    positions = torch.arange(T, device=ids.device).expand(B, T)
    total = 0.0
    for j in range(STEPS):
        hidden = head.step(shift(ids, 1 + j), hidden, positions + j, attend)
        logits = head.logits(hidden)
        mask = shift(batch.loss_mask_BT, 2 + j) * shift(covered.long(), 1 + j)
        per_pos = -(shift(target_logp, 1 + j).exp() * torch.log_softmax(logits.float(), -1)).sum(-1)
        total = total + 0.8**j * (per_pos * mask).sum() / mask.sum().clamp(min=1)
        with torch.no_grad():  # the same metrics ours computes: accuracy and expected acceptance
            q = torch.softmax(logits.float(), -1)
            _ = (head.draft_to_target(logits.argmax(-1)) == shift(target_argmax, 1 + j)).sum()
            _ = torch.minimum(q, shift(target_p[..., draft_ids], 1 + j)).sum(-1).sum()
    return total


def ours_step(head, lm_head_W, norm, draft_ids, batch, teacher: Teacher) -> torch.Tensor:
    with torch.autocast(batch.input_ids_BT.device.type, enabled=False):  # the trainer's teacher: outside autocast
        targets = teacher.from_last(batch.last_BTH, teacher_rows(batch))
    return unroll_ttt(head, batch, targets, STEPS, 0.8, LOSSES["forward_kl"]).loss


# ------------------------------------------------------------------ measurement


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(variant: str, seq: int, repeats: int, prompt_share: float, scale: str, device: torch.device) -> dict:
    head, lm_head_W, norm, draft_ids, batch = build(seq, prompt_share, scale, device)
    teacher = Teacher(norm, lm_head_W, head.d2t, head.t2d)
    bf16 = variant.endswith("bf16")
    gpu = device.type == "cuda"

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = (naive_step(head, lm_head_W, norm, draft_ids, batch) if variant.startswith("naive")
                    else ours_step(head, lm_head_W, norm, draft_ids, batch, teacher))
        loss.backward()
        head.zero_grad(set_to_none=True)
        return float(loss)  # waits for the device

    if gpu:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if gpu else rss_bytes()
    loss = step()
    peak = (torch.cuda.max_memory_allocated() if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - before
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"variant": variant, "loss": loss, "seconds": min(times), "tokens_per_s": seq / min(times),
            "peak_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt-share", type=float, default=0.45,
                        help="share of the sequence that is prompt (no loss); the default data: 0.45")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--scale", default="smollm2", choices=sorted(SCALES), help="the target the head is for")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant and print JSON
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.seq, args.repeats, args.prompt_share, args.scale,
                                 torch.device(args.device))))
        return
    print(f"TTT step, k={STEPS}, {args.scale} head, seq {args.seq}, on {args.device}")
    print(f"baseline (naive): {BASELINE}")
    results = {}
    for variant in ("naive", "ours", "naive-bf16", "ours-bf16"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--seq", str(args.seq),
                              "--repeats", str(args.repeats), "--prompt-share", str(args.prompt_share),
                              "--device", args.device, "--scale", args.scale],
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{variant} failed:\n{out.stderr[-3000:]}")
        r = results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{variant:11s} loss {r['loss']:.4f}  {r['tokens_per_s']:8.1f} tokens/s  "
              f"peak +{r['peak_bytes'] / 2**20:7.0f} MiB", flush=True)
    ratios = {suffix: (results[f"ours{suffix}"]["tokens_per_s"] / results[f"naive{suffix}"]["tokens_per_s"],
                       results[f"ours{suffix}"]["peak_bytes"] / results[f"naive{suffix}"]["peak_bytes"])
              for suffix in ("", "-bf16")}  # each precision against the baseline in the same precision
    fp32, bf16 = ratios[""], ratios["-bf16"]
    print(f"RESULT baseline=reimplemented_anchor_slow_path speedup={fp32[0]:.2f} memory_ratio={fp32[1]:.2f} "
          f"bf16_speedup={bf16[0]:.2f} bf16_memory_ratio={bf16[1]:.2f}")


if __name__ == "__main__":
    main()
