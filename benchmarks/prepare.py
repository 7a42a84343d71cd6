"""Prepare-stage throughput: chat-template tokenization with loss masks, and regeneration tokens/s of our decode
loop (`LocalGenerator`, backend=local) and of vLLM's offline engine (`VllmGenerator`, backend=vllm, through the
same worker process the prepare stage runs) against plain `model.generate` (greedy, same prompts, same batch
size, same dtype; vLLM's max_num_seqs is the batch size).

    python benchmarks/prepare.py                       # the embedded target, bf16 where native, batch 32
    python benchmarks/prepare.py --target random --prompts 16 --max-new-tokens 32
    python benchmarks/prepare.py --threads 1              # on a CPU shared with other jobs

Baseline: `model.generate`. Ends with `RESULT ... regen_speedup=<ours / generate> vllm_vs_local=<vLLM / ours>
vllm_vs_generate=<vLLM / generate> vllm_same_as_local=<prompts whose vLLM tokens are ours>/<prompts>`; vLLM's
start (load, compile, warm-up) is timed apart, as `vllm_start_s`. Without the engine (`make engine`) the vLLM
columns are left out, and the line says so.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from importlib.resources import files
from pathlib import Path

import torch

from specdistill.config import TargetConfig
from specdistill.data.conversations import generation_model
from specdistill.data.generate import LocalGenerator
from specdistill.data.template import ChatFormat
from specdistill.data.vllm_generate import VllmGenerator
from specdistill.engines import EngineNotInstalled, engine_python
from specdistill.target import AUTO_DTYPE, DTYPES, Target, load_target, resolve_dtype, served_dir


def questions(n: int) -> list[str]:
    lines = files("specdistill.evaluate").joinpath("benchmarks/spec_bench.jsonl").read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines[:n]]


def bench_tokenize(chat: ChatFormat, texts: list[str], repeats: int) -> tuple[float, float]:
    """Conversations/s and tokens/s of `ChatFormat.tokenize` on two-turn conversations."""
    conversations = [[{"role": "user", "content": q}, {"role": "assistant", "content": q[::-1]},
                      {"role": "user", "content": q.upper()}, {"role": "assistant", "content": q}] for q in texts]
    t0, tokens = time.perf_counter(), 0
    for _ in range(repeats):
        for messages in conversations:
            tokens += len(chat.tokenize(messages).input_ids)
    seconds = time.perf_counter() - t0
    return repeats * len(conversations) / seconds, tokens / seconds


@torch.inference_mode()
def bench_generate(model, tokenizer, prompts: list[list[int]], stop: list[int], batch_size: int,
                   max_new_tokens: int) -> tuple[float, int]:
    """Plain `model.generate`, left padded, greedy; returns seconds and useful (pre-stop) tokens."""
    tokenizer.padding_side = "left"
    t0, useful = time.perf_counter(), 0
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer.pad({"input_ids": prompts[start: start + batch_size]}, return_tensors="pt")
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                             pad_token_id=tokenizer.pad_token_id)
        for row in out[:, batch["input_ids"].shape[1]:].tolist():
            useful += next((i for i, t in enumerate(row) if t in stop), len(row))
    return time.perf_counter() - t0, useful


def bench_vllm(target_cfg: TargetConfig, target: Target, chat: ChatFormat, prompts: list[list[int]], dtype: str,
               batch_size: int, max_new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """vLLM through `VllmGenerator`: seconds to start (and warm up on one prompt), seconds to generate, and the
    generated ids."""
    log_path = Path(tempfile.mkdtemp(prefix="vllm-bench-")) / "vllm.log"
    device = target.model.device
    generator = VllmGenerator(served_dir(target_cfg), engine_python("vllm", None, "benchmarks/prepare.py"),
                              resolve_dtype(dtype, device), target.config.max_position_embeddings,
                              chat.stop_token_ids(), batch_size, len(target.tokenizer), target.vocab_size, device,
                              log_path)
    try:
        t0 = time.perf_counter()
        generator.generate(prompts[:1], 4, desc="warm-up")
        start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        outputs = generator.generate(prompts, max_new_tokens, desc="benchmark")
        return start_s, time.perf_counter() - t0, [g.token_ids for g in outputs]
    finally:
        generator.close()
        print(f"vllm log: {log_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=TargetConfig().name)
    parser.add_argument("--dtype", default=AUTO_DTYPE, choices=[AUTO_DTYPE, *DTYPES],
                        help="auto: bfloat16 where native, else float32")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (1 on a busy CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target_cfg = TargetConfig(name=args.target)
    target = load_target(target_cfg)
    model = generation_model(target, args.dtype)
    chat = ChatFormat(target.tokenizer)
    texts = questions(args.prompts)
    conv_per_s, tok_per_s = bench_tokenize(chat, texts, repeats=3)
    print(f"tokenize: {conv_per_s:.0f} conversations/s, {tok_per_s:.0f} tokens/s")

    prompts = [chat.prompt_ids([{"role": "user", "content": q}]) for q in texts]
    stop = chat.stop_token_ids()
    generator = LocalGenerator(model, target.tokenizer.pad_token_id, stop, args.batch_size,
                               num_tokens=len(target.tokenizer))
    t0 = time.perf_counter()
    ours = generator.generate(prompts, args.max_new_tokens, desc="ours")
    ours_s = time.perf_counter() - t0
    ours_tokens = sum(len(g.token_ids) for g in ours)
    base_s, base_tokens = bench_generate(model, target.tokenizer, prompts, stop, args.batch_size,
                                         args.max_new_tokens)
    ours_tps, base_tps = ours_tokens / ours_s, base_tokens / base_s
    print(f"regenerate: ours {ours_tokens} tokens in {ours_s:.1f}s ({ours_tps:.1f} tok/s); "
          f"model.generate {base_tokens} tokens in {base_s:.1f}s ({base_tps:.1f} tok/s)")
    result = (f"RESULT tokenize_conv_per_s={conv_per_s:.1f} tokenize_tok_per_s={tok_per_s:.0f} "
              f"regen_tok_per_s={ours_tps:.1f} generate_tok_per_s={base_tps:.1f} regen_speedup={ours_tps / base_tps:.2f}")
    try:
        start_s, vllm_s, vllm_ids = bench_vllm(target_cfg, target, chat, prompts, args.dtype, args.batch_size,
                                               args.max_new_tokens)
    except EngineNotInstalled as err:
        print(f"{result} vllm=not_installed ({err})")
        return
    vllm_tokens = sum(len(ids) for ids in vllm_ids)
    vllm_tps = vllm_tokens / vllm_s
    same = sum(a.token_ids == b for a, b in zip(ours, vllm_ids))
    print(f"regenerate: vllm {vllm_tokens} tokens in {vllm_s:.1f}s ({vllm_tps:.1f} tok/s) after a {start_s:.1f}s start; "
          f"{same} of {len(prompts)} prompts decoded to our very tokens")
    print(f"{result} vllm_tok_per_s={vllm_tps:.1f} vllm_vs_local={vllm_tps / ours_tps:.2f} "
          f"vllm_vs_generate={vllm_tps / base_tps:.2f} vllm_start_s={start_s:.1f} "
          f"vllm_same_as_local={same}/{len(prompts)}")


if __name__ == "__main__":
    main()
