"""Regeneration turn by turn on the tiny target: answers see the target's own earlier answers, a run
stopped midway resumes without generating any row twice, and ranks split the rows without overlap."""

import json

import pytest

from specdistill.cache import ResultCache
from specdistill.config import GenerationConfig, TargetConfig
from specdistill.data.generate import LocalGenerator
from specdistill.data.regenerate import LocalBackend, regenerate_rows, row_key
from specdistill.data.sources import SourceRow
from specdistill.data.template import ChatFormat
from specdistill.target import load_target

GEN = GenerationConfig(max_new_tokens=6, batch_size=4, dtype="float32")
PARAMS = {"backend": "local", "max_new_tokens": 6}


@pytest.fixture(scope="module")
def backend():
    target = load_target(TargetConfig(name="random"))
    chat = ChatFormat(target.tokenizer)
    generator = LocalGenerator(target.model, target.tokenizer.pad_token_id, chat.stop_token_ids(), 4,
                               num_tokens=len(target.tokenizer))
    return LocalBackend(generator, chat, GEN, seed=0)


def rows(n):
    return [SourceRow("chats.jsonl", f"line {i + 1}", {"messages": [
        {"role": "system", "content": "be terse"},
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "old answer"},
        {"role": "user", "content": f"follow-up {i}"}, {"role": "assistant", "content": "old answer 2"}]})
        for i in range(n)]


class Counting:
    """A real backend, counting the conversations it answers; `fail_after` simulates a killed run."""

    def __init__(self, inner, fail_after=None):
        self.inner, self.fail_after, self.answered = inner, fail_after, []

    def reply(self, conversations, desc="regenerate"):
        first_turns = [c[1]["content"] for c in conversations if len(c) == 2]
        if first_turns and self.fail_after is not None and len(self.answered) >= self.fail_after:
            raise KeyboardInterrupt("killed")
        self.answered += first_turns
        return self.inner.reply(conversations, desc)


def test_turn_by_turn_with_own_answers(backend, tmp_path):
    cache = ResultCache(tmp_path)
    source = rows(2)
    assert not regenerate_rows(source, backend, cache, PARAMS, "random", chunk_rows=8).rows
    for row in source:
        messages = cache.get(row_key(row.row["messages"], PARAMS, "random"))["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
        assert "old answer" not in (messages[2]["content"], messages[4]["content"])
        first = backend.reply([messages[:2]])[0]
        second = backend.reply([messages[:4]])[0]  # the context holds the target's own first answer
        assert (messages[2]["content"], messages[4]["content"]) == (first, second)


def test_killed_run_resumes_without_duplicates_or_gaps(backend, tmp_path):
    source = rows(7)
    crashing = Counting(backend, fail_after=4)  # dies as the third chunk of two rows starts
    with pytest.raises(KeyboardInterrupt):
        regenerate_rows(source, crashing, ResultCache(tmp_path), PARAMS, "random", chunk_rows=2)
    cache = ResultCache(tmp_path)
    assert len(cache) == 4
    resumed = Counting(backend)
    regenerate_rows(source, resumed, cache, PARAMS, "random", chunk_rows=2)
    assert resumed.answered == ["question 4", "question 5", "question 6"]
    lines = [json.loads(line) for line in (tmp_path / "conversations.rank0.jsonl").read_text().splitlines()]
    keys = [line["key"] for line in lines]
    assert len(keys) == len(set(keys)) == 7
    assert set(keys) == {row_key(r.row["messages"], PARAMS, "random") for r in source}


def test_a_torn_cache_line_is_ignored_and_redone(backend, tmp_path):
    source = rows(2)
    regenerate_rows(source, backend, ResultCache(tmp_path), PARAMS, "random", chunk_rows=1)
    path = tmp_path / "conversations.rank0.jsonl"
    text = path.read_text()
    path.write_text(text[: len(text) - 20])  # the second line was cut short by a kill
    cache = ResultCache(tmp_path)
    assert len(cache) == 1
    again = Counting(backend)
    regenerate_rows(source, again, cache, PARAMS, "random", chunk_rows=1)
    assert again.answered == ["question 1"] and len(ResultCache(tmp_path)) == 2


def test_ranks_split_rows_without_overlap(backend, tmp_path):
    source = rows(5)
    answered = []
    for rank in range(2):
        counting = Counting(backend)
        regenerate_rows(source, counting, ResultCache(tmp_path, rank), PARAMS, "random", 8, rank, 2)
        answered.append(counting.answered)
    assert answered == [["question 0", "question 2", "question 4"], ["question 1", "question 3"]]
    assert len(ResultCache(tmp_path)) == 5  # each rank's file is read back


def test_prepare_regenerates_a_spec_bench_style_file(tmp_path):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from specdistill.config import register, to_run_config
    from specdistill.data.prepare import load_prepared, run
    from specdistill.layout import RunLayout
    from specdistill.pipeline import LazyTarget

    source = tmp_path / "questions.jsonl"
    source.write_text("".join(json.dumps({"turns": [f"question {i}", f"then {i}"]}) + "\n" for i in range(3)))
    register()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base=None):
        cfg = to_run_config(compose("config", overrides=[
            "+exp=smoke", "data.source=jsonl", f"data.path={source}", f"out={tmp_path / 'out'}",
            "data.generation.max_new_tokens=5", "data.generation.batch_size=4"]))
    summary = run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target))
    assert summary["samples"] == 3 and summary["rejects"] == 0
    data = load_prepared(tmp_path / "out")
    row = data.samples[0]
    assert [m["role"] for m in json.loads(row["messages"])] == ["user", "assistant", "user", "assistant"]
    provenance = json.loads(row["provenance"])
    assert provenance["regenerated"] and provenance["row"] == "line 1" and provenance["sampling"]["max_new_tokens"] == 5
    assert len(ResultCache(tmp_path / "out" / "cache")) == 3


def test_the_cache_index_reads_only_new_whole_lines(tmp_path):
    writer, reader = ResultCache(tmp_path, 1), ResultCache(tmp_path, 0)
    writer.put("a", {"messages": ["first"]})
    assert "a" not in reader
    reader.reload()
    assert reader.get("a") == {"messages": ["first"]}
    with open(writer.path, "ab") as f:
        f.write(b'{"key": "b", "value": {"mess')  # another rank is mid-write (or was killed here)
    reader.reload()
    assert "b" not in reader and len(reader) == 1
    writer.put("c", {"messages": ["third"]})  # starts on a fresh line: the torn one is skipped for good
    reader.reload()
    assert reader.get("c") == {"messages": ["third"]} and "b" not in reader and len(reader) == 2
    assert all(isinstance(where, tuple) and len(where) == 2 for where in reader.index.values())  # no values kept
