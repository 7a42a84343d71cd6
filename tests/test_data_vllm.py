"""Regeneration through vLLM (`data.generation.backend=vllm`): a missing engine stops the stage with how to install
it; with the engine, the cache records and samples have the local backend's format, the float32 answers are the
local backend's, a worker killed mid-chunk loses only that chunk, the rerun ending where an uninterrupted run
ends, and synthesis runs in the engine too. The engine tests are slow (`make test SLOW=1`)."""

import json
import os
import signal
import time
from pathlib import Path

import datasets
import pytest
from hydra import compose, initialize_config_dir

from specdistill import engines
from specdistill.cache import ResultCache
from specdistill.cli import EXIT_USER_ERROR, exit_on_user_error
from specdistill.config import GenerationConfig, TargetConfig, register, to_run_config
from specdistill.data.generate import LocalGenerator
from specdistill.data.prepare import load_prepared, run
from specdistill.data.regenerate import LocalBackend, regenerate_rows, row_key, sampling_params
from specdistill.data.sources import SourceRow
from specdistill.data.template import ChatFormat
from specdistill.data.vllm_generate import VllmGenerator
from specdistill.engines import EngineError, engine_python
from specdistill.layout import RunLayout
from specdistill.pipeline import LazyTarget
from specdistill.target import load_target, served_dir

ROOT = Path(__file__).resolve().parents[1]
GEN = GenerationConfig(max_new_tokens=24, batch_size=8, dtype="float32")


def source_file(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"turns": [f"question {i}: {'why ' * (i % 5)}", f"and then {i}?"]}) + "\n"
                            for i in range(n)))
    return path


def prepare_cfg(source: Path, out: Path, *overrides: str):
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return to_run_config(compose("config", overrides=[
            "+exp=smoke", "data.source=jsonl", f"data.path={source}", f"out={out}", "data.generation.backend=vllm",
            "data.generation.dtype=float32", "data.generation.max_new_tokens=16", "data.generation.batch_size=8",
            *overrides]))


def test_a_missing_engine_says_how_to_install_it_and_exits_2(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(engines, "LOCAL_ENGINE_PYTHON", tmp_path / "no-engine" / "bin" / "python")
    find_spec = engines.importlib.util.find_spec
    monkeypatch.setattr(engines.importlib.util, "find_spec",  # nor in this environment
                        lambda name, *args: None if name == "vllm" else find_spec(name, *args))
    cfg = prepare_cfg(source_file(tmp_path / "chats.jsonl", 2), tmp_path / "out")
    with pytest.raises(SystemExit) as exit_info:
        exit_on_user_error(lambda: run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target)))
    assert exit_info.value.code == EXIT_USER_ERROR
    assert "data.generation.backend=vllm: vllm is not installed here; `make engine` installs it" in caplog.text
    assert len(ResultCache(tmp_path / "out" / "cache")) == 0  # nothing generated some other way
    with pytest.raises(engines.EngineNotInstalled, match="eval.engine.python=no-such-python is not an interpreter"):
        engine_python("vllm", "no-such-python", "data.generation.backend=vllm")


def rows(n):
    return [SourceRow("chats.jsonl", f"line {i + 1}", {"messages": [
        {"role": "user", "content": f"question {i}: {'why ' * (i % 5)}"}, {"role": "assistant", "content": "old"},
        {"role": "user", "content": f"and then {i}?"}, {"role": "assistant", "content": "old 2"}]})
        for i in range(n)]


