"""A target's own MTP module (GLM-4.5, DeepSeek-V3, Qwen3-Next, MiMo families, tiny random): built from the target's
transformers classes, run with the semantics its `MTP_FAMILIES` entry declares, drafted as it was trained, and
exported in the keys of the target's own checkpoint, which transformers reads back into the same module. Whether
each entry is vLLM's is pinned against vLLM's own MTP model in test_native_mtp_vllm.py."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpLayer

from specdistill.config import ConfigError, HeadConfig, RandomTargetConfig, TargetConfig
from specdistill.data.generate import LocalGenerator
from specdistill.decode import loop
from specdistill.decode.drafters import Drafter, HeadProposer, LookupProposer
from specdistill.decode.loop import plain_generate, speculative_generate
from specdistill.export import common, export_mtp, native_mtp
from specdistill.export.run import export_checkpoint
from specdistill.heads.build import build_head
from specdistill.heads.checkpoint import load_head, save_head
from specdistill.heads.native_mtp import (
    MTP_FAMILIES,
    family_classes,
    family_name,
    with_one_mtp_layer,
)
from specdistill.layout import RunLayout
from specdistill.target import load_target, save_hf_folder
from specdistill.target_runner import TargetRunner
from specdistill.train.loss import LOSSES
from specdistill.train.ttt import unroll_ttt
from tests.test_ttt import random_batch, random_teacher

FAMILIES = ["glm4_moe", "deepseek_v3", "qwen3_next", "mimo"]
NO_DRAFT_VOCAB = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool))  # the module drafts the full one


def random_target(family: str):
    return load_target(TargetConfig(name="random", random=RandomTargetConfig(family=family)))


@pytest.fixture(scope="module", params=FAMILIES)
def target(request):
    return random_target(request.param)


def native_head(target, seed=0):
    torch.manual_seed(seed)
    head = build_head(HeadConfig(kind="mtp"), target, *NO_DRAFT_VOCAB)
    with torch.no_grad():  # away from the last-layer start, so every weight matters
        for p in head.layer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head.eval()


def reference_step0(target, head, ids, last):
    """transformers' own MtpLayer (eager attention, causal mask) fed as vLLM feeds it: the target's post-norm
    output and the embedding, zeroed at position 0 where the family does; returns the layer's post-normed output."""
    config = transformers.AutoConfig.for_model(**head.config.target_config)
    config._attn_implementation, config._experts_implementation = "eager", "eager"
    layer_cls, norm_cls, rotary_cls = family_classes(config)
    mtp_config = with_one_mtp_layer(config).get_mtp_config()  # its concatenation order too
    ref = MtpLayer(mtp_config, layer_cls, norm_cls, 0).eval()
    ref.load_state_dict(head.layer.state_dict())
    T = ids.shape[1]
    positions = torch.arange(T)[None]
    emb = target.model.get_input_embeddings()(ids)
    if family_of(target).masks_position0:
        emb[:, 0] = 0
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    hidden = target.model.get_decoder().norm(last)
    return ref(emb, hidden, rotary_cls(config=mtp_config)(emb, positions), mask, positions, None)


def family_of(target):
    return MTP_FAMILIES[family_name(target.config.to_dict())]


def test_a_target_with_mtp_layers_gets_its_own_module(target):
    head = native_head(target)
    tc = target.config
    assert head.config.kind == "native_mtp" and head.config.draft_vocab_size == tc.vocab_size
    last = target.model.get_decoder().layers[-1]  # a full-attention layer in every family here
    assert type(head.layer.mtp_block) is type(last) and type(head.layer.mtp_block.mlp) is type(last.mlp)
    assert getattr(head.layer.mtp_block, "layer_type", "full_attention") == "full_attention"  # Qwen3-Next
    # the engine drafts with the target's embedding and lm_head: frozen copies of them
    assert torch.equal(head.embed_tokens.weight, target.model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head.weight, target.model.get_output_embeddings().weight)
    assert not head.embed_tokens.weight.requires_grad and not head.lm_head.weight.requires_grad
    assert torch.equal(head.target_norm.weight, target.model.get_decoder().norm.weight)


