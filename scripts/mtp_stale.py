"""The stale-MTP case in a real engine: a target ships a trained MTP layer (`released`), post-training leaves it
stale (its MTP tensors perturbed: `stale`), and the pipeline fine-tunes it again from the stale weights
(`finetuned`). vLLM serves each checkpoint with `speculative_config={"method": "mtp"}` and measures acceptance
beside our own chain, in float32.

    python scripts/mtp_stale.py                                   # glm4_moe, into mtp_stale/
    python scripts/mtp_stale.py family=deepseek_v3 out=mtp_stale_ds noise=1.0
    python scripts/mtp_stale.py family=mimo out=mtp_stale_mimo
    python scripts/mtp_stale.py family=qwen3_next out=mtp_stale_q3n

Qwen3-Next differs (`REPLAYED`): its linear-attention layers keep a recurrent state our batched KV-cache decoding
cannot roll back, so the data is not regenerated (the fixed conversations of `tests/data/learning.jsonl`, with the
target's own distributions as the teacher), the evaluate stage does not run, and our chain (one prompt at a time,
replayed: `ReplayCache`) stands beside vLLM in bfloat16 (vLLM's CPU kernels for those layers run bf16 only).

Each run's log and directory lie under `out`; the table is written to `<out>/stale.md`.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from specdistill.config import (
    EngineConfig,
    EvalConfig,
    ExportConfig,
    RandomTargetConfig,
    TargetConfig,
)
from specdistill.evaluate.engine import evaluate_in_engine
from specdistill.heads.checkpoint import load_head
from specdistill.heads.native_mtp import MTP_FAMILIES, family_name, layer_prefixes
from specdistill.io import save_tensors, write_table
from specdistill.layout import trained_head_dir
from specdistill.target import load_target

ROOT = Path(__file__).resolve().parents[1]
SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the engine drafts with the target's own
REPLAYED = {"qwen3_next": ["data.source=jsonl", f"data.path={ROOT / 'tests' / 'data' / 'learning.jsonl'}",
                              "data.regenerate=false", "data.max_length=512", "data.max_reject_share=0.5",
                              "train.epochs=4", "stages=[prepare,capture,train]"]}


def pipeline(out: Path, name: str, family: str, model: Path | None = None, *overrides: str) -> dict:
    """One run of the whole pipeline on the random `family` target, or on the checkpoint `model` (the engine check
    included); its engine report."""
    args = ["+exp=smoke", "head=mtp", f"name={name}", f"run_root={out}", "data.synth.num_conversations=128",
            "data.synth.batch_size=64", "train.epochs=8", "train.lr=3e-3", "eval.limit=8", "eval.max_new_tokens=48",
            "eval.engine.name=vllm", "eval.engine.dtype=float32", "target.random.max_position_embeddings=8192",
            f"target.random.family={family}", *REPLAYED.get(family, []),
            *([f"target.name={model}"] if model else []), *overrides]
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, stdout=log, stderr=log)
    if proc.returncode:
        sys.exit(f"run {name} failed; its log is {out / f'{name}.log'}")
    if family not in REPLAYED:
        return json.loads((out / name / "eval" / "engine.json").read_text())
    target = TargetConfig(name=str(model) if model else "random",
                          random=RandomTargetConfig(family=family, max_position_embeddings=8192))
    return served_beside_ours(out / name, target)


def served_beside_ours(run_dir: Path, target: TargetConfig) -> dict:
    """The run's trained module laid over its target and served by vLLM in bfloat16, beside our chain: the
    evaluate stage's engine check, without the tree evaluation that cannot run on this target."""
    ev = EvalConfig(limit=8, max_new_tokens=48, engine=EngineConfig(name="vllm", dtype="bfloat16"))
    head = load_head(trained_head_dir(run_dir / "ckpt"))
    return evaluate_in_engine(ev, ExportConfig().dtype, target, load_target(target), head, run_dir / "eval")


def perturbed(model: Path, out: Path, noise: float, seed: int = 0) -> Path:
    """A copy of `model` whose MTP layer's tensors each moved by `noise` times their own spread."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(model, out, symlinks=False)
    config = json.loads((out / "config.json").read_text())
    layer = layer_prefixes(MTP_FAMILIES[family_name(config)], config["num_hidden_layers"])
    g = torch.Generator().manual_seed(seed)
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(path))
        moved = {k: t + noise * t.float().std() * torch.randn(t.shape, generator=g).to(t.dtype)
                 if k.startswith(layer) and not k.endswith(SHARED) and t.is_floating_point() and t.numel() > 1 else t
                 for k, t in tensors.items()}
        save_tensors(path, moved, metadata={"format": "pt"})
    return out


def row(name: str, report: dict) -> str:
    m, ours = report["layouts"]["native_mtp"], report["ours"]
    n = report["num_prompts"]
    return (f"| {name} | {m['tau']:.3f} | {ours['tau']:.3f} | {m['accepted_per_pos']} | "
            f"{'yes' if m['counters_equal_ours'] else 'no'} | {report['plain']['outputs_equal_ours']}/{n} | "
            f"{m['outputs_equal_plain']}/{n} |")


def main() -> None:
    args = OmegaConf.from_cli()
    family, noise = args.get("family", "glm4_moe"), float(args.get("noise", 1.0))
    out = Path(args.get("out", "mtp_stale")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    released_report = pipeline(out, "released", family)
    released = out / "released" / "eval" / "engine" / "native_mtp"  # the target with its trained MTP layer laid over
    stale = perturbed(released, out / "stale-model", noise)
    # the stale module as it is: one step at a learning rate below every weight's float32 resolution
    stale_report = pipeline(out, "stale", family, stale, "train.lr=1e-30", "train.max_steps=1")
    finetuned_report = pipeline(out, "finetuned", family, stale)
    rows = [f"{family}, MTP tensors perturbed by {noise:g}x their spread; vLLM {released_report['version']}, "
            f"{released_report['dtype']}, "
            f"chain of {released_report['num_speculative_tokens']}, {released_report['num_prompts']} prompts",
            "", "| MTP module | vLLM tau | our chain tau | vLLM accepted per position | counters equal ours "
            "| vLLM's plain decode equals ours | outputs equal vLLM's plain |", "|---|---|---|---|---|---|---|",
            row("released (trained)", released_report), row("stale (perturbed)", stale_report),
            row("fine-tuned from stale", finetuned_report)]
    write_table(out / "stale.md", rows)


if __name__ == "__main__":
    main()
