"""One engine-check run of vLLM's CPU build, as the engine check and the vLLM regeneration backend now start it
(the engine core inside the worker process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`), against vLLM's default (an engine
core process and a model-runner process of their own): the same request (the embedded target's plain greedy
decoding of Spec-Bench first turns, one request at a time, float32), the whole worker process timed.

    python benchmarks/engine_start.py                  # 4 prompts x 48 new tokens, the engine tests' size
    python benchmarks/engine_start.py --prompts 16 --max-new-tokens 128

Baseline: vLLM's default multiprocessing. Ends with `RESULT inprocess_speedup=<default wall / in-process wall>
default_s=... inprocess_s=... same_outputs=<prompts whose tokens agree>/<prompts>`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from specdistill.config import TargetConfig
from specdistill.engines import engine_env, engine_python
from specdistill.evaluate.bench import load_items
from specdistill.evaluate.engine import WORKERS
from specdistill.target import load_target, served_dir


def timed_run(python: str, request: Path, env: dict[str, str], out: Path) -> tuple[float, list]:
    """Seconds for the whole worker process, and its outputs."""
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run([python, str(WORKERS["vllm"]), str(request), str(out)], env=env, stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t0, json.loads(out.read_text())["outputs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"):
        raise SystemExit("unset VLLM_ENABLE_V1_MULTIPROCESSING: this benchmark sets it for each side")
    target_cfg = TargetConfig(dtype="float32")
    target = load_target(target_cfg)
    prompts = [target.prompt_ids(turns[0]) for turns in load_items("spec_bench")[: args.prompts]]
    request = {"target": str(served_dir(target_cfg)), "draft": None, "layout": None, "num_speculative_tokens": 0,
               "dtype": "float32", "enforce_eager": True, "max_model_len": 4096, "max_num_seqs": 1,
               "max_new_tokens": args.max_new_tokens, "prompts": prompts}
    python = engine_python("vllm", None, "benchmarks/engine_start.py")
    inprocess = engine_env()
    default = {key: value for key, value in inprocess.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "request.json"
        path.write_text(json.dumps(request))
        default_s, default_out = timed_run(python, path, default, Path(tmp) / "default.json")
        inprocess_s, inprocess_out = timed_run(python, path, inprocess, Path(tmp) / "inprocess.json")
    same = sum(a == b for a, b in zip(default_out, inprocess_out))
    print(f"vLLM worker, {args.prompts} prompts x {args.max_new_tokens} new tokens: default {default_s:.1f} s, "
          f"engine core in process {inprocess_s:.1f} s")
    print(f"RESULT inprocess_speedup={default_s / inprocess_s:.2f} default_s={default_s:.1f} "
          f"inprocess_s={inprocess_s:.1f} same_outputs={same}/{len(prompts)}")


if __name__ == "__main__":
    main()
