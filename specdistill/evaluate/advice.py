"""Serving advice: which draft tree to serve at which batch size, from measured acceptance and a
roofline cost model, printed as ready SGLang and vLLM flags.

Expected tau of a tree (steps s, top-k k, n draft tokens): the tree an engine grows (EAGLE-2: each
of the k best nodes at a depth proposes its top-k children, the best n of all candidates are kept),
grown here with each candidate scored by its chance of being on the accepted path: the product over
its path of m_j(r) = c_j(r) - c_j(r - 1), where c_j(w) is the measured coverage (the target's token
among the drafter's top-w at depth j, given the path got there). tau = 1 + the sum of the kept
scores. The engine ranks by the drafter's own scores, which adapt per context, so the model is a
little cautious for confident drafters. Past the measured depths or widths the last measured value
holds, so the model never extrapolates up.

Cost of a forward of t tokens per row, batch b, context C (roofline): max(FLOPs / peak, bytes /
bandwidth) + launch, FLOPs = 2 P b t + 4 layers attn_width C b t, bytes = P bytes_per_param +
b C kv_bytes_per_token. A round is one target forward over n + 1 tokens plus s head forwards (k
tokens per row after the first); plain decoding is one target forward per token. speedup = tau *
T_plain / (T_verify + T_draft). Verification turns compute-bound as b grows, so speedup falls.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from torch import nn

from specdistill.config import AdviceConfig

log = logging.getLogger(__name__)

STEPS = range(1, 9)
DRAFT_TOKENS = (4, 8, 16, 32, 48, 64)


@dataclass(frozen=True)
class ModelCost:
    """What a forward costs: weights read, multiply-adds per token, KV read per cached token."""

    params: int  # weights read per forward (input embedding excluded: a lookup reads a few rows)
    layers: int
    attn_width: int  # query heads * head dim
    kv_bytes_per_token: float  # K and V of every layer

    def forward_s(self, batch: int, tokens: int, context: int, cfg: AdviceConfig) -> float:
        flops = 2 * self.params * batch * tokens + 4 * self.layers * self.attn_width * context * batch * tokens
        bytes_read = self.params * cfg.bytes_per_param + batch * context * self.kv_bytes_per_token
        return max(flops / (cfg.peak_tflops * 1e12), bytes_read / (cfg.memory_tbps * 1e12)) + cfg.launch_us * 1e-6


def _weights_read(model: nn.Module, input_embedding: nn.Module | None) -> int:
    params = {id(p): p.numel() for p in model.parameters()}
    if input_embedding is not None and not getattr(model.config, "tie_word_embeddings", False):
        params.pop(id(input_embedding.weight), None)
    return sum(params.values())


def target_cost(model: nn.Module, cfg: AdviceConfig) -> ModelCost:
    """The target's cost from its HF config and weights."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return ModelCost(
        params=_weights_read(model, model.get_input_embeddings()),
        layers=c.num_hidden_layers,
        attn_width=c.num_attention_heads * head_dim,
        kv_bytes_per_token=2 * c.num_hidden_layers * kv_heads * head_dim * cfg.bytes_per_param,
    )


def head_cost(head: nn.Module, cfg: AdviceConfig) -> ModelCost:
    """A draft head: its decoder blocks (one but DFlash's), its fc / eh_proj and its lm_head over the draft
    vocabulary."""
    arch = head.config.arch
    params = sum(p.numel() for name, p in head.named_parameters() if not name.startswith("embed_tokens"))
    return ModelCost(params=params, layers=getattr(head.config, "num_layers", 1), attn_width=arch.num_attention_heads * arch.head_dim,
                     kv_bytes_per_token=2 * arch.num_key_value_heads * arch.head_dim * cfg.bytes_per_param)


def _coverage_at(table: list[list[float]], depth: int, width: int) -> float:
    if not table or width < 1:
        return 0.0
    row = next((r for r in reversed(table[:depth]) if r), [])
    return max(row[: min(width, len(row))], default=0.0)  # the running max: coverage never falls with width


