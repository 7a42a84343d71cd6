"""Runs inside the engine's own environment (vLLM and its pinned transformers), so it imports nothing of ours.

    <engine python> vllm_generate_worker.py      (JSON lines in on stdin, out on stdout)

A long-lived generation worker, so that vLLM starts once per stage instead of once per batch. The first line
names the target folder and the engine settings (dtype, max_model_len, max_num_seqs, and on a GPU the share
of its memory to take); the worker loads vLLM and replies with its version and load time. Every further
line is a batch: prompts as token ids (tokenized by our chat template), the sampling settings, one seed per
prompt (null: greedy), the stop ids and, where the model's vocabulary has rows without a token, the ids that
may be sampled. The reply holds each prompt's generated ids and the batch's wall time. Our side decodes the
ids with its own tokenizer, so vLLM's is never loaded. The worker ends when its input does.
"""

import json
import os
import sys
import time


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever else prints to stdout (vLLM's logs, native libraries) goes to the log, not the replies

    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    settings = json.loads(sys.stdin.readline())
    engine_args = {"dtype": settings["dtype"], "max_model_len": settings["max_model_len"],
                   "max_num_seqs": settings["max_num_seqs"]}
    if settings["gpu_memory_utilization"] is not None:
        engine_args["gpu_memory_utilization"] = settings["gpu_memory_utilization"]
    t0 = time.perf_counter()
    llm = LLM(model=settings["target"], **engine_args)
    reply({"version": vllm.__version__, "load_s": round(time.perf_counter() - t0, 3)})
    for line in sys.stdin:
        batch = json.loads(line)
        # ignore_eos: the stop ids are exactly ours (vLLM would also stop at the ids of generation_config.json)
        params = [SamplingParams(temperature=batch["temperature"], top_p=batch["top_p"],
                                 max_tokens=batch["max_new_tokens"], seed=seed, stop_token_ids=batch["stop_token_ids"],
                                 ignore_eos=True, allowed_token_ids=batch["allowed_token_ids"], detokenize=False)
                  for seed in batch["seeds"]]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in batch["prompts"]]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=True)  # the bar goes to this worker's log
        reply({"outputs": [list(o.outputs[0].token_ids) for o in outputs],
               "wall_s": round(time.perf_counter() - t0, 3)})


if __name__ == "__main__":
    main()
