"""Export layouts: pinned key sets and config fields per engine, dtypes, refusals, round-trip logits."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from specdistill.config import RunConfig
from specdistill.evaluate.advice import advised_chain
from specdistill.export import EAGLE3_LAYOUTS, PARALLEL_LAYOUTS, common, export_eagle3, fitting_formats, run
from specdistill.export.reader import read_head
from specdistill.heads.checkpoint import save_head
from specdistill.heads.eagle3 import Eagle3Config, Eagle3Head
from specdistill.heads.layers import HeadArch
from specdistill.layout import RunLayout

REPO = Path(__file__).resolve().parents[1]
VOCAB, DRAFT_VOCAB, H = 384, 64, 64
VERIFIER = "org/target-model"  # the speculators layout records the target it drafts for
BLOCK = ["input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
         "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


def make_head(aux=(1, 3, 4), rope=None, seed=0, fc_norm=False, mask_token_id=None) -> Eagle3Head:
    torch.manual_seed(seed)
    arch = HeadArch(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    rope_parameters=rope or {"rope_type": "default", "rope_theta": 100000.0})
    head = Eagle3Head(Eagle3Config(arch=arch, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=H,
                                   aux_layer_ids=list(aux), target_num_layers=8, fc_norm=fc_norm,
                                   parallel_drafting=mask_token_id is not None, mask_token_id=mask_token_id))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
        target_ids = torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values
        head.d2t.copy_(target_ids - torch.arange(DRAFT_VOCAB))
        head.t2d.zero_()[target_ids] = True
    return head


def draft_logits(head: Eagle3Head, seed: int = 1) -> torch.Tensor:
    """Two draft steps on random target features (the second feeds back the first's hidden state)."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(2, 5, 3 * H, generator=g)
    ids = torch.randint(0, VOCAB, (2, 5), generator=g)
    pos = torch.arange(5).expand(2, 5)
    attn = head.attention()

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, attn.expand_kv(k), attn.expand_kv(v), is_causal=True)

    with torch.no_grad():
        hidden = head.step(ids, head.initial_hidden(aux), pos, attend)
        hidden = head.step(ids.roll(-1, 1), hidden, pos + 1, attend)
        return head.logits(hidden)


def state_of(head: Eagle3Head) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in head.trainable_state_dict().items()}


def exported(out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def head() -> Eagle3Head:
    return make_head()


@pytest.fixture(scope="module")
def eagle31_head() -> Eagle3Head:
    """An Eagle 3.1 head (`fc_norm`): its per-layer norms away from ones, as every other weight."""
    return make_head(fc_norm=True)


# --- the contract of each engine, written out by hand ---------------------------------------------

SGLANG_KEYS = {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t",
               *(f"midlayer.{k}" for k in BLOCK)}
SPECULATORS_KEYS = {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                    *(f"layers.0.{k}" for k in BLOCK)}
EXPECTED_KEYS = {"sglang": SGLANG_KEYS, "vllm": SGLANG_KEYS, "trtllm": SGLANG_KEYS, "speculators": SPECULATORS_KEYS}
# Eagle 3.1: every loader builds `fc_norm` (a ModuleList, one per captured layer) beside `fc` and loads these unrenamed
# (vLLM and TensorRT-LLM under `model.`, SGLang as `model.fc_norm.<i>`, the speculators package at its top level)
FC_NORM_KEYS = {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
D2T_DTYPES = {"sglang": torch.int64, "vllm": torch.int64, "trtllm": torch.int32, "speculators": torch.int64}


@pytest.mark.parametrize("fmt", list(EAGLE3_LAYOUTS))
def test_key_set_shapes_and_dtypes(head, fmt, tmp_path):
    tensors, _ = exported(export_eagle3(head, fmt, tmp_path / fmt, target=VERIFIER))
    assert set(tensors) == EXPECTED_KEYS[fmt] == set(EAGLE3_LAYOUTS[fmt].REQUIRED_KEYS)
    block = "layers.0." if fmt == "speculators" else "midlayer."
    assert tensors["fc.weight"].shape == (H, 3 * H)
    assert tensors[f"{block}self_attn.q_proj.weight"].shape == (4 * 16, 2 * H)
    assert tensors[f"{block}self_attn.k_proj.weight"].shape == (2 * 16, 2 * H)
    assert tensors["lm_head.weight"].shape == (DRAFT_VOCAB, H)
    assert tensors["embed_tokens.weight"].shape == (VOCAB, H)
    assert tensors["d2t"].dtype == D2T_DTYPES[fmt] and tensors["d2t"].shape == (DRAFT_VOCAB,)
    assert torch.equal(tensors["d2t"].long(), head.d2t)
    floats = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    assert {v.dtype for v in floats.values()} == {torch.bfloat16}
    if fmt == "speculators":
        assert tensors["t2d"].dtype == torch.bool and torch.equal(tensors["t2d"], head.t2d)


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "trtllm"])
def test_hf_llama_config_fields(head, fmt, tmp_path):
    _, cfg = exported(export_eagle3(head, fmt, tmp_path / fmt))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False and cfg["bias"] is False
    assert (cfg["draft_vocab_size"], cfg["vocab_size"], cfg["target_hidden_size"]) == (DRAFT_VOCAB, VOCAB, H)
    assert (cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"]) == (H, 16, 2)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_scaling"] is None
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # output of layer (SGLang)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # input to layer (vLLM)
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    assert ("norm_before_residual" in cfg) == (fmt == "vllm")
    assert cfg["fc_norm"] is False  # top level, where vLLM, SGLang and TensorRT-LLM read it
    if fmt == "vllm":
        assert cfg["norm_before_residual"] is False
    if fmt == "trtllm":
        assert cfg["eagle_config"]["eh_proj_before_attn"] is False and cfg["eagle_config"]["norm_before_fc"] is False