def test_step0_is_the_engines_forward_of_transformers_own_layer(target):
    head = native_head(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (2, 9), generator=g)
    last = torch.randn(2, 9, target.hidden_size, generator=g)
    batch = random_batch(2, 9, head)
    batch.input_ids_BT, batch.last_BTH = ids, last
    seen = []
    with torch.no_grad():
        unroll_ttt(head, batch, random_teacher(2, 9, head), 1, 0.8,
                   lambda lg, t: seen.append(lg) or LOSSES["forward_kl"](lg, t))
        out = reference_step0(target, head, ids[:, 1:], last[:, :-1])  # step 0 at position t reads token t+1
        expected = target.model.get_output_embeddings()(out)
    torch.testing.assert_close(seen[0], expected[:, : seen[0].shape[1]], atol=2e-5, rtol=2e-5)


def test_semantics_position0_carry_and_one_layer_for_every_step(target):
    head = native_head(target)
    g = torch.Generator().manual_seed(1)
    last = torch.randn(1, 4, target.hidden_size, generator=g)
    hidden = head.initial_hidden(None, last)
    positions = torch.arange(4)[None]
    keys, values = [], []

    def attend(q, k, v):
        keys.append(head.expand_kv(k))
        values.append(head.expand_kv(v))
        return torch.nn.functional.scaled_dot_product_attention(q, keys[-1], values[-1], is_causal=True)

    with torch.no_grad():
        a = head.step(torch.tensor([[5, 6, 7, 8]]), hidden, positions, attend)
        b = head.step(torch.tensor([[9, 6, 7, 8]]), hidden, positions, attend)
        # the token at position 0 is never seen (its embedding is zeroed), except on Qwen3-Next
        assert torch.equal(a, b) == family_of(target).masks_position0
        shifted = [head.step(torch.tensor([tokens]), hidden, positions + 1, attend)
                   for tokens in ([5, 6, 7, 8], [9, 6, 7, 8])]
        assert not torch.equal(*[s[:, 0] for s in shifted])  # at any other position it is
        c = head.step(torch.tensor([[9, 6, 7, 8]]), hidden, positions, attend, depth=2)
        assert torch.equal(b, c)  # every step runs MTP layer 0, as the engine's proposer does
        # the carried hidden: after the layer's final norm (DeepSeek-V3, Qwen3-Next, MiMo), before it (GLM-4.5)
        normed = reference_step0(target, head, torch.tensor([[5, 6, 7, 8]]), last)
        carries_normed = target.config.model_type != "glm4_moe"
        torch.testing.assert_close(a if carries_normed else head.layer.post_norm(a), normed, atol=2e-5, rtol=2e-5)
        assert not torch.allclose(head.layer.post_norm(a) if carries_normed else a, normed)
        torch.testing.assert_close(head.logits(a), target.model.get_output_embeddings()(normed))
        # step 0 reads the target's output after its final norm
        torch.testing.assert_close(hidden, target.model.get_decoder().norm(last))


def test_drafting_reproduces_the_training_unroll(target):
    head = native_head(target)
    T, steps, t = 10, 3, 5
    batch = random_batch(1, T, head)
    per_step = []
    with torch.no_grad():
        unroll_ttt(head, batch, random_teacher(1, T, head), steps, 0.8,
                   lambda lg, tg: per_step.append(lg) or LOSSES["forward_kl"](lg, tg))
    ids = batch.input_ids_BT
    drafter = Drafter(head, head.config.vocab_size)
    logp = drafter.extend(batch.aux_BTA[:, : t + 1], batch.last_BTH[:, : t + 1], ids[:, 1 : t + 2], 0)
    torch.testing.assert_close(logp, torch.log_softmax(per_step[0][:, t], -1), atol=2e-5, rtol=2e-5)
    parent = torch.full((1, 1), -1)
    for j in range(1, steps):
        logp = drafter.step(ids[:, t + 1 + j : t + 2 + j], parent, depth=j)
        torch.testing.assert_close(logp[:, 0], torch.log_softmax(per_step[j][:, t], -1), atol=2e-5, rtol=2e-5)
        parent = torch.zeros(1, 1, dtype=torch.long)


