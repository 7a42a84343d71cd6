"""Prepare-stage throughput: chat-template tokenization with loss masks, and local regeneration tokens/s
against plain `model.generate` (greedy, same prompts, same batch size, same dtype).

    python benchmarks/prepare.py                       # the embedded target, bf16 where native, batch 32
    python benchmarks/prepare.py --target random --prompts 16 --max-new-tokens 32
    python benchmarks/prepare.py --threads 1              # on a CPU shared with other jobs

Baseline: `model.generate`. Ends with `RESULT ... regen_speedup=<ours / generate>`.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.resources import files

import torch

from specdistill.config import TargetConfig
from specdistill.data.generate import LocalGenerator
from specdistill.data.prepare import generation_model
from specdistill.data.template import ChatFormat
from specdistill.target import AUTO_DTYPE, DTYPES, load_target


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

    target = load_target(TargetConfig(name=args.target))
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
    print(f"RESULT tokenize_conv_per_s={conv_per_s:.1f} tokenize_tok_per_s={tok_per_s:.0f} "
          f"regen_tok_per_s={ours_tps:.1f} generate_tok_per_s={base_tps:.1f} regen_speedup={ours_tps / base_tps:.2f}")


if __name__ == "__main__":
    main()
