"""Config composition, fail-fast validation and the command-line contracts of train.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specdistill.config import ConfigError, RunConfig, register, to_run_config
from specdistill.pipeline import run_stages
from specdistill.redact import redacted, scrub_secrets
from specdistill.target import (
    TargetNotFound,
    check_against_target,
    check_capture_layers,
    check_vocab_fits,
    resolve_layer_ids,
)

ROOT = Path(__file__).resolve().parents[1]
register()


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return to_run_config(compose(config_name="config", overrides=list(overrides)))


GIVEN_BY_CALLER = {"engine_check": ["data.path=prompts.jsonl", "eval.bench=prompts.jsonl"]}  # the prompts it learns


@pytest.mark.parametrize("exp", sorted(p.stem for p in (ROOT / "conf" / "exp").glob("*.yaml")))
def test_every_experiment_composes(exp):
    cfg = compose_cfg(f"+exp={exp}", *GIVEN_BY_CALLER.get(exp, []))
    assert cfg.name == exp


def test_default_is_the_embedded_target_with_all_stages():
    cfg = compose_cfg()
    assert cfg.target.name == "embedded:smollm2-135m-instruct"
    assert cfg.stages == ["prepare", "capture", "train", "evaluate", "export"]
    assert cfg.train.ttt_steps == 4 and cfg.train.step_weight == 0.8 and cfg.train.loss == "forward_kl"
    assert check_capture_layers(cfg.target, "") == (1, 14, 26)
    assert cfg.head.copy_init and not compose_cfg("head=mtp").head.copy_init
    assert compose_cfg("+exp=llama8b").train.ttt_steps == 7  # EAGLE-3's unroll where deep drafts pay off


def test_schema_defaults_are_the_embedded_default():
    """Code that builds a RunConfig directly gets the same pipeline as `python train.py`."""
    assert OmegaConf.structured(compose_cfg()) == OmegaConf.structured(RunConfig())


@pytest.mark.parametrize(
    "override, field",
    [("stages=[prepare,bogus]", "stages"), ("train.loss=l2", "train.loss"), ("eval.tree.depth=0", "eval.tree.depth"),
     ("data.source=jsonl", "data.path"), ("export.formats=[onnx]", "export.formats"),
     ("data.documents.prompts=[Summarize]", r"data.documents.prompts\[0\]"),
     ("data.documents.share=1.0", "data.documents.share"),
     ("data.documents.parts=[1,0]", "data.documents.parts"),
     ("data.documents.parts=[]", "data.documents.parts"),
     ("head=mtp head.copy_init=true", "head.copy_init"), ("head=mtp head.fc_norm=true", "head.fc_norm"),
     ("head=mtp head.parallel_drafting=true", "head.parallel_drafting"), ("head.mask_token_id=5", "head.mask_token_id"),
     ("head.num_layers=2", "head.num_layers"), ("head=dflash eval.tree.depth=5", "eval.tree.depth"),
     ("head=dflash eval.engine.num_speculative_tokens=5", "eval.engine.num_speculative_tokens"),
     ("head.copy_init=false head.copy_slow_pairs_only=true", "head.copy_slow_pairs_only"),
     ("data.synth.back_translations=9 data.synth.back_translation_source=Nope", "data.synth.back_translation_source"),
     ("data.synth.back_translations=9 data.synth.back_translation_prompt=German", "data.synth.back_translation_prompt"),
     ("train.served_vocab_size=100", "train.served_vocab_size"),
     ("train.grad_clip=-1", "train.grad_clip"), ("train.max_steps=-5", "train.max_steps"),
     ("train.epochs=-1", "train.epochs"), ("train.holdout_share=-0.5", "train.holdout_share"),
     ("train.holdout_share=1.5", "train.holdout_share"), ("train.warmup_ratio=-2", "train.warmup_ratio"),
     ("data.synth.answer_max_tokens=-5", "data.synth.answer_max_tokens"),
     ("data.synth.num_conversations=-4", "data.synth.num_conversations"),
     ("data.generation.top_p=0", "data.generation.top_p"), ("data.generation.chunk_rows=0", "data.generation.chunk_rows"),
     ("data.generation.backend=sglang", "data.generation.backend"),
     ("data.limit=0", "data.limit"), ("train.betas=[0.9,1.5]", "train.betas"),
     ("data.source=csv", "data.source"), ("data.max_turns=0", "data.max_turns"),
     ("data.decontaminate_ngram=-1", "data.decontaminate_ngram"),
     ("target.random.num_hidden_layers=0", "target.random.num_hidden_layers"),
     ("export.formats=[]", "export.formats")],
)
def test_config_errors_name_the_field(override, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        compose_cfg(*override.split())


def test_draft_vocab_larger_than_the_target_fails_before_any_work(tmp_path):
    """The target's vocabulary is read from its config before synthesis, not found out hours later."""
    cfg = compose_cfg("+exp=smoke", f"run_root={tmp_path}", "data.draft_vocab_size=400", "train.served_vocab_size=null")
    with pytest.raises(ConfigError, match="`data.draft_vocab_size`: got 400, but the target `random` has only 384"):
        run_stages(cfg)
    assert not (tmp_path / "smoke").exists()
    cfg = compose_cfg("+exp=smoke", "train.served_vocab_size=50000")
    with pytest.raises(ConfigError, match="`train.served_vocab_size`: got 50000"):
        check_against_target(cfg, "random")
    check_vocab_fits(compose_cfg(), 49152)  # the embedded default fits its target
    with pytest.raises(ConfigError, match="`data.draft_vocab_size`"):
        check_against_target(compose_cfg("data.draft_vocab_size=60000", "train.served_vocab_size=null"), "")