def test_the_unroll_trains_the_module_only(target):
    head = native_head(target).train()
    batch, teacher = random_batch(2, 8, head), random_teacher(2, 8, head)
    unroll_ttt(head, batch, teacher, 3, 0.8, LOSSES["forward_kl"]).loss.backward()
    trained = {n for n, p in head.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {"layer.eh_proj.weight", "layer.enorm.weight", "layer.hnorm.weight", "layer.post_norm.weight"} <= trained
    assert any(n.startswith("layer.mtp_block.self_attn.") for n in trained)
    assert not trained & {"embed_tokens.weight", "lm_head.weight", "target_norm.weight"}


# where each family's released checkpoint holds MTP layer 0, as vLLM's loaders read it (written out here, not taken
# from the code under test): the layer's own tensors, and the prefix of its decoder block's
DEEPSEEK_OWN = ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens")
CHECKPOINT_LAYOUT = {
    "glm4_moe": ({f"model.layers.{{L}}.{k}.weight" for k in DEEPSEEK_OWN}, "model.layers.{L}."),
    "deepseek_v3": ({f"model.layers.{{L}}.{k}.weight" for k in DEEPSEEK_OWN}, "model.layers.{L}."),
    "qwen3_next": ({f"mtp.{k}.weight" for k in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")},
                   "mtp.layers.0."),
    "mimo": ({f"model.mtp_layers.0.{k}.weight" for k in ("token_layernorm", "hidden_layernorm", "input_proj",
                                                          "final_layernorm")}, "model.mtp_layers.0."),
}


def checkpoint_keys_of_layer(target, prefix: str) -> set[str]:
    """The keys transformers writes for the target's last decoder layer, under `prefix`."""
    last = f"model.layers.{target.config.num_hidden_layers - 1}."
    state = {k: v for k, v in target.model.state_dict().items() if k.startswith(last)}
    reverted = transformers.core_model_loading.revert_weight_conversion(target.model, state)
    return {prefix + k.removeprefix(last) for k in reverted}


def test_export_holds_the_checkpoint_keys_and_transformers_reads_them_back(target, tmp_path):
    head = native_head(target)
    L = target.config.num_hidden_layers
    served = save_hf_folder(target.model, target.tokenizer, tmp_path / "target")
    out = export_mtp(head, tmp_path / "export", "float32")
    tensors = load_file(str(out / native_mtp.WEIGHTS_FILE))
    own, block = CHECKPOINT_LAYOUT[family_name(target.config.to_dict())]
    assert set(tensors) == checkpoint_keys_of_layer(target, block.format(L=L)) | {k.format(L=L) for k in own}
    if hasattr(head.layer.mtp_block.mlp, "experts"):  # experts one by one, as checkpoints hold them
        assert any(".mlp.experts.0.gate_proj.weight" in k for k in tensors)
    config = json.loads((out / common.CONFIG_FILE).read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert config["architectures"] == (target.config.architectures or [type(target.model).__name__])
    # laid over the one-file target, its model.safetensors holds the layer; a new module starts where this one ended
    over = export_mtp(head, tmp_path / "over", "float32", served)
    assert sorted(p.name for p in over.iterdir()) == ["config.json", "model.safetensors"]
    for path in over.iterdir():
        (served / path.name).write_bytes(path.read_bytes())
    reloaded = load_target(TargetConfig(name=str(served)))
    again = build_head(HeadConfig(kind="mtp"), reloaded, *NO_DRAFT_VOCAB)
    for key, value in head.layer.state_dict().items():
        torch.testing.assert_close(again.layer.state_dict()[key], value, msg=key)
    # a sharded checkpoint: the export re-points the index and rewrites the shard holding the stale layer
    everything = load_file(str(served / "model.safetensors"))
    (served / "model.safetensors").unlink()
    shard = "model-00001-of-00001.safetensors"
    save_file(everything, str(served / shard), metadata={"format": "pt"})
    (served / common.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(everything, shard)}))
    converted = native_mtp.convert(head, "float32", served)
    assert converted.weights_file == native_mtp.WEIGHTS_FILE and set(converted.extra_tensors) == {shard}
    assert set(converted.extra_tensors[shard]) == set(everything) - set(tensors)
    index = converted.extra_json[common.INDEX_FILE]["weight_map"]
    assert {k for k, v in index.items() if v == native_mtp.WEIGHTS_FILE} == set(tensors)


def test_no_engine_layout_for_an_mtp_head_without_native_mtp_layers(tmp_path):
    target = load_target(TargetConfig(name="random"))  # Llama: no MTP layers of its own
    vocab = target.vocab_size
    head = build_head(HeadConfig(kind="mtp", copy_init=False), target, torch.zeros(vocab, dtype=torch.long),
                      torch.ones(vocab, dtype=torch.bool))
    assert head.config.kind == "mtp"
    with pytest.raises(common.ExportError, match="no engine layout.*research option"):
        native_mtp.convert(head)
    save_head(head, tmp_path / "ckpt")
    assert export_checkpoint(tmp_path / "ckpt", None, tmp_path / "out") == {}  # the fitting layouts: none
    with pytest.raises(common.ExportError, match="no engine layout"):
        export_checkpoint(tmp_path / "ckpt", ["native_mtp"], tmp_path / "out")
    native = native_head(random_target("glm4_moe"))
    save_head(native, tmp_path / "native")
    assert load_head(tmp_path / "native").config.kind == "native_mtp"
    with pytest.raises(common.ExportError, match=r"\['vllm'\] do not fit the native_mtp head"):
        export_checkpoint(tmp_path / "native", ["vllm"], tmp_path / "out")



def test_the_export_stage_replaces_the_stale_layer_of_the_targets_own_folder(tmp_path, monkeypatch):
    """A target named by its HF id: the export reads the checkpoint in the HF cache."""
    import huggingface_hub

    from specdistill.config import RunConfig
    from specdistill.export import run

    target = random_target("glm4_moe")
    head = native_head(target)
    revision = "0" * 40
    repo = tmp_path / "hub" / "models--org--glm"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    folder = save_hf_folder(target.model, target.tokenizer, repo / "snapshots" / revision)
    stale = {k: v + 1 for k, v in native_mtp.checkpoint_tensors(head).items()}
    shard = "model-00001-of-00001.safetensors"
    tensors = load_file(str(folder / "model.safetensors")) | stale
    (folder / "model.safetensors").unlink()
    save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    (folder / common.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(tensors, shard)}))
    cfg = RunConfig(name="mtp", run_root=str(tmp_path / "runs"), target=TargetConfig(name="org/glm"))
    layout = RunLayout.of(cfg, "export")
    save_head(head, layout.final_dir)
    out = Path(run.run(cfg, layout)["formats"]["native_mtp"])
    assert not set(load_file(str(out / shard))) & set(stale)  # the stale layer left the shard the export rewrote
    index = json.loads((out / common.INDEX_FILE).read_text())["weight_map"]
    assert {k for k, v in index.items() if v == native_mtp.WEIGHTS_FILE} == set(stale)


