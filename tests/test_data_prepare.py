"""The prepare stage on the smoke target: output layout, dtypes, masks, vocab, resume and skip, sources read
one window at a time, and two real processes splitting the regeneration."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import specdistill.target
from specdistill.cache import ResultCache
from specdistill.config import register, to_run_config
from specdistill.data.conversations import SourceConversations, generation_model
from specdistill.data.generate import LocalGenerator
from specdistill.data.prepare import load_prepared, run
from specdistill.data.regenerate import row_key, sampling_params
from specdistill.data.template import ChatFormat
from specdistill.layout import RunLayout
from specdistill.pipeline import LazyTarget

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")


def smoke_cfg(out, *overrides):
    register()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        dict_cfg = compose("config", overrides=["+exp=smoke", f"out={out}", "data.synth.num_conversations=8",
                                                "data.synth.batch_size=8", *overrides])
    return to_run_config(dict_cfg)


class NoTarget:
    def get(self):
        raise AssertionError("the target must not be loaded")


PREPARED = ("data.documents.parts=[2,1]",)  # documents of two answers, then one, in rotation


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    cfg = smoke_cfg(out, *PREPARED)
    target = LazyTarget(cfg.target)
    summary = run(cfg, RunLayout.of(cfg, "prepare"), target)
    return cfg, out, summary, target.get()


def test_layout_and_dtypes(prepared):
    _, out, summary, _ = prepared
    for name in ("samples", "vocab.safetensors", "summary.json", "rejects.jsonl", "cache"):
        assert (out / name).exists(), name
    data = load_prepared(out)
    feats = data.samples.features
    assert feats["input_ids"].feature.dtype == "int32" and feats["loss_mask"].feature.dtype == "uint8"
    assert len(data.samples) == summary["samples"] == 8
    assert json.loads((out / "summary.json").read_text())["coverage"] == pytest.approx(data.vocab.coverage)


def test_conversations_are_unique_and_masks_cover_the_answer(prepared):
    cfg, out, _, target = prepared
    tok = target.tokenizer
    data = load_prepared(out)
    questions = [json.loads(m)[0]["content"] for m in data.samples["messages"]]
    assert len(set(questions)) == len(questions)
    for row in data.samples:
        messages = json.loads(row["messages"])
        assert [m["role"] for m in messages] == ["user", "assistant"]
        ids, mask = row["input_ids"], row["loss_mask"]
        masked = [i for i, m in zip(ids, mask) if m]
        assert masked[-1] == tok.convert_tokens_to_ids("<|im_end|>")  # the end-of-turn token is trained
        assert tok.decode(masked[:-1]) == tok.decode(tok.encode(messages[1]["content"], add_special_tokens=False))
        provenance = json.loads(row["provenance"])
        assert provenance["source"] == "synth" and provenance["target"] == cfg.target.name
        assert provenance["answer_sampling"]["temperature"] == 0.0


def test_questions_follow_openers_and_documents_are_earlier_answers(prepared):
    cfg, out, _, _ = prepared
    synth, docs = cfg.data.synth, cfg.data.documents
    rows = [(json.loads(r["messages"]), json.loads(r["provenance"])) for r in load_prepared(out).samples]
    answers = {p["row"]: m[1]["content"] for m, p in rows if "document_of" not in p}
    documents = [(m, p) for m, p in rows if "document_of" in p]
    assert len(documents) == round(synth.num_conversations * docs.share) > 0
    assert {len(p["document_of"]) for _, p in documents} == set(docs.parts) == {1, 2}
    for messages, provenance in rows:
        if "document_of" in provenance:
            parts = [answers[row] for row in provenance["document_of"]]
            assert all(len(part) >= docs.min_chars for part in parts)
            document = "\n\n".join(parts)
            assert messages[0]["content"] == provenance["document_prompt"].replace("{document}", document)
        else:
            assert provenance["opener"] in synth.openers
            assert messages[0]["content"].startswith(provenance["opener"])


def test_vocab_counts_match_the_samples(prepared):
    cfg, out, _, target = prepared
    data = load_prepared(out)
    assert data.vocab.size == cfg.data.draft_vocab_size
    assert data.vocab.t2d_V.numel() == target.vocab_size
    total = sum(sum(m) for m in data.samples["loss_mask"])
    assert int(data.vocab.counts_V.sum()) == total
    ids = data.vocab.target_ids_N
    assert torch.all(ids[1:] > ids[:-1]) and data.vocab.t2d_V[ids].all()


def test_complete_data_is_skipped_without_loading_the_target(prepared):
    cfg, out, summary, _ = prepared
    assert run(cfg, RunLayout.of(cfg, "prepare"), NoTarget()) == summary


def test_resume_from_the_cache_generates_nothing_again(prepared, tmp_path):
    cfg, out, _, target = prepared
    copy = tmp_path / "data"
    shutil.copytree(out / "cache", copy / "cache")

    class NoGeneration:
        def get(self):
            model = target.model

            def refuse(*args, **kwargs):
                raise AssertionError("nothing may be generated again")

            model.forward, saved = refuse, model.forward
            NoGeneration.restore = lambda: setattr(model, "forward", saved)
            return target

    cfg2 = smoke_cfg(copy, *PREPARED, "target.dtype=float32", "data.generation.dtype=float32")
    try:
        run(cfg2, RunLayout.of(cfg2, "prepare"), NoGeneration())
    finally:
        NoGeneration.restore()
    assert load_prepared(copy).samples["messages"] == load_prepared(out).samples["messages"]


def test_more_conversations_generate_only_the_new_ones(tmp_path):
    """A run that asks for more conversations reuses every question and answer a smaller run made, answering
    only the rest of an attempt the smaller run needed only part of; a smaller run reads a larger one's."""
    grow = ("data.synth.batch_size=1", "data.documents.share=0")  # attempts of 8 questions, no documents
    target, original = None, LocalGenerator.generate

    def prepare(name: str, count: int, cache_from: str | None = None) -> tuple[list[str], list[tuple[str, int]]]:
        """Prepare `count` conversations; returns their rows' provenance and the generate calls (desc, prompts)."""
        nonlocal target
        cfg = smoke_cfg(tmp_path / name, *grow, f"data.synth.num_conversations={count}")
        target = target or LazyTarget(cfg.target)
        if cache_from:
            shutil.copytree(tmp_path / cache_from / "cache", tmp_path / name / "cache")
        calls = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(LocalGenerator, "generate", lambda self, prompts, *args, **kwargs:
                          calls.append((kwargs["desc"], len(prompts))) or original(self, prompts, *args, **kwargs))
            run(cfg, RunLayout.of(cfg, "prepare"), target)
        return [json.loads(p)["row"] for p in load_prepared(tmp_path / name).samples["provenance"]], calls

    small, _ = prepare("small", 10)
    big, calls = prepare("big", 20, cache_from="small")
    assert len(big) == 20 and big[:10] == small
    in_attempt_1 = [sum(row.startswith("attempt 1 ") for row in rows) for rows in (small, big)]
    assert 0 < in_attempt_1[0] < in_attempt_1[1]  # the small run needed only part of attempt 1
    assert not [desc for desc, _ in calls if desc in ("questions 0", "answers 0", "questions 1")]
    assert ("answers 1", in_attempt_1[1] - in_attempt_1[0]) in calls  # only the rest of attempt 1
    fewer, calls = prepare("fewer", 6, cache_from="small")  # part of what a cached answer batch holds
    assert calls == [] and fewer == small[:6]


