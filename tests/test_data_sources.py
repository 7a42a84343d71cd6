"""Sources: every row format, local file kinds, broken rows rejected with reason and position, and the
prepare stage tokenizing a local file as is (data.regenerate=false)."""

import json
from pathlib import Path

import datasets
import pytest
from hydra import compose, initialize_config_dir

from specdistill.config import ConfigError, register, to_run_config
from specdistill.data.prepare import load_prepared, run
from specdistill.data.rejects import RowError, TooManyRejects
from specdistill.data.sources import read_conversations, to_messages
from specdistill.io import read_jsonl
from specdistill.layout import RunLayout
from specdistill.pipeline import LazyTarget

CONF = str(Path(__file__).resolve().parents[1] / "conf")
EXPECTED = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
GOOD_ROWS = [
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    {"data": ["hi", "yo"]},
]
BROKEN_LINES = [
    ('{"messages": [{"role": "user", "content": "hi"}]', "invalid_json"),
    ('{"text": "no conversation here"}', "unknown_format"),
    ('{"messages": [{"role": "user"}]}', "missing_field"),
    ('{"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]}', "empty_content"),
    ('{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}', "non_string_content"),
    ('{"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}', "unknown_role"),
    ('{"messages": [{"role": "user", "content": "only a question"}]}', "no_assistant_turn"),
    ('{"conversations": []}', "missing_field"),
]


def test_every_format_gives_the_same_messages():
    for row in GOOD_ROWS:
        assert to_messages(row) == EXPECTED
    assert to_messages({"turns": ["a", "b"]}) == [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert to_messages({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}]},
                       "sharegpt")[0] == {"role": "system", "content": "s"}


def test_forced_format_names_the_missing_field():
    with pytest.raises(RowError, match="field `conversations`"):
        to_messages({"messages": EXPECTED}, "sharegpt")


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "arrow_dir"])
def test_local_file_kinds(tmp_path, kind):
    rows = [{"messages": EXPECTED}] * 3
    if kind == "jsonl":
        path = tmp_path / "c.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path = tmp_path / "c.json"
        path.write_text(json.dumps(rows))
    elif kind == "parquet":
        path = tmp_path / "c.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path = tmp_path / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    items = list(read_conversations([str(path)], "auto"))
    assert [i.row["messages"] for i in items] == [EXPECTED] * 3 and all(i.error is None for i in items)


def write_broken_file(path: Path, good: int) -> None:
    lines = [json.dumps(GOOD_ROWS[i % 3]) for i in range(good)] + [line for line, _ in BROKEN_LINES]
    path.write_text("\n".join(lines) + "\n")


def jsonl_cfg(path, out, *overrides):
    register()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        dict_cfg = compose("config", overrides=["+exp=smoke", "data.source=jsonl", f"data.path={path}",
                                                "data.regenerate=false", f"out={out}", *overrides])
    return to_run_config(dict_cfg)


def test_prepare_a_local_file_as_is_with_rejects(tmp_path):
    source = tmp_path / "chats.jsonl"
    write_broken_file(source, good=40)
    cfg = jsonl_cfg(source, tmp_path / "out")
    summary = run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target))
    assert summary["samples"] == 40 and summary["conversations"] == 48
    rejects = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert sorted((int(r["position"].split()[1]), r["reason"]) for r in rejects) == [
        (41 + i, reason) for i, (_, reason) in enumerate(BROKEN_LINES)]
    assert all(r["source"] == str(source) for r in rejects)
    assert summary["rejects_by_reason"]["missing_field"] == 2
    data = load_prepared(tmp_path / "out")
    assert json.loads(data.samples[0]["messages"]) == EXPECTED
    assert json.loads(data.samples[0]["provenance"]) == {"source": str(source), "row": "line 1",
                                                         "target": "random", "regenerated": False}


def test_too_many_rejects_fail_with_a_clear_message(tmp_path):
    source = tmp_path / "chats.jsonl"
    write_broken_file(source, good=4)
    cfg = jsonl_cfg(source, tmp_path / "out")
    with pytest.raises(TooManyRejects, match=r"8 of 12 rows rejected .*max_reject_share"):
        run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target))
    assert len(read_jsonl(tmp_path / "out" / "rejects.jsonl")) == 8  # kept for the user to look at
    assert not (tmp_path / "out" / "summary.json").exists()