def test_batched_kv_cache_decoding_refuses_a_linear_attention_target_by_name():
    """Qwen3-Next's gated DeltaNet layers keep a recurrent state that our batched KV-cache loops cannot roll back:
    they refuse the target before decoding a token, instead of failing inside transformers' cache."""
    target = random_target("qwen3_next")
    with pytest.raises(ConfigError, match="local generation: the target Qwen3NextForCausalLM has linear-attention"):
        LocalGenerator(target.model, 0, [1], 4)
    with pytest.raises(ConfigError, match="plain decoding: .*data.regenerate=false"):
        plain_generate(target.model, [[5, 6, 7]], 4, {1})
    head = native_head(target)
    with pytest.raises(ConfigError, match="speculative decoding of a batch"):
        speculative_generate(TargetRunner(target), HeadProposer(head, target.vocab_size, "chain", 3), [[5], [6]], 4,
                             {1})
    with pytest.raises(ValueError, match="verifies a chain of drafts"):
        speculative_generate(TargetRunner(target), HeadProposer(head, target.vocab_size, "tree", 3, 2, 6), [[5, 6]],
                             4, {1})
    LocalGenerator(random_target("mimo").model, 0, [1], 4)  # attention layers only: accepted


def test_a_replayed_row_decodes_and_accepts_as_the_kv_cache_does(monkeypatch):
    """ReplayCache (the whole sequence again each round, for a recurrent target) against the KV cache on a target
    that has one: the same tokens and the same accepted drafts, round by round."""
    target = load_target(TargetConfig(name="random"))
    prompt = [[5, 17, 42, 99, 7, 300, 11, 5, 17, 42]]  # prompt lookup then accepts 0 to 3 drafts a round

    def generate(replayed: bool):
        monkeypatch.setattr(loop, "keeps_recurrent_state", lambda model: replayed)
        return speculative_generate(TargetRunner(target), LookupProposer(3, 2), prompt, 40, target.eos_ids)

    kv, replayed = generate(False), generate(True)
    assert replayed.tokens == kv.tokens and replayed.accepted == kv.accepted
    assert {0, 3} <= set(kv.accepted[0])


def test_our_chain_on_a_recurrent_target_is_its_greedy_decode():
    """On Qwen3-Next the replayed chain equals greedy decoding by full forwards, token for token."""
    target = random_target("qwen3_next")
    head = native_head(target)
    prompt = [5, 17, 42, 99, 7, 300, 11]
    stats = speculative_generate(TargetRunner(target), HeadProposer(head, target.vocab_size, "chain", 3), [prompt], 12,
                                 target.eos_ids)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(target.model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert stats.tokens[0] == ids[len(prompt):]