def test_speculators_config_fields(head, tmp_path):
    _, cfg = exported(export_eagle3(head, "speculators", tmp_path / "s", target=VERIFIER, speculative_tokens=2))
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 2}]
    assert spec["verifier"]["name_or_path"] == VERIFIER
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == VOCAB
    assert layer["tie_word_embeddings"] is False and layer["rope_parameters"]["rope_theta"] == 100000.0
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (DRAFT_VOCAB, H)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["norm_before_residual"] is False  # vLLM's speculators path defaults it to True
    assert cfg["norm_before_fc"] is False and cfg["fc_norm"] is False and cfg["norm_output"] is False


def test_transformers_reads_both_rope_spellings_the_same(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    _, cfg = exported(export_eagle3(make_head(rope=rope), "sglang", tmp_path / "s"))
    assert cfg["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "eagle_config")}
    new_only = {k: v for k, v in fields.items() if k not in ("rope_theta", "rope_scaling")}
    old_only = {k: v for k, v in fields.items() if k != "rope_parameters"}
    for spelling in (fields, new_only, old_only):
        hf = LlamaConfig(**spelling)
        assert hf.rope_parameters == rope and hf.head_dim == 16 and hf.num_hidden_layers == 1


def test_reader_takes_the_old_rope_spelling_and_refuses_a_missing_one(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    out = export_eagle3(make_head(rope=rope), "sglang", tmp_path / "s", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "rope_parameters"}))
    assert read_head(out).config.arch.rope_parameters == rope
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                 if k not in ("rope_parameters", "rope_theta", "rope_scaling")}))
    with pytest.raises(common.ExportError, match=r"config.json: neither `rope_parameters` nor `rope_theta`"):
        read_head(out)


@pytest.mark.parametrize("dtype,torch_dtype", [("float16", torch.float16), ("float32", torch.float32)])
def test_dtype_on_request(head, dtype, torch_dtype, tmp_path):
    tensors, cfg = exported(export_eagle3(head, "vllm", tmp_path / "v", dtype=dtype))
    assert tensors["fc.weight"].dtype == torch_dtype and tensors["d2t"].dtype == torch.int64
    assert cfg["torch_dtype"] == dtype


@pytest.mark.parametrize("fmt", list(EAGLE3_LAYOUTS))
def test_an_eagle31_head_carries_its_norms_and_flag_in_every_layout(eagle31_head, fmt, tmp_path):
    tensors, cfg = exported(export_eagle3(eagle31_head, fmt, tmp_path / fmt, dtype="float32", target=VERIFIER))
    assert set(tensors) == EXPECTED_KEYS[fmt] | FC_NORM_KEYS
    for i in range(3):
        assert torch.equal(tensors[f"fc_norm.{i}.weight"], eagle31_head.fc_norm[i].weight), i
    # top level in each: vLLM and TensorRT-LLM read it off the config, SGLang too, vLLM's speculators conversion
    # (`update_eagle3`) copies it across
    assert cfg["fc_norm"] is True and cfg.get("norm_before_fc", False) is False