@pytest.mark.slow
def test_vllm_regenerates_what_the_local_backend_does_in_float32(tmp_path, engine_ready):
    target_cfg = TargetConfig(name="random")
    target = load_target(target_cfg)
    chat = ChatFormat(target.tokenizer)
    stop, num_tokens = chat.stop_token_ids(), len(target.tokenizer)
    local = LocalGenerator(target.model, target.tokenizer.pad_token_id, stop, GEN.batch_size, num_tokens=num_tokens)
    vllm = VllmGenerator(served_dir(target_cfg), engine_python("vllm", None, "test"), target.model.dtype,
                         target.config.max_position_embeddings, stop, GEN.batch_size, num_tokens, target.vocab_size,
                         target.model.device, tmp_path / "vllm.log")
    source, records = rows(16), {}
    try:
        for name, generator in (("local", local), ("vllm", vllm)):
            params = sampling_params(GEN, name)
            cache = ResultCache(tmp_path / name)
            backend = LocalBackend(generator, chat, GEN, seed=0)
            assert not regenerate_rows(source, backend, cache, params, "random", chunk_rows=8).rows
            records[name] = [cache.get(row_key(r.row["messages"], params, "random")) for r in source]
        prompts = [chat.prompt_ids(r.row["messages"][:1]) for r in source]
        local_ids = [g.token_ids for g in local.generate(prompts, GEN.max_new_tokens)]
        vllm_out = vllm.generate(prompts, GEN.max_new_tokens)
    finally:
        vllm.close()
    assert all(t not in stop and t < num_tokens for g in vllm_out for t in g.token_ids)
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] * 2 for r in records["vllm"])
    # float32 greedy: every row token for token, so the very records the local backend caches (in bfloat16 rounding
    # parts some rows: benchmarks/prepare.py counts how many)
    assert local_ids == [g.token_ids for g in vllm_out]
    assert records["local"] == records["vllm"]


def session_ends(session: int, within_s: float = 30.0) -> bool:
    """Whether every process of the session `session` is gone (killed ones are reaped) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(session, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def samples_of(out: Path) -> list[dict]:
    return list(load_prepared(out).samples)


@pytest.mark.slow
def test_a_worker_killed_mid_chunk_loses_that_chunk_and_the_rerun_ends_as_an_uninterrupted_run(
        tmp_path, monkeypatch, engine_ready):
    source = source_file(tmp_path / "chats.jsonl", 10)
    chunks = ("data.generation.chunk_rows=4", "data.documents.share=0.0")  # source rows only: 2 turns each
    uninterrupted = prepare_cfg(source, tmp_path / "whole", *chunks)
    run(uninterrupted, RunLayout.of(uninterrupted, "prepare"), LazyTarget(uninterrupted.target))

    cfg = prepare_cfg(source, tmp_path / "killed", *chunks)
    ask, asked, worker = engines.EngineProcess.ask, [], []

    def ask_then_kill_in_the_second_chunk(self, request):
        asked.append(request)
        if len(asked) == 4:  # the engine's settings, chunk 1's two turns, then chunk 2's first turn
            worker.append(self.proc.pid)
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            os.kill(self.proc.pid, signal.SIGKILL)  # while it decodes the request just sent
            return json.loads(self._read_line())
        return ask(self, request)

    monkeypatch.setattr(engines.EngineProcess, "ask", ask_then_kill_in_the_second_chunk)
    with pytest.raises((EngineError, datasets.exceptions.DatasetGenerationError)) as failure:
        run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target))
    assert "worker exited with code -9" in str(failure.value) + str(failure.value.__cause__)
    assert session_ends(worker[0])  # nothing of the engine is left running
    assert len(ResultCache(tmp_path / "killed" / "cache")) == 4  # chunk 1 kept, chunk 2 lost
    resumed = []

    def ask_counting_prompts(self, request):
        resumed.extend(request.get("prompts", []))
        return ask(self, request)

    monkeypatch.setattr(engines.EngineProcess, "ask", ask_counting_prompts)
    run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target))
    assert len(resumed) == 2 * 6  # both turns of the 6 rows after chunk 1, nothing twice
    assert len(ResultCache(tmp_path / "killed" / "cache")) == 10
    assert samples_of(tmp_path / "killed") == samples_of(tmp_path / "whole")


@pytest.mark.slow
def test_synthesis_runs_in_vllm_and_a_rerun_reuses_every_batch(tmp_path, monkeypatch, engine_ready):
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = to_run_config(compose("config", overrides=[
            "+exp=smoke", f"out={tmp_path / 'out'}", "data.generation.backend=vllm", "data.generation.dtype=float32"]))
    run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target))
    samples = samples_of(tmp_path / "out")
    assert len(samples) >= cfg.data.synth.num_conversations // 2  # questions and answers made by the engine
    assert "vLLM" in (tmp_path / "out" / "engine" / "regenerate.rank0.log").read_text()
    (tmp_path / "out" / "summary.json").unlink()  # prepared again from the cache: the engine is not asked
    asked = []
    monkeypatch.setattr(engines.EngineProcess, "ask", lambda self, request: asked.append(request))
    run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target))
    assert asked == [] and samples_of(tmp_path / "out") == samples