def test_command_line_tokenizes_a_local_file(tmp_path):
    import subprocess
    import sys

    source = tmp_path / "chats.jsonl"
    write_broken_file(source, good=40)
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "commands" / "prepare.py"), "+exp=smoke", "data.source=jsonl",
                           f"data.path={source}", "data.regenerate=false", f"out={tmp_path / 'out'}"],
                          capture_output=True, text=True, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(load_prepared(tmp_path / "out").samples) == 40
    assert len(read_jsonl(tmp_path / "out" / "rejects.jsonl")) == len(BROKEN_LINES)
    bad = subprocess.run([sys.executable, str(root / "commands" / "prepare.py"), "+exp=smoke", "data.source=jsonl",
                          f"out={tmp_path / 'out2'}"], capture_output=True, text=True, cwd=root, timeout=300)
    assert bad.returncode == 2 and "data.path" in bad.stdout + bad.stderr


def test_num_proc_gives_the_same_samples(tmp_path):
    source = tmp_path / "chats.jsonl"
    write_broken_file(source, good=12)
    one = jsonl_cfg(source, tmp_path / "one", "data.max_reject_share=0.5")
    two = jsonl_cfg(source, tmp_path / "two", "data.max_reject_share=0.5", "data.num_proc=2")
    run(one, RunLayout.of(one, "prepare"), LazyTarget(one.target))
    run(two, RunLayout.of(two, "prepare"), LazyTarget(two.target))
    a, b = load_prepared(tmp_path / "one").samples, load_prepared(tmp_path / "two").samples
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]


def test_bytes_that_are_not_utf8_reject_their_line_and_a_bom_costs_nothing(tmp_path):
    path = tmp_path / "chats.jsonl"
    good = json.dumps({"messages": EXPECTED}).encode()
    bad = json.dumps({"messages": [{"role": "user", "content": "caf_"}, EXPECTED[1]]}).encode().replace(b"_", b"\xe9")
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + bad + b"\n" + good + b"\n")
    items = list(read_conversations([str(path)], "auto"))
    assert [i.error is None for i in items] == [True, False, True]
    assert items[1].position == "line 2" and items[1].error.reason == "invalid_utf8"
    assert items[1].error.detail == "byte 46 (b'\\xe9') is not valid UTF-8"


def test_every_row_bad_writes_the_rejects_and_fails_in_one_line(tmp_path):
    source = tmp_path / "chats.jsonl"
    unreadable = [line for line, reason in BROKEN_LINES if reason != "no_assistant_turn"]  # none reaches the tokenizer
    source.write_text("\n".join(unreadable) + "\n")
    cfg = jsonl_cfg(source, tmp_path / "out")
    with pytest.raises(TooManyRejects, match=f"all {len(unreadable)} rows were rejected"):
        run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target))
    assert len(read_jsonl(tmp_path / "out" / "rejects.jsonl")) == len(unreadable)


def test_a_missing_or_empty_data_path_is_named(tmp_path):
    cfg = jsonl_cfg(tmp_path / "missing.jsonl", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"`data.path`.*missing.jsonl does not exist"):
        run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target))
    (tmp_path / "empty.jsonl").write_text("\n")
    cfg = jsonl_cfg(tmp_path / "empty.jsonl", tmp_path / "out")
    with pytest.raises(ConfigError, match=r"`data.path`.*empty.jsonl'\] holds no rows"):
        run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target))


def test_prompts_past_the_context_are_rejected_before_generation(tmp_path):
    """A huge row is rejected on its length in characters, a long one on its prompt tokens, before either
    reaches the generator (one 5 MB row once took 7 GB there)."""
    source = tmp_path / "chats.jsonl"
    rows = [{"turns": [f"question {i}"]} for i in range(6)]
    rows[2] = {"turns": ["x" * 64 * 64 * 3]}  # past 64 tokens x 64 characters
    rows[4] = {"turns": ["y " * 100]}  # 200 characters, over 64 prompt tokens
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = jsonl_cfg(source, tmp_path / "out", "data.regenerate=true", "data.max_length=64",
                    "data.generation.max_new_tokens=4", "data.max_reject_share=0.5")
    summary = run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target))
    rejects = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert [(r["position"], r["reason"]) for r in rejects] == [("line 3", "overlong_prompt"),
                                                                ("line 5", "overlong_prompt")]
    assert "characters" in rejects[0]["detail"] and "tokens" in rejects[1]["detail"]
    assert summary["samples"] == 4