def expected_tau(table: list[list[float]], steps: int, topk: int, draft_tokens: int) -> float:
    """1 + expected accepted tokens of an EAGLE-2 tree, from the coverage table (see the module docstring)."""
    frontier, kept = [1.0], []
    for d in range(1, steps + 1):
        ranks = [_coverage_at(table, d, r) - _coverage_at(table, d, r - 1) for r in range(1, topk + 1)]
        scored = sorted((p * m for p in frontier for m in ranks), reverse=True)
        kept += scored
        frontier = scored[:topk]
    return 1.0 + sum(sorted(kept, reverse=True)[:draft_tokens])


def topks(measured_width: int) -> list[int]:
    """1, 2, 4, ... and the widest top-k the evaluation measured: wider trees would read coverage that
    was never measured (held at the last measured width, so they could only look as good, never better)."""
    powers = {1 << i for i in range(measured_width.bit_length())}  # each <= measured_width
    return sorted(powers | {measured_width}) if measured_width > 1 else [1]


def candidates(measured_width: int) -> list[tuple[int, int, int]]:
    """(steps, topk, draft tokens) an engine accepts: chains have n = steps; trees n in [steps, k + (s-1) k^2]."""
    out = []
    for s in STEPS:
        for k in topks(measured_width):
            sizes = [s] if k == 1 else sorted({n for n in DRAFT_TOKENS if s < n <= k + (s - 1) * k * k})
            out += [(s, k, n) for n in sizes]
    return out


def expected_speedup(tau_value: float, steps: int, topk: int, draft_tokens: int, batch: int,
                     target: ModelCost, head: ModelCost, cfg: AdviceConfig, parallel: bool = False) -> float:
    """`parallel`: a P-EAGLE head drafts its whole chain in one forward of `steps` slots."""
    ctx = cfg.context_len
    plain = target.forward_s(batch, 1, ctx, cfg)
    verify = target.forward_s(batch, draft_tokens + 1, ctx, cfg)
    draft = (head.forward_s(batch, steps, ctx, cfg) if parallel else
             head.forward_s(batch, 1, ctx, cfg) + (steps - 1) * head.forward_s(batch, topk, ctx, cfg))
    return tau_value * plain / (verify + draft)


def sglang_flags(kind: str, head_path: str, steps: int, topk: int, draft_tokens: int) -> str:
    """SGLang counts the root among its draft tokens: --speculative-num-draft-tokens = n + 1."""
    algorithm = "EAGLE3" if kind == "eagle3" else "EAGLE"
    return (f"--speculative-algorithm {algorithm} --speculative-draft-model-path {head_path} "
            f"--speculative-num-steps {steps} --speculative-eagle-topk {topk} "
            f"--speculative-num-draft-tokens {draft_tokens + 1}")


def vllm_flags(kind: str, head_path: str, steps: int, parallel: bool = False) -> str:
    """vLLM drafts chains: num_speculative_tokens = steps (a P-EAGLE head's in one forward: `parallel_drafting`; a
    DFlash head's always, by its own method)."""
    method = kind if kind in ("eagle3", "dflash") else "mtp"
    config = {"method": method, "model": head_path, "num_speculative_tokens": steps}
    if parallel and kind == "eagle3":
        config["parallel_drafting"] = True
    return f"--speculative-config '{json.dumps(config)}'"


