"""Decontamination: a read conversation that shares a long span of tokens with the benchmark the run is evaluated
on (`eval.bench`, every row of both splits, every turn) is left out of the training data. Chat sets quote the
prompts benchmarks are built from (Spec-Bench draws on MT-Bench, GSM8K, CNN/DailyMail, WMT), and a head trained
on the target's answers to the very prompts it is scored on would report an acceptance no user sees.

A span is `data.decontaminate_ngram` tokens of the target's tokenizer over normalised text: lower case, runs of
whitespace as one space, and a space before each text, so a span that opens a turn on one side and sits inside a
turn on the other tokenises the same. The real-chat data configs use 13, the span of GPT-3's contamination check
(counted there in words; 13 BPE tokens are about ten). The benchmark's spans are held as hashes, each naming its
first row.
"""

from __future__ import annotations

from specdistill.config import DataConfig
from specdistill.data.rejects import RowError
from specdistill.evaluate.bench import is_test_row, load_items


def normalized(text: str) -> str:
    return " " + " ".join(text.lower().split())


class BenchmarkSpans:
    """Every `n`-token span of the benchmark `bench`, to find the first one a conversation holds."""

    def __init__(self, bench: str, tokenizer, n: int):
        self.bench, self.tokenizer, self.n = bench, tokenizer, n
        self.row_of: dict[int, int] = {}  # span hash -> the first benchmark row holding it
        for row, turns in enumerate(load_items(bench)):
            for ids in self._token_ids(turns):
                for start in range(len(ids) - n + 1):
                    self.row_of.setdefault(hash(tuple(ids[start:start + n])), row)

    def _token_ids(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer([normalized(t) for t in texts], add_special_tokens=False)["input_ids"]

    def overlap(self, messages: list[dict], answers: bool) -> RowError | None:
        """A `benchmark_overlap` RowError naming the message, the span and the benchmark row, for the first span
        the conversation shares with the benchmark; None when it shares none. The assistant messages are read
        only with `answers` (they are trained on only when they are not regenerated)."""
        checked = [(i, m) for i, m in enumerate(messages) if answers or m["role"] != "assistant"]
        for (i, message), ids in zip(checked, self._token_ids([m["content"] for _, m in checked])):
            for start in range(len(ids) - self.n + 1):
                row = self.row_of.get(hash(tuple(ids[start:start + self.n])))
                if row is not None:
                    span = self.tokenizer.decode(ids[start:start + self.n]).strip()
                    split = "test" if is_test_row(row) else "dev"
                    return RowError("benchmark_overlap", f"messages[{i}] ({message['role']}) shares the {self.n}-token "
                                                         f"span {span!r} with {self.bench} row {row} ({split} split)")
        return None


def decontaminated_against(data: DataConfig, eval_bench: str) -> str | None:
    """The benchmark (`eval_bench`, the one the run is evaluated on) whose spans read sources are checked against;
    None when none is (self-synthesis reads nothing, and `data.decontaminate_ngram=0` turns the check off)."""
    return eval_bench if data.source != "synth" and data.decontaminate_ngram else None