MASK_TOKEN = 7


@pytest.fixture(scope="module")
def peagle_head() -> Eagle3Head:
    return make_head(mask_token_id=MASK_TOKEN)


def mask_step_logits(head: Eagle3Head) -> torch.Tensor:
    """Logits of mask slots after real ones: what a P-EAGLE head's parallel depths compute."""
    g = torch.Generator().manual_seed(2)
    aux, ids = torch.randn(1, 4, 3 * H, generator=g), torch.randint(0, VOCAB, (1, 4), generator=g)
    attn = head.attention()

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, attn.expand_kv(k), attn.expand_kv(v), is_causal=True)

    with torch.no_grad():
        tokens, hidden = head.step_input(ids, head.initial_hidden(aux), depth=1)
        return head.logits(head.step(tokens, hidden, torch.arange(4)[None], attend))


@pytest.mark.parametrize("fmt", PARALLEL_LAYOUTS)
def test_a_peagle_head_carries_mask_hidden_and_mask_token_where_vllm_reads_them(peagle_head, fmt, tmp_path):
    tensors, cfg = exported(export_eagle3(peagle_head, fmt, tmp_path / fmt, dtype="float32", target=VERIFIER))
    assert set(tensors) == EXPECTED_KEYS[fmt] | {"mask_hidden"}
    # vLLM's buffer is [1, 3H] and takes `.view(1, -1)` of what it loads; speculators' parameter is [1, 1, 3H]
    assert tensors["mask_hidden"].shape == ((1, 3 * H) if fmt == "vllm" else (1, 1, 3 * H))
    assert torch.equal(tensors["mask_hidden"].reshape(1, -1), peagle_head.mask_hidden)
    assert cfg["mask_token_id"] == MASK_TOKEN  # read by vLLM's proposer (HF layout) and `update_peagle` (speculators)
    if fmt == "speculators":
        assert cfg["speculators_model_type"] == "peagle" and cfg["speculators_config"]["algorithm"] == "peagle"
    else:
        assert cfg["parallel_drafting"] is True  # for our reader and worker; vLLM takes it from the serve call
    back = read_head(tmp_path / fmt)
    assert back.config == peagle_head.config
    assert torch.equal(mask_step_logits(back), mask_step_logits(peagle_head))
    assert not torch.equal(mask_step_logits(back), mask_step_logits(make_head(mask_token_id=MASK_TOKEN + 1)))


def test_a_peagle_head_is_refused_where_no_engine_defines_its_layout(peagle_head, tmp_path):
    assert fitting_formats(peagle_head) == PARALLEL_LAYOUTS and fitting_formats(make_head()) == ["sglang", "vllm"]
    for fmt in ("sglang", "trtllm"):
        with pytest.raises(common.ExportError, match="does not fit a P-EAGLE head"):
            export_eagle3(peagle_head, fmt, tmp_path / fmt, target=VERIFIER)
        assert not (tmp_path / fmt).exists()
    with pytest.raises(common.ExportError, match="without `fc_norm`"):  # vLLM's `update_peagle` would drop the norms
        export_eagle3(make_head(fc_norm=True, mask_token_id=MASK_TOKEN), "speculators", tmp_path / "s", target=VERIFIER)


# --- round trip -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fc_norm", [False, True])
@pytest.mark.parametrize("fmt", list(EAGLE3_LAYOUTS))
def test_round_trip_gives_identical_logits(head, eagle31_head, fmt, fc_norm, tmp_path):
    ours = eagle31_head if fc_norm else head
    back = read_head(export_eagle3(ours, fmt, tmp_path / fmt, dtype="float32", target=VERIFIER))
    assert back.config == ours.config
    assert torch.equal(back.d2t, ours.d2t) and torch.equal(back.t2d, ours.t2d)
    assert torch.equal(draft_logits(back), draft_logits(ours))


def test_round_trip_bf16_equals_the_head_cast_to_bf16(head, tmp_path):
    back = read_head(export_eagle3(head, "trtllm", tmp_path / "t"), dtype=torch.bfloat16)
    ours = state_of(head)
    for key, value in back.trainable_state_dict().items():
        expected = ours[key].to(torch.bfloat16) if ours[key].dtype.is_floating_point else ours[key]
        assert torch.equal(value, expected), key
    assert torch.allclose(draft_logits(back.float()), draft_logits(head), atol=0.15)