def test_back_translations_come_on_top_and_reuse_every_cached_batch(prepared, tmp_path):
    cfg, out, _, _ = prepared
    rows = [(json.loads(r["messages"]), json.loads(r["provenance"])) for r in load_prepared(out).samples]
    documents = {p["row"]: m for m, p in rows if "document_of" in p}
    source = next(p["document_prompt"] for m, p in rows if "document_of" in p)
    copy = tmp_path / "data"
    shutil.copytree(out / "cache", copy / "cache")
    cfg2 = smoke_cfg(copy, *PREPARED)
    cfg2.data.synth.back_translations, cfg2.data.synth.back_translation_source = 5, source
    run(cfg2, RunLayout.of(cfg2, "prepare"), LazyTarget(cfg2.target))
    assert len(ResultCache(copy / "cache")) == len(ResultCache(out / "cache")) + 1  # one new batch
    rows2 = [(json.loads(r["messages"]), json.loads(r["provenance"])) for r in load_prepared(copy).samples]
    assert rows2[: len(rows)] == rows
    back = rows2[len(rows):]
    assert len(back) == sum(p["document_prompt"] == source for _, p in rows if "document_of" in p) > 0
    for messages, provenance in back:
        translated = documents[provenance["back_translation_of"]][1]["content"]
        assert messages[0]["content"] == cfg2.data.synth.back_translation_prompt.replace("{document}", translated)