def advise(table: list[list[float]], target: ModelCost, head: ModelCost, cfg: AdviceConfig, kind: str,
           serve_dirs: dict[str, str], evaluated: list[dict], parallel: bool = False,
           max_steps: int | None = None) -> dict:
    """The best tree (SGLang) and the best chain (vLLM) per batch size, with expected tau and speedup, as
    flags naming the head directory each engine loads (`serve_dirs["sglang"]`, `serve_dirs["vllm"]`).
    Where nothing beats plain decoding the advice is to serve without speculation. `evaluated` (each
    evaluated head shape: drafter, depth, topk, num_draft_tokens and measured tau) checks the model
    against the measurements it came from: `model_check`. A P-EAGLE or DFlash head (`parallel`) is advised chains
    only, each drafted in one forward, and for vLLM only (we write no SGLang layout for them); a DFlash head's chains
    are at most `max_steps` long (the masks it was trained on)."""
    shapes = [c for c in candidates(max((len(row) for row in table), default=1))
              if (not parallel or c[1] == 1) and (max_steps is None or c[0] <= max_steps)]
    grid = [(c, expected_tau(table, *c)) for c in shapes]
    per_batch = []
    for batch in cfg.batch_sizes:
        scored = [(expected_speedup(t, *c, batch, target, head, cfg, parallel), c, t) for c, t in grid]
        speedup, (s, k, n), tau_value = max(scored)
        chain_speedup, (cs, _, _), chain_tau = max(x for x in scored if x[1][1] == 1)
        per_batch.append({
            "batch_size": batch, "steps": s, "topk": k, "num_draft_tokens": n,
            "expected_tau": round(tau_value, 3), "expected_speedup": round(speedup, 3),
            "speculate": speedup > 1.0,
            "sglang": ("(no SGLang layout: a P-EAGLE or DFlash head is served by vLLM)" if parallel else
                       sglang_flags(kind, serve_dirs["sglang"], s, k, n) if speedup > 1.0 else "(no speculative flags)"),
            "vllm_steps": cs, "vllm_expected_speedup": round(chain_speedup, 3),
            "vllm": (vllm_flags(kind, serve_dirs["vllm"], cs, parallel) if chain_speedup > 1.0
                     else "(no --speculative-config)"),
        })
    return {"hardware": {"gpu": cfg.gpu, "peak_tflops": cfg.peak_tflops, "memory_tbps": cfg.memory_tbps,
                         "launch_us": cfg.launch_us, "bytes_per_param": cfg.bytes_per_param},
            "context_len": cfg.context_len, "target": asdict(target), "head": asdict(head),
            "coverage": [[round(c, 4) for c in row] for row in table], "per_batch": per_batch,
            "model_check": [{**e, "expected_tau": round(expected_tau(table, e["depth"], e["topk"],
                                                                     e["num_draft_tokens"]), 3)} for e in evaluated]}


def advice_markdown(advice: dict) -> str:
    hw = advice["hardware"]
    lines = [f"## Serving advice ({hw['gpu']}: {hw['peak_tflops']:.0f} TFLOP/s, {hw['memory_tbps']} TB/s, "
             f"context {advice['context_len']}; roofline model from measured acceptance)", "",
             "| batch | steps | top-k | draft tokens | expected tau | expected speedup | vLLM chain steps | vLLM speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for r in advice["per_batch"]:
        lines.append(f"| {r['batch_size']} | {r['steps']} | {r['topk']} | {r['num_draft_tokens']} | "
                     f"{r['expected_tau']:.2f} | {r['expected_speedup']:.2f}x | {r['vllm_steps']} | "
                     f"{r['vllm_expected_speedup']:.2f}x |")
    lines.append("")
    for check in advice["model_check"]:
        lines.append(f"Model check: the {check['drafter']} (depth {check['depth']}, top-k {check['topk']}, "
                     f"{check['num_draft_tokens']} draft tokens) measured tau {check['tau']:.2f}; the model "
                     f"expects {check['expected_tau']:.2f} for it.")
    lines.append("")
    for r in advice["per_batch"]:
        lines += [f"- batch {r['batch_size']}:", f"  - SGLang: `{r['sglang']}`", f"  - vLLM: `{r['vllm']}`"]
    return "\n".join(lines) + "\n"


def advised_chain(report_file: Path) -> int | None:
    """The vLLM chain a run's evaluation on the dev split advises at its smallest batch; None without one. A report
    on the test split advises nothing: a default chosen there would no longer leave the test split untouched."""
    saved = json.loads(report_file.read_text()) if report_file.exists() else {}
    if saved and saved.get("split") != "dev":
        log.info("%s is an evaluation on the %s split: its serving advice is not read", report_file, saved.get("split"))
        return None
    per_batch = (saved.get("serving_advice") or {}).get("per_batch")
    steps = per_batch[0]["vllm_steps"] if per_batch else 0
    return steps if steps >= 1 else None
