"""Latency of the tree kernels (build, greedy verify, rejection sampling, KV compaction): Triton against
our own torch reference (`specdistill/decode/kernels/reference.py`, the baseline) over batch 1-64 and tree
sizes 8-64.

The baseline is no engine's kernel: it is the definition the Triton kernels are tested against, and its
tree walks (build, greedy, rejection) synchronise with the host on every loop pass, so on a GPU its time
is mostly launches and syncs; the ratio says what the Triton kernels save over that, not over an engine.
On a GPU both run on CUDA. On CPU only the torch numbers are measured, unless --interpret asks for
the Triton interpreter too (slow; a correctness aid, not a speed figure). The last line is
`RESULT baseline=own_torch_reference_synced_per_pass ...`: geometric-mean microseconds per kernel and,
where Triton ran, the geometric-mean speedup of Triton over that baseline.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

BASELINE = ("our own torch reference (specdistill/decode/kernels/reference.py), which synchronises with the host "
            "on every pass of its tree walks: not an engine's kernel")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    parser.add_argument("--nodes", default="8,32,64", help="comma-separated tree sizes (root included)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary of the rejection sampler")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--interpret", action="store_true", help="on CPU, also time Triton under TRITON_INTERPRET=1")
    return parser.parse_args()


def timed_us(fn, repeats: int, device: torch.device) -> float:
    """Median wall time of one call, in microseconds, after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    return sorted(samples)[len(samples) // 2]


def kernel_calls(impl, batch: int, nodes: int, vocab: int, device: torch.device) -> dict:
    """One closure per kernel, on random inputs of this size."""
    from specdistill.decode.kernels import reference
    from specdistill.decode.tree import random_tree

    gen = torch.Generator().manual_seed(batch * 1000 + nodes)
    tree = random_tree(batch, nodes, 8, gen, device=device)
    _, next_token, next_sibling = reference.build_tree_tensors(tree.parents)
    argmax = torch.randint(0, 8, (batch, nodes), generator=gen).to(device)
    target = torch.rand(batch, nodes, vocab, generator=gen).to(device)
    target = target / target.sum(-1, keepdim=True)
    draft = torch.rand(batch, nodes, vocab, generator=gen).to(device)
    draft = draft / draft.sum(-1, keepdim=True)
    coins = torch.rand(batch, nodes, generator=gen).to(device)
    final_u = torch.rand(batch, generator=gen).to(device)
    slots = tree.depth + 1
    keys = torch.randn(batch, 8, 100 + nodes, 64, generator=gen).to(device)
    values = torch.randn_like(keys)
    accept, _, _ = reference.greedy_verify(tree.tokens, next_token, next_sibling, argmax, slots)
    return {
        "build": lambda: impl.build_tree_tensors(tree.parents),
        "greedy": lambda: impl.greedy_verify(tree.tokens, next_token, next_sibling, argmax, slots),
        "rejection": lambda: impl.rejection_sample(
            tree.tokens, next_token, next_sibling, target, draft, coins, final_u, slots
        ),
        "compact": lambda: impl.compact_kv(keys, values, 100, accept),
    }


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with_triton = device.type == "cuda" or args.interpret
    if device.type == "cpu" and args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are imported
    from specdistill.decode.kernels import reference

    triton_impl = None
    if with_triton:
        from specdistill.decode.kernels import triton_kernels as triton_impl
    batches = [int(b) for b in args.batches.split(",")]
    sizes = [int(n) for n in args.nodes.split(",")]
    repeats = 2 if device.type == "cpu" and args.interpret else args.repeats

    times: dict[str, dict[str, list[float]]] = {"torch": {}, "triton": {}}
    print(f"device={device} vocab={args.vocab} (microseconds, median of {repeats})")
    print(f"baseline: {BASELINE}")
    print(f"{'kernel':<10} {'batch':>5} {'nodes':>5} {'torch ref':>10} {'triton':>10} {'speedup':>8}")
    for batch in batches:
        for nodes in sizes:
            torch_calls = kernel_calls(reference, batch, nodes, args.vocab, device)
            triton_calls = kernel_calls(triton_impl, batch, nodes, args.vocab, device) if with_triton else {}
            for name, call in torch_calls.items():
                t_torch = timed_us(call, repeats, device)
                times["torch"].setdefault(name, []).append(t_torch)
                line = f"{name:<10} {batch:>5} {nodes:>5} {t_torch:>10.1f}"
                if name in triton_calls:
                    t_triton = timed_us(triton_calls[name], repeats, device)
                    times["triton"].setdefault(name, []).append(t_triton)
                    line += f" {t_triton:>10.1f} {t_torch / t_triton:>8.2f}"
                print(line, flush=True)

    fields = [f"baseline=own_torch_reference_synced_per_pass device={device.type}"]
    for name, values in times["torch"].items():
        fields.append(f"{name}_torch_us={geomean(values):.1f}")
        if name in times["triton"]:
            ratios = [a / b for a, b in zip(values, times["triton"][name])]
            fields.append(f"{name}_triton_us={geomean(times['triton'][name]):.1f} {name}_speedup={geomean(ratios):.2f}")
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    sys.exit(main())