# --- refusals -------------------------------------------------------------------------------------

def test_refuses_wrong_shape_and_writes_nothing(head, tmp_path):
    state = state_of(head) | {"fc.weight": torch.zeros(H, 2 * H)}
    with pytest.raises(common.ExportError, match=r"`fc.weight` has shape \[64, 128\], expected \[64, 192\]"):
        EAGLE3_LAYOUTS["sglang"].convert(state, head.config)


def test_refuses_missing_key(head):
    state = state_of(head)
    del state["midlayer.hidden_norm.weight"]
    with pytest.raises(common.ExportError, match=r"missing keys \['midlayer.hidden_norm.weight'\]"):
        EAGLE3_LAYOUTS["vllm"].convert(state, head.config)


def test_refuses_bad_vocab_map_and_dtypes(head):
    bad_d2t = state_of(head) | {"d2t": torch.full((DRAFT_VOCAB,), VOCAB)}
    with pytest.raises(common.ExportError, match="outside the target vocabulary"):
        EAGLE3_LAYOUTS["sglang"].convert(bad_d2t, head.config)
    int_weight = state_of(head) | {"norm.weight": torch.ones(H, dtype=torch.int64)}
    with pytest.raises(common.ExportError, match="`norm.weight` has dtype torch.int64"):
        EAGLE3_LAYOUTS["sglang"].convert(int_weight, head.config)
    with pytest.raises(common.ExportError, match="export dtype 'int8'"):
        EAGLE3_LAYOUTS["sglang"].convert(state_of(head), head.config, dtype="int8")


def test_two_captured_layers_fit_trtllm_only(tmp_path):
    two = make_head(aux=(1, 4))
    with pytest.raises(common.ExportError, match="exactly 3 captured layers"):
        export_eagle3(two, "sglang", tmp_path / "s")
    assert not (tmp_path / "s").exists()
    assert torch.equal(draft_logits_2(read_head(export_eagle3(two, "trtllm", tmp_path / "t", dtype="float32"))),
                       draft_logits_2(two))
    two_normed = make_head(aux=(1, 4), fc_norm=True)  # TensorRT-LLM builds one norm per captured layer
    out = export_eagle3(two_normed, "trtllm", tmp_path / "t31", dtype="float32")
    assert {k for k in exported(out)[0] if k.startswith("fc_norm.")} == {"fc_norm.0.weight", "fc_norm.1.weight"}
    assert torch.equal(draft_logits_2(read_head(out)), draft_logits_2(two_normed))


def draft_logits_2(head: Eagle3Head) -> torch.Tensor:
    """Logits of one step for a head reading two captured layers."""
    aux = torch.randn(1, 4, 2 * H, generator=torch.Generator().manual_seed(3))
    attn = head.attention()
    with torch.no_grad():
        hidden = head.step(torch.arange(4)[None], head.initial_hidden(aux), torch.arange(4)[None],
                           lambda q, k, v: F.scaled_dot_product_attention(q, attn.expand_kv(k), attn.expand_kv(v),
                                                                          is_causal=True))
        return head.logits(hidden)


def test_refuses_what_an_engine_would_read_wrongly(head, tmp_path):
    with pytest.raises(common.ExportError, match="no verifier"):  # vLLM would serve no model
        export_eagle3(head, "speculators", tmp_path / "s")
    with pytest.raises(common.ExportError, match="distinct ascending layer outputs"):  # engines concatenate ascending
        export_eagle3(make_head(aux=(4, 1, 3)), "vllm", tmp_path / "v")
    narrow = make_head()
    narrow.config = dataclasses.replace(narrow.config, target_hidden_size=2 * H)
    narrow.fc = torch.nn.Linear(3 * 2 * H, H, bias=False)
    for fmt in ("sglang", "speculators"):  # their loaders put the target's embedding into the draft
        with pytest.raises(common.ExportError, match="the head is 64 wide, the target 128"):
            export_eagle3(narrow, fmt, tmp_path / fmt, target=VERIFIER)
    export_eagle3(narrow, "vllm", tmp_path / "v")  # the vllm layout carries the head's own embedding
    assert not any((tmp_path / fmt).exists() for fmt in ("s", "sglang", "speculators"))


