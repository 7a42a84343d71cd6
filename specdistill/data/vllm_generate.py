"""Batched generation by vLLM's offline engine (`data.generation.backend=vllm`), with LocalGenerator's interface, so
regeneration builds its prompts, rejects and decodes exactly as it does with our own decode loop.

vLLM runs in its own environment (`make engine`) through `evaluate/vllm_generate_worker.py`. Its start (loading,
compiling, sizing the KV cache) takes about a minute on a CPU, longer than a batch of a few hundred prompts
decodes, so one worker serves the whole stage: it starts at the first batch (a run that finds every row cached
never starts it) and stops at `close`. Prompts go over as our token ids and answers come back as ids: the
tokenizer and chat template are ours on both ends. Generation stops at our stop ids only, and ids past the
tokenizer (padded vocabulary rows) are never sampled, as in LocalGenerator. Sampling gives each prompt of a call
its own seed, drawn from the call's seed: a batch regenerated after a kill draws as it did before, whatever
else the engine decoded since it started.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch

from specdistill.data.generate import Generation
from specdistill.engines import EngineProcess, engine_env

log = logging.getLogger(__name__)

WORKER = Path(__file__).resolve().parents[1] / "evaluate" / "vllm_generate_worker.py"
GPU_MEMORY_SHARE = 0.9  # of the GPU memory free when the engine starts: the target this process holds stays there


class VllmGenerator:
    """Generates continuations of token-id prompts with the target folder `target_dir` in vLLM, `batch_size`
    sequences at a time (vLLM's max_num_seqs)."""

    def __init__(self, target_dir: Path, python: str, dtype: torch.dtype, max_model_len: int,
                 stop_token_ids: list[int], batch_size: int, num_tokens: int, vocab_size: int,
                 device: torch.device, log_path: Path):
        self.python, self.device, self.log_path = python, device, log_path
        self.settings = {"target": str(target_dir), "dtype": str(dtype).removeprefix("torch."),
                         "max_model_len": max_model_len, "max_num_seqs": batch_size}
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.allowed_token_ids = list(range(num_tokens)) if num_tokens < vocab_size else None
        self.engine: EngineProcess | None = None

    def _started(self) -> EngineProcess:
        if self.engine is None:
            share = None
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                share = GPU_MEMORY_SHARE * free / total
            log.info("starting vLLM on %s (%s, %s); its log: %s", self.settings["target"], self.settings["dtype"],
                     self.device, self.log_path)
            self.engine = EngineProcess("vllm (regeneration)", self.python, WORKER, self.log_path,
                                        engine_env(self.device))
            ready = self.engine.ask({**self.settings, "gpu_memory_utilization": share})
            log.info("vLLM %s ready in %.1fs", ready["version"], ready["load_s"])
        return self.engine

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, desc: str = "generate") -> list[Generation]:
        """One Generation per prompt, in the prompts' order."""
        if not prompts:
            return []
        draw = random.Random(seed)
        seeds = [draw.getrandbits(63) if temperature > 0 else None for _ in prompts]
        engine = self._started()
        log.info("vLLM %s: %d prompts (progress in %s)", desc, len(prompts), self.log_path)
        reply = engine.ask({
            "prompts": prompts, "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
            "seeds": seeds, "stop_token_ids": self.stop_token_ids, "allowed_token_ids": self.allowed_token_ids})
        outputs = [self._generation(ids) for ids in reply["outputs"]]
        new_tokens = sum(len(g.token_ids) for g in outputs)
        log.info("vLLM %s: %d prompts, %d new tokens in %.1fs (%.1f tokens/s)", desc, len(prompts), new_tokens,
                 reply["wall_s"], new_tokens / reply["wall_s"] if reply["wall_s"] else 0.0)
        return outputs

    def _generation(self, token_ids: list[int]) -> Generation:
        """vLLM's output ids end with the stop id that ended them; ours leave it out."""
        finished = bool(token_ids) and token_ids[-1] in self.stop_token_ids
        return Generation(token_ids=token_ids[:-1] if finished else token_ids, finished=finished)

    def close(self) -> None:
        """Stop the engine (a later `generate` starts it again)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