def write_chats(path: Path, good: int, broken_at: int | None) -> list[dict]:
    """`good` ShareGPT rows, with a row lacking its text inserted as line `broken_at` (if any); returns the good
    rows."""
    rows = [{"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "old"}]}
            for i in range(good)]
    lines = [json.dumps(r) for r in rows]
    if broken_at is not None:
        lines.insert(broken_at - 1, json.dumps({"conversations": [{"from": "human"}]}))
    path.write_text("\n".join(lines) + "\n")
    return rows


def test_sources_are_read_and_regenerated_one_window_at_a_time(prepared, tmp_path):
    *_, target = prepared
    write_chats(tmp_path / "chats.jsonl", good=6, broken_at=3)
    cfg = smoke_cfg(tmp_path / "out", "data.source=jsonl", f"data.path={tmp_path / 'chats.jsonl'}",
                    "data.generation.max_new_tokens=3", "data.generation.chunk_rows=2")
    sources = SourceConversations(cfg, target, ChatFormat(target.tokenizer), ResultCache(tmp_path / "c"), 0, 1)
    stream = iter(sources)
    first = next(stream)
    assert sources.total == 2 and len(ResultCache(tmp_path / "c")) == 2  # only the first window so far
    rest = list(stream)
    assert [c["provenance"]["row"] for c in [first, *rest]] == ["line 1", "line 2", "line 4", "line 5", "line 6",
                                                               "line 7"]
    assert sources.total == 7 and [(r["position"], r["reason"]) for r in sources.rejects.rows] == [
        ("line 3", "missing_field")]


def test_document_tasks_over_regenerated_answers_are_answered_too(prepared, tmp_path):
    """A quarter of the conversations work over the target's own regenerated answers (answers of at least
    `min_chars` only), answered by the target like any other turn; without regeneration there are none."""
    *_, target = prepared
    write_chats(tmp_path / "chats.jsonl", good=9, broken_at=None)
    overrides = ["data.source=jsonl", f"data.path={tmp_path / 'chats.jsonl'}", "data.generation.max_new_tokens=6",
                 "data.documents.share=0.25", "data.generation.chunk_rows=4"]
    cfg = smoke_cfg(tmp_path / "out", *overrides, "data.documents.min_chars=1")
    conversations = list(SourceConversations(cfg, target, ChatFormat(target.tokenizer), ResultCache(tmp_path / "c"),
                                             0, 1))
    answers = {c["provenance"]["row"]: c["messages"][1]["content"] for c in conversations[:9]}
    documents = conversations[9:]
    assert len(documents) == 3 and all(c["provenance"]["source"] == "documents" for c in documents)
    for c in documents:
        document = "\n\n".join(answers[row] for row in c["provenance"]["document_of"])
        assert c["messages"][0]["content"] == c["provenance"]["document_prompt"].replace("{document}", document)
        assert c["messages"][1]["role"] == "assistant" and c["provenance"]["regenerated"]
    too_short = smoke_cfg(tmp_path / "out", *overrides, "data.documents.min_chars=100000")
    assert len(list(SourceConversations(too_short, target, ChatFormat(target.tokenizer),
                                        ResultCache(tmp_path / "c"), 0, 1))) == 9
    as_given = smoke_cfg(tmp_path / "out", *overrides, "data.regenerate=false", "data.documents.min_chars=1")
    assert len(list(SourceConversations(as_given, target, ChatFormat(target.tokenizer),
                                        ResultCache(tmp_path / "c"), 0, 1))) == 9


@pytest.mark.slow  # two processes, each loading torch and the tiny target: ~30 s
def test_two_processes_regenerate_disjoint_shares_and_keep_every_row_once(tmp_path):
    rows = write_chats(tmp_path / "chats.jsonl", good=9, broken_at=5)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", "29541", "commands/prepare.py", "+exp=smoke",
           "data.source=jsonl", f"data.path={tmp_path / 'chats.jsonl'}", "data.regenerate=true", f"out={out}",
           "data.generation.max_new_tokens=4", "data.generation.chunk_rows=2", "data.documents.share=0.25",
           "data.documents.min_chars=1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cfg = smoke_cfg(out, "data.generation.max_new_tokens=4")
    params = sampling_params(cfg.data.generation, "local")
    keys = [[json.loads(line)["key"] for line in next((out / "cache").glob(f"conversations.*rank{r}.jsonl")).open()]
            for r in (0, 1)]
    assert keys[0] and keys[1] and not set(keys[0]) & set(keys[1])  # each rank wrote its own share
    wanted = [row_key([{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "old"}],
                      params, cfg.target.name) for i in range(len(rows))]
    documents = 3  # a quarter of 12: the 9 good rows and their document tasks, regenerated by both ranks too
    assert set(wanted) <= set(keys[0] + keys[1]) and len(keys[0] + keys[1]) == len(set(keys[0] + keys[1])) == 12
    samples = load_prepared(out).samples
    positions = [json.loads(p)["row"] for p in samples["provenance"]]
    assert positions == [f"line {n}" for n in (1, 2, 3, 4, 6, 7, 8, 9, 10)] + [f"document {i}" for i in range(documents)]
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").open()]
    assert [(r["position"], r["reason"]) for r in rejects] == [("line 5", "missing_field")]


@pytest.mark.slow
def test_real_embedded_target_synthesises_and_masks(tmp_path):
    register()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = to_run_config(compose("config", overrides=[
            f"out={tmp_path}", "data.synth.num_conversations=4", "data.synth.batch_size=4",
            "data.synth.question_max_tokens=24", "data.synth.answer_max_tokens=16",
            "data.documents.min_chars=20"]))
    target = LazyTarget(cfg.target)
    summary = run(cfg, RunLayout.of(cfg, "prepare"), target)
    tok = target.get().tokenizer
    data = load_prepared(tmp_path)
    assert summary["samples"] == 4 and data.vocab.size == cfg.data.draft_vocab_size
    for row in data.samples:
        text = tok.decode(row["input_ids"])
        assert text.startswith("<|im_start|>system\n")  # SmolLM2's default system prompt, not trained
        masked = [i for i, m in zip(row["input_ids"], row["loss_mask"]) if m]
        answer = json.loads(row["messages"])[1]["content"]
        assert tok.decode(masked) == answer + "<|im_end|>"


@pytest.mark.parametrize("flags, native", [
    ({"avx2", "avx512f", "avx512bw", "avx512_vnni"}, False),  # oneDNN runs bf16 here too, converting to fp32
    ({"avx2", "fma"}, False),
    ({"avx512f", "avx512bw", "avx512_bf16"}, True),
    ({"avx512f", "amx_tile", "amx_bf16"}, True),
])
def test_bf16_is_native_only_on_cpus_with_bf16_instructions(monkeypatch, flags, native):
    monkeypatch.setattr(specdistill.target, "x86_cpu_flags", lambda: frozenset(flags))
    assert specdistill.target.bf16_is_native("cpu") is native
    assert specdistill.target.resolve_dtype("auto", "cpu") is (torch.bfloat16 if native else torch.float32)


def test_generation_dtype_auto_is_bf16_only_where_it_is_native(prepared, monkeypatch):
    """A CPU without bf16 instructions emulates it (an AVX2 one ~5x slower than fp32), so `auto` regenerates in fp32
    there."""
    target = prepared[3]
    assert specdistill.target.resolve_dtype("auto", "cuda") is torch.bfloat16
    for native, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(specdistill.target, "bf16_is_native", lambda device, native=native: native)
        model = generation_model(target, "auto")
        assert next(model.parameters()).dtype == dtype
        assert (model is target.model) == (dtype == torch.float32)  # the fp32 target is used as it is, not copied
