"""Run by the engine's interpreter (`.engine/bin/python`) for test_native_mtp_vllm: vLLM's own MTP model of a
checkpoint, loaded by vLLM's own loader, one forward as its proposer's first draft step runs it. Imports nothing of
ours. Usage: JOBS_JSON, a list of {"model": dir, "inputs": file, "out": file}.

Inputs (safetensors): `ids`, `positions` (one sequence, from 0) and `hidden` (what the target hands over). Out:
`carried` (what the proposer feeds the next draft step) and `logits` (`compute_logits` of what it samples from).
Attention runs for real: a KV cache laid out by vLLM's own allocator and the attention backend's own metadata for
one prefill request.
"""

import json
import socket
import sys
import types

import torch
from safetensors.torch import load_file, save_file
from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
from vllm.distributed.parallel_state import (
    destroy_model_parallel,
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.model_loader import get_model
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop
from vllm.v1.worker.utils import allocate_kv_cache

KV_CACHE_BYTES = 2**24
CPU = torch.device("cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def attention_for_one_prefill(config, T: int) -> tuple[dict, dict]:
    """Each attention layer bound to a fresh KV cache; its backend's metadata and slots for one request of T new
    tokens (block 0 is left out: the engine keeps it as its null block)."""
    layers = get_layers_from_vllm_config(config, AttentionLayerBase)
    specs = {name: layer.get_kv_cache_spec(config) for name, layer in layers.items()}
    supported = [layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(config))]
    layout = resolve_kv_cache_layout(config, [supported], list(specs.values()))
    caches = allocate_kv_cache(get_kv_cache_configs(config, [specs], [KV_CACHE_BYTES])[0], CPU, layout)
    metadata, slots = {}, {}
    for name, layer in layers.items():
        layer.bind_kv_cache(caches[name])
        block = specs[name].block_size
        blocks = torch.arange(1, 2 + (T - 1) // block, dtype=torch.int32)
        starts, lens = torch.tensor([0, T], dtype=torch.int32), torch.tensor([T], dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=lens, seq_lens_cpu_upper_bound=lens,
            num_reqs=1, num_actual_tokens=T, max_query_len=T, max_seq_len=T, block_table_tensor=blocks[None],
            slot_mapping=block + torch.arange(T, dtype=torch.int64), positions=torch.arange(T))
        builder = layer.get_attn_backend().get_builder_cls()(specs[name], [name], config, CPU)
        metadata[name] = builder.build(0, common)
        slots[name] = common.slot_mapping
    return metadata, slots


def forward(model_dir: str, inputs: dict, first: bool) -> dict:
    """vLLM's MTP model of `model_dir` (speculative method mtp, float32), one forward over `inputs`."""
    args = EngineArgs(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=1,
                      max_num_batched_tokens=256, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    config = args.create_engine_config()
    draft = config.speculative_config.draft_model_config
    with set_current_vllm_config(config):
        if first:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ensure_model_parallel_initialized(1, 1)  # per model: its groups depend on it (an MoE block's expert group)
        model = get_model(vllm_config=config, model_config=draft)  # raises on any weight it did not find
        T = inputs["ids"].shape[0]
        metadata, slots = attention_for_one_prefill(config, T)
        with torch.no_grad(), set_forward_context(metadata, config, num_tokens=T, slot_mapping=slots):
            out = model(input_ids=inputs["ids"], positions=inputs["positions"], hidden_states=inputs["hidden"])
            # the proposer's own rule for which output is sampled from and which one the next step reads
            proposer = types.SimpleNamespace(method="mtp", draft_model_config=draft)
            sampled, carried = out if SpecDecodeBaseProposer.model_returns_tuple(proposer) else (out, out)
            logits = model.compute_logits(sampled)
        destroy_model_parallel()
    return {"carried": carried.contiguous(), "logits": logits.contiguous()}


def main(jobs_file: str) -> None:
    _set_torch_accelerator_to_noop()  # as vLLM's CPU model runner does: its loader calls accelerator APIs
    with open(jobs_file) as f:
        jobs = json.load(f)
    for i, job in enumerate(jobs):
        save_file(forward(job["model"], load_file(job["inputs"]), i == 0), job["out"])
        print(f"done: {job['model']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
