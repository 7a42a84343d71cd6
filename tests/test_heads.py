"""The head's block is sized and rotated as its target: RoPE comes from the target's `rope_parameters` or the
build stops. An Eagle 3.1 head (`fc_norm`) norms each captured layer before `fc` as vLLM does, and keeps its norms
through a checkpoint."""

import json

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specdistill.config import HeadConfig
from specdistill.heads.build import arch_from_target
from specdistill.heads.checkpoint import HEAD_CONFIG, load_head, save_head
from specdistill.heads.eagle3 import Eagle3Config, Eagle3Head
from specdistill.heads.layers import Rotary
from specdistill.io import write_checksums

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


# --- Eagle 3.1: one RMSNorm per captured layer before fc ------------------------------------------------


def eagle31_head(fc_norm: bool = True) -> Eagle3Head:
    """A small EAGLE-3 head over three captured layers, its per-layer norms (if any) away from ones."""
    torch.manual_seed(0)
    arch = arch_from_target(tiny_config(rope_parameters=dict(LLAMA3_ROPE), rms_norm_eps=1e-3), HeadConfig())
    head = Eagle3Head(Eagle3Config(arch=arch, vocab_size=64, draft_vocab_size=64, target_hidden_size=32,
                                   aux_layer_ids=[1, 2, 3], target_num_layers=6, fc_norm=fc_norm))
    with torch.no_grad():
        for norm in head.fc_norm or []:
            norm.weight.copy_(1 + 0.3 * torch.randn_like(norm.weight))
    return head


def test_an_eagle31_head_norms_each_captured_layer_before_fc_as_vllm_does():
    head = eagle31_head()
    aux = torch.randn(2, 5, 3 * 32) * torch.tensor([2.0, 8.0, 30.0]).repeat_interleave(32)  # layers of unlike scales
    # vLLM's combine_hidden_states: chunk the concatenation per layer, RMSNorm each (the draft's rms_norm_eps), fc
    normed = [w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3)
              for w, x in zip([n.weight for n in head.fc_norm], aux.chunk(3, dim=-1))]
    with torch.no_grad():
        torch.testing.assert_close(head.initial_hidden(aux), head.fc(torch.cat(normed, -1)), rtol=1e-6, atol=1e-6)
        layer_scaled = aux * torch.tensor([3.0, 1.0, 0.5]).repeat_interleave(32)  # a layer's scale stops at its norm
        torch.testing.assert_close(head.initial_hidden(layer_scaled), head.initial_hidden(aux), rtol=1e-3, atol=1e-3)
    assert [k for k in eagle31_head(fc_norm=False).state_dict() if "fc_norm" in k] == []  # plain EAGLE-3 as before


def test_an_eagle31_head_round_trips_its_checkpoint_and_an_older_one_loads_as_plain(tmp_path):
    head = eagle31_head()
    save_head(head, tmp_path / "eagle31")
    back = load_head(tmp_path / "eagle31")
    assert back.config.fc_norm and back.config == head.config
    for key, value in head.trainable_state_dict().items():
        assert torch.equal(back.trainable_state_dict()[key], value), key
    save_head(eagle31_head(fc_norm=False), tmp_path / "older")
    config = json.loads((tmp_path / "older" / HEAD_CONFIG).read_text())
    del config["fc_norm"]  # written before the field existed
    (tmp_path / "older" / HEAD_CONFIG).write_text(json.dumps(config))
    write_checksums(tmp_path / "older")
    older = load_head(tmp_path / "older")
    assert not older.config.fc_norm and older.fc_norm is None