def test_capture_layers_are_checked_against_the_target():
    assert resolve_layer_ids(32, None) == (1, 15, 28)
    with pytest.raises(ConfigError, match="out of range"):
        resolve_layer_ids(30, [1, 14, 30])
    with pytest.raises(ConfigError, match="set the layers explicitly"):
        resolve_layer_ids(4, None)
    assert resolve_layer_ids(4, [0, 1, 2]) == (0, 1, 2)
    cfg = compose_cfg("+exp=smoke", "target.capture_layers=[1,2,8]")
    with pytest.raises(ConfigError, match="layer 8 is out of range"):
        check_capture_layers(cfg.target, "random")


def test_secret_fields_are_blanked_and_token_counts_are_not():
    tree = {"api_key": "sk-1", "server": {"hf_token": "hf_2", "max_new_tokens": 7}, "list": [{"secret": "s"}],
            "batch_tokens": 3, "key": None}
    assert scrub_secrets(tree) == {"api_key": "***", "server": {"hf_token": "***", "max_new_tokens": 7},
                                   "list": [{"secret": "***"}], "batch_tokens": 3, "key": None}
    assert redacted(compose_cfg())["data"]["generation"]["max_new_tokens"] == 192


def test_a_key_inside_the_server_url_is_not_saved(tmp_path):
    cfg = compose_cfg("+exp=smoke", f"run_root={tmp_path}", "stages=[export]")
    cfg.data.generation.server_url = "https://bob:pw-in-url@llm.example:8443/v1?api-key=sk-in-query"
    saved = redacted(cfg)["data"]["generation"]["server_url"]
    assert saved == "https://***@llm.example:8443/v1?api-key=***"
    with pytest.raises(FileNotFoundError):  # no head to export; config.json is written first
        run_stages(cfg)
    text = (tmp_path / "smoke" / "config.json").read_text()
    assert "llm.example" in text and "pw-in-url" not in text and "sk-in-query" not in text


def run_train(*args, env=None):
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def test_llama8b_config_prints_without_loading_anything():
    proc = run_train("+exp=llama8b", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    for text in ("meta-llama/Llama-3.1-8B-Instruct", "capture_layers:\n  - 1\n  - 15\n  - 28", "deepspeed: zero2",
                 "mode: online", "dtype: bfloat16", "ultrachat"):
        assert text in proc.stdout


def test_a_config_hydra_cannot_compose_exits_2_like_ours():
    """One exit code for every mistake the user can fix; 1 is left to bugs."""
    proc = run_train("train.no_such_field=1")
    assert proc.returncode == 2 and "no_such_field" in proc.stdout + proc.stderr


def test_missing_model_fails_at_once_with_one_line(tmp_path):
    proc = run_train("+exp=llama8b", f"run_root={tmp_path}", env={"HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() + proc.stdout.splitlines() if "meta-llama/Llama-3.1-8B-Instruct" in ln]
    assert len(lines) == 1 and "not on this machine" in lines[0]
    assert not (tmp_path / "store").exists() and not (tmp_path / "llama8b").exists()


def test_target_not_found_is_raised_for_an_unknown_dir():
    from specdistill.config import TargetConfig
    from specdistill.target import resolve_source

    with pytest.raises(TargetNotFound, match="no-such-org/no-such-model"):
        resolve_source(TargetConfig(name="no-such-org/no-such-model"))


def test_field_checks_come_from_the_fields_own_settings():
    """Choices and bounds are declared beside each field (`setting`) and one walker checks them all."""
    with pytest.raises(ConfigError, match=r"`data.generation.backend`: got 'x', expected one of \['local', 'vllm'"):
        compose_cfg("data.generation.backend=x")
    with pytest.raises(ConfigError, match=r"`data.documents.share`: got 1.0, expected a number in \[0, 1\)"):
        compose_cfg("data.documents.share=1")
    with pytest.raises(ConfigError, match=r"`train.max_steps`: got 0, expected null or a number >= 1"):
        compose_cfg("train.max_steps=0")
    with pytest.raises(ConfigError, match=r"`data.synth.openers`: is empty; use \[\"\"\]"):
        compose_cfg("data.synth.openers=[]")
    with pytest.raises(ConfigError, match=r"`eval.baselines`: got 'x'"):
        compose_cfg("eval.baselines=[chain,x]")
    assert compose_cfg("train.deepspeed=null", "eval.engine.name=null", "export.formats=null").train.deepspeed is None
