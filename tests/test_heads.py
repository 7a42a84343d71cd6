"""The head's block is sized and rotated as its target: RoPE comes from the target's `rope_parameters` or the
build stops."""

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specdistill.config import HeadConfig
from specdistill.heads.build import arch_from_target
from specdistill.heads.layers import Rotary

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def tiny_config(**rope) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=256, **rope)


def test_the_head_rotates_as_its_target():
    config = tiny_config(rope_parameters=dict(LLAMA3_ROPE))
    arch = arch_from_target(config, HeadConfig())
    assert arch.rope_parameters == LLAMA3_ROPE
    x, positions = torch.zeros(1, 5, 8), torch.tensor([[0, 1, 7, 100, 255]])
    for ours, theirs in zip(Rotary(arch)(x, positions), LlamaRotaryEmbedding(config)(x, positions)):
        assert torch.equal(ours, theirs)
    default_theta = Rotary(arch_from_target(tiny_config(), HeadConfig()))(x, positions)
    assert not torch.allclose(default_theta[0], Rotary(arch)(x, positions)[0])  # theta and scaling do reach it


def test_a_target_with_rope_per_layer_type_gives_the_head_its_global_layers_rope():
    config = tiny_config(rope_parameters=dict(LLAMA3_ROPE))
    config.rope_parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": dict(LLAMA3_ROPE)}
    assert arch_from_target(config, HeadConfig()).rope_parameters == LLAMA3_ROPE


@pytest.mark.parametrize("rope", [None, {"sliding_attention": LLAMA3_ROPE}])
def test_a_target_config_without_one_rope_parameters_dict_is_refused(rope):
    config = tiny_config(rope_parameters=dict(LLAMA3_ROPE))
    if rope is None:  # as transformers 4.x spells RoPE: rope_theta, no rope_parameters
        del config.rope_parameters
        config.rope_theta = 500000.0
    else:  # per-layer-type RoPE without global layers
        config.rope_parameters = rope
    with pytest.raises(ValueError, match="`rope_parameters`.*rope_theta"):
        arch_from_target(config, HeadConfig())