def test_refuses_a_target_of_other_dimensions(head, tmp_path):
    with pytest.raises(common.ExportError, match="target config `hidden_size` = 128"):
        export_eagle3(head, "sglang", tmp_path / "s", target_config={"vocab_size": VOCAB, "hidden_size": 128,
                                                                      "num_hidden_layers": 8})


def test_export_replaces_its_own_files_and_keeps_the_users(head, tmp_path):
    out = tmp_path / "sglang"
    out.mkdir()
    (out / "model.safetensors").write_text("an older export")
    (out / "serve.sh").write_text("python -m sglang.launch_server ...")
    export_eagle3(head, "sglang", out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "serve.sh"]
    assert (out / "serve.sh").read_text().startswith("python -m sglang")
    assert load_file(out / "model.safetensors")  # the new weights, not the old text
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_reader_refuses_fc_norm_weights_without_the_flag_and_the_flag_without_them(eagle31_head, tmp_path):
    out = export_eagle3(eagle31_head, "vllm", tmp_path / "v", dtype="float32")
    tensors, cfg = exported(out)
    (out / "config.json").write_text(json.dumps(cfg | {"fc_norm": False}))
    with pytest.raises(common.ExportError, match=r"keys \['fc_norm.0.weight', 'fc_norm.1.weight', 'fc_norm.2.weight'\] "
                                                 r"are not in the vllm layout"):
        read_head(out)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in tensors.items() if not k.startswith("fc_norm.")}, str(out / "model.safetensors"))
    with pytest.raises(common.ExportError, match=r"missing keys \['fc_norm.0.weight', 'fc_norm.1.weight', "):
        read_head(out)


def test_reader_refuses_unknown_keys_and_inconsistent_layer_ids(head, tmp_path):
    out = export_eagle3(head, "sglang", tmp_path / "s", dtype="float32")
    tensors, cfg = exported(out)
    save_file(tensors | {"layers.0.hidden_norm.weight": torch.ones(H)}, str(out / "model.safetensors"))
    with pytest.raises(common.ExportError, match=r"keys \['layers.0.hidden_norm.weight'\] are not in the sglang"):
        read_head(out)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg | {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}))
    with pytest.raises(common.ExportError, match="disagrees with top-level"):
        read_head(out)


# --- the pipeline stage and the command line ------------------------------------------------------

