"""MTP layouts as pure key maps over a synthetic MTP state dict (the MTP head's key names)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specdistill.export import common, deepseek_mtp, qwen3_next_mtp
from specdistill.heads.layers import HeadArch

ARCH = HeadArch(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
DIMS = common.MTPDims(arch=ARCH, vocab_size=384, target_num_layers=8)
BLOCK = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
         "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


def mtp_module(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*shape, generator=g) for k, shape in common.mtp_shapes(DIMS).items()}


def test_mtp_state_dict_names():
    assert set(common.MTP_KEYS) == {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                                    "norm.weight", "lm_head.weight", *(f"layers.0.{k}" for k in BLOCK)}
    assert common.mtp_shapes(DIMS)["eh_proj.weight"] == (64, 128)


def test_deepseek_layout_keys_values_and_config(tmp_path):
    modules = [mtp_module(0), mtp_module(1)]
    converted = deepseek_mtp.convert(modules, DIMS)
    per_layer = {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                 "shared_head.norm.weight", "shared_head.head.weight", *BLOCK}
    assert set(converted.tensors) == {f"model.layers.{i}.{k}" for i in (8, 9) for k in per_layer}
    assert set(deepseek_mtp.REQUIRED_KEYS) == per_layer
    assert torch.equal(converted.tensors["model.layers.9.shared_head.head.weight"],
                       modules[1]["lm_head.weight"].to(torch.bfloat16))
    assert torch.equal(converted.tensors["model.layers.8.self_attn.q_proj.weight"],
                       modules[0]["layers.0.self_attn.q_proj.weight"].to(torch.bfloat16))
    assert converted.config["num_nextn_predict_layers"] == 2 and converted.config["num_hidden_layers"] == 8
    out = common.write_export(tmp_path / "ds", converted)
    assert set(load_file(str(out / "mtp.safetensors"))) == set(converted.tensors)


def test_deepseek_stitches_the_target_config_and_index(tmp_path):
    target_config = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "vocab_size": 384,
                     "num_hidden_layers": 8, "q_lora_rank": 32}
    index = {"metadata": {"total_size": 1}, "weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}
    converted = deepseek_mtp.convert([mtp_module()], DIMS, "float32", target_config, index)
    assert converted.config == target_config | {"num_nextn_predict_layers": 1}
    out = common.write_export(tmp_path / "ds", converted)
    stitched = json.loads((out / common.INDEX_FILE).read_text())
    assert stitched["weight_map"]["model.norm.weight"] == "model-00001-of-00001.safetensors"
    assert stitched["weight_map"]["model.layers.8.eh_proj.weight"] == "mtp.safetensors"
    assert len(stitched["weight_map"]) == 1 + len(converted.tensors)
    clash = {"weight_map": {"model.layers.8.enorm.weight": "x.safetensors"}}
    with pytest.raises(common.ExportError, match="already holds MTP keys"):
        deepseek_mtp.convert([mtp_module()], DIMS, target_config=target_config, target_index=clash)
    with pytest.raises(common.ExportError, match="target config `num_hidden_layers` = 12"):
        deepseek_mtp.convert([mtp_module()], DIMS, target_config=target_config | {"num_hidden_layers": 12})


def test_qwen3_next_layout_keys_and_config():
    module = mtp_module()
    converted = qwen3_next_mtp.convert([module], DIMS, "float32")
    assert set(converted.tensors) == {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
                                      "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
                                      *(f"mtp.layers.0.{k}" for k in BLOCK)} == set(qwen3_next_mtp.REQUIRED_KEYS)
    assert torch.equal(converted.tensors["mtp.fc.weight"], module["eh_proj.weight"])
    assert torch.equal(converted.tensors["mtp.pre_fc_norm_hidden.weight"], module["hnorm.weight"])
    assert converted.config["num_nextn_predict_layers"] == 1


def test_mtp_refusals():
    bad = mtp_module() | {"eh_proj.weight": torch.zeros(64, 64)}
    with pytest.raises(common.ExportError, match=r"module 0: `eh_proj.weight` has shape \[64, 64\], expected \[64, 128\]"):
        deepseek_mtp.convert([bad], DIMS)
    missing = {k: v for k, v in mtp_module().items() if k != "hnorm.weight"}
    with pytest.raises(common.ExportError, match=r"missing keys \['hnorm.weight'\]"):
        qwen3_next_mtp.convert([missing], DIMS)
    with pytest.raises(common.ExportError, match="exactly one"):
        qwen3_next_mtp.convert([mtp_module(0), mtp_module(1)], DIMS)
    with pytest.raises(common.ExportError, match="no MTP module"):
        deepseek_mtp.convert([], DIMS)


def test_deepseek_refuses_a_pruned_draft_vocabulary():
    pruned = common.MTPDims(arch=ARCH, vocab_size=384, target_num_layers=8, draft_vocab_size=64)
    module = mtp_module() | {"lm_head.weight": torch.randn(64, 64)}
    with pytest.raises(common.ExportError, match="full-vocabulary head"):
        deepseek_mtp.convert([module], pruned)
    assert set(qwen3_next_mtp.convert([module], pruned).tensors) == set(qwen3_next_mtp.REQUIRED_KEYS)


def test_mtp_head_through_the_export_stage(tmp_path):
    from specdistill.config import RunConfig
    from specdistill.export import run
    from specdistill.heads import save_head
    from specdistill.heads.mtp import MTPConfig, MTPHead

    head = MTPHead(MTPConfig(arch=ARCH, vocab_size=384, draft_vocab_size=384, target_hidden_size=64,
                             aux_layer_ids=[1, 3, 4], target_num_layers=8, num_modules=2))
    cfg = RunConfig(name="mtp", run_root=str(tmp_path))
    cfg.export.formats = ["deepseek_mtp"]
    save_head(head, cfg.run_dir / "ckpt" / "final")
    out = run.run(cfg, target=None)["formats"]["deepseek_mtp"]
    tensors = load_file(f"{out}/mtp.safetensors")
    assert {k.split(".")[2] for k in tensors} == {"8", "9"}
    assert torch.equal(tensors["model.layers.9.eh_proj.weight"], head.mtp[1].eh_proj.weight.to(torch.bfloat16))
    cfg.export.formats = ["sglang"]
    with pytest.raises(common.ExportError, match=r"\['sglang'\] do not fit the mtp head"):
        run.run(cfg, target=None)