def test_stage_prefers_best_and_writes_every_format(head, tmp_path):
    cfg = RunConfig(name="exp", run_root=str(tmp_path))
    cfg.export.formats = ["sglang", "speculators"]
    save_head(make_head(seed=5), RunLayout.of(cfg).run_dir / "ckpt" / "final")
    save_head(head, RunLayout.of(cfg).run_dir / "ckpt" / "best")
    result = run.run(cfg, RunLayout.of(cfg))
    assert result == {"formats": {f: str(RunLayout.of(cfg).run_dir / "export" / f) for f in ("sglang", "speculators")}}
    back = read_head(RunLayout.of(cfg).run_dir / "export" / "speculators")
    assert torch.equal(back.fc.weight, head.fc.weight.to(torch.bfloat16).float())
    spec = exported(RunLayout.of(cfg).run_dir / "export" / "speculators")[1]["speculators_config"]
    assert spec["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3  # no evaluation yet: the default


def test_stage_takes_the_speculative_tokens_the_dev_evaluation_advises(head, tmp_path):
    cfg = RunConfig(name="exp", run_root=str(tmp_path))
    cfg.export.formats = ["speculators"]
    layout = RunLayout.of(cfg)
    save_head(head, layout.run_dir / "ckpt" / "best")
    layout.report_file.parent.mkdir(parents=True)
    advice = {"split": "dev",
              "serving_advice": {"per_batch": [{"batch_size": 1, "vllm_steps": 2}, {"batch_size": 8, "vllm_steps": 1}]}}

    def exported_chain(report: dict) -> int:
        layout.report_file.write_text(json.dumps(report))
        run.run(cfg, layout, advised_chain(layout.report_file))
        return exported(layout.export_dir / "speculators")[1]["speculators_config"]["proposal_methods"][0][
            "speculative_tokens"]

    assert exported_chain(advice) == 2
    assert exported_chain({**advice, "split": "test"}) == 3  # a test-split report sets no default
    assert exported_chain({"split": "dev"}) == 3  # no advice
    cfg.export.speculative_tokens = 4  # set: it wins
    assert exported_chain(advice) == 4


def test_stage_refuses_mtp_formats_for_an_eagle3_head_before_writing(head, tmp_path):
    cfg = RunConfig(name="exp", run_root=str(tmp_path))
    cfg.export.formats = ["sglang", "native_mtp"]
    save_head(head, RunLayout.of(cfg).run_dir / "ckpt" / "final")
    with pytest.raises(common.ExportError, match=r"\['native_mtp'\] do not fit the eagle3 head"):
        run.run(cfg, RunLayout.of(cfg))
    assert not (RunLayout.of(cfg).run_dir / "export").exists()


def test_cli(head, tmp_path):
    save_head(head, tmp_path / "ckpt")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "export.py"), f"ckpt={tmp_path / 'ckpt'}",
         "formats=[sglang,vllm,trtllm]", "dtype=float32", f"out={tmp_path / 'out'}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"vllm: {tmp_path / 'out' / 'vllm'}" in proc.stdout
    assert torch.equal(draft_logits(read_head(tmp_path / "out" / "trtllm")), draft_logits(head))
    spec = subprocess.run([sys.executable, str(REPO / "scripts" / "export.py"), f"ckpt={tmp_path / 'ckpt'}",
                           "formats=[speculators]", f"verifier={VERIFIER}", "speculative_tokens=2", f"out={tmp_path / 'o'}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert spec.returncode == 0, spec.stderr
    assert exported(tmp_path / "o" / "speculators")[1]["speculators_config"]["verifier"]["name_or_path"] == VERIFIER
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "export.py"), f"ckpt={tmp_path / 'none'}",
                          f"out={tmp_path / 'out2'}"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and "no head_config.json" in bad.stdout + bad.stderr


# --- interoperability: the `speculators` package loads our speculators export ---------------------

@pytest.mark.parametrize("fc_norm", [False, True])
def test_speculators_package_loads_our_export_with_the_same_logits(head, eagle31_head, fc_norm, tmp_path):
    try:
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    except Exception as err:  # noqa: BLE001 - any import failure means the package cannot run beside ours
        reason = (f"the `speculators` package is not importable here ({type(err).__name__}: {err}); "
                  "speculators 0.9.0 requires transformers<=5.19, older than this environment's, so "
                  "`make test SLOW=1` runs this test in its own environment (`make interop`)")
        if os.environ.get("SPECDISTILL_INTEROP") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    from transformers import LlamaForCausalLM

    verifier = tmp_path / "verifier"  # the package reads the verifier's config and embedding
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=128, num_hidden_layers=8,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(verifier)
    head = eagle31_head if fc_norm else head
    out = export_eagle3(head, "speculators", tmp_path / "spec", dtype="float32", target=str(verifier))
    config = Eagle3SpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(str(out), config=config).float().eval()
    assert torch.equal(model.lm_head.weight, head.lm_head.weight) and torch.equal(model.d2t, head.d2t)
    assert (model.fc_norm is not None) == fc_norm
    for theirs, ours in zip(model.fc_norm or [], head.fc_norm or []):
        assert torch.equal(theirs.weight, ours.weight) and theirs.variance_epsilon == ours.eps

    g = torch.Generator().manual_seed(1)
    aux, ids, pos = torch.randn(2, 5, 3 * H, generator=g), torch.randint(0, VOCAB, (2, 5), generator=g), torch.arange(5)
    causal = torch.full((5, 5), float("-inf")).triu(1)[None, None].expand(2, 1, 5, 5)
    with torch.no_grad():
        # the package's forward: each captured layer through its own norm (Eagle 3.1), then fc
        normed = torch.cat([norm(x) for norm, x in zip(model.fc_norm, aux.chunk(3, -1))], -1) if fc_norm else aux
        x = torch.cat([model.embed_tokens(ids), model.fc(normed)], dim=-1)
        h = model.layers[0](x, attention_mask=causal, position_ids=pos[None].expand(2, 5),
                            position_embeddings=model.rotary_emb(x, pos[None].expand(2, 5)))
        theirs = model.lm_head(model.norm(h))
        attn = head.attention()
        ours = head.logits(head.step(ids, head.initial_hidden(aux), pos.expand(2, 5), lambda q, k, v:
                                     F.scaled_dot_product_attention(q, attn.expand_kv(k), attn.expand_kv(v),
                                                                    is_causal=True)))
    assert torch.allclose(theirs, ours, atol=1e-5), (theirs - ours).abs().max()
