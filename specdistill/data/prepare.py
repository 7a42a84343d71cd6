"""The `prepare` stage: conversations (self-synthesised, or read, decontaminated and regenerated) -> tokenized
samples with assistant-only loss masks -> draft vocabulary.

Output layout under the data dir (`RunLayout.data_dir`: the store entry of these data settings), read by
capture and train:
  samples/            HF datasets `save_to_disk`: input_ids (int32), loss_mask (uint8), messages and
                      provenance (JSON strings)
  vocab.safetensors   d2t int64 [N], t2d bool [V], counts int64 [V] (see `vocab.py`)
  rejects.jsonl       every unusable or left-out row with its reason and source position
  summary.json        counts, rejects per reason, decontamination, coverage, timings; written last, so its presence
                      with a matching fingerprint means the stage is complete and can be skipped
  engine/             each rank's vLLM log (data.generation.backend=vllm)
  .build/             Arrow files of the conversations and tokenized rows while the stage runs (removed)

Generated conversations are cached by content in the store's `cache/` (`RunLayout.cache_dir`), shared by every
entry: a killed run resumes there, and data made with other settings reuses every answer already generated.
Nothing is held whole in memory: sources stream one window at a time (`conversations.py`), rows go to
Arrow files on disk, and the statistics are gathered batch by batch.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import datasets
import torch

from specdistill.cache import ResultCache
from specdistill.config import ConfigError, DataConfig, RunConfig
from specdistill.data.conversations import SourceConversations, local_generator, vllm_generator
from specdistill.data.decontaminate import decontaminated_against
from specdistill.data.rejects import RejectLog, RowError, TooManyRejects
from specdistill.data.sources import source_paths
from specdistill.data.synth import synthesize
from specdistill.data.template import ChatFormat
from specdistill.data.vocab import DraftVocab, build_draft_vocab, count_tokens
from specdistill.distributed import join_launch
from specdistill.io import atomic_dir, write_json
from specdistill.layout import RunLayout
from specdistill.target import Target, check_vocab_fits

log = logging.getLogger(__name__)

CONVERSATION_FEATURES = datasets.Features({"messages": datasets.Value("string"),
                                           "provenance": datasets.Value("string")})
SAMPLE_FEATURES = datasets.Features({
    "input_ids": datasets.Sequence(datasets.Value("int32")),
    "loss_mask": datasets.Sequence(datasets.Value("uint8")),
    "messages": datasets.Value("string"),
    "provenance": datasets.Value("string"),
})


@dataclass
class PreparedData:
    samples: datasets.Dataset
    vocab: DraftVocab


def load_prepared(data_dir: str | Path) -> PreparedData:
    """The prepare stage's output, for capture and train."""
    data_dir = Path(data_dir)
    if not (data_dir / "summary.json").exists():
        raise FileNotFoundError(f"{data_dir}: no complete prepared data (summary.json missing); run the prepare stage")
    return PreparedData(samples=datasets.load_from_disk(str(data_dir / "samples")),
                        vocab=DraftVocab.load(data_dir / "vocab.safetensors"))


def _completed_summary(data_dir: Path, want: str) -> dict | None:
    path = data_dir / "summary.json"
    if not (path.exists() and (data_dir / "samples").is_dir() and (data_dir / "vocab.safetensors").exists()):
        return None
    summary = json.loads(path.read_text())
    if summary.get("fingerprint") != want:
        log.info("%s holds data prepared with another config; preparing again", data_dir)
        return None
    return summary



def run(cfg: RunConfig, layout: RunLayout, target) -> dict:
    """Build (or find complete) the prepared data in `layout.data_dir`; returns the summary."""
    data_dir, want = layout.data_dir, layout.data_key
    done = _completed_summary(data_dir, want)
    if done is not None:
        log.info("prepare: reusing the prepared data in %s (%d samples): made for these data settings already",
                 data_dir, done["samples"])
        return done
    rank, world, _ = join_launch()
    timings: dict[str, float] = {}
    t0 = time.time()
    tgt: Target = target.get()
    check_vocab_fits(cfg, tgt.vocab_size)  # again on the loaded model: a GGUF-only target's size is known only now
    chat = ChatFormat(tgt.tokenizer)
    cache = ResultCache(layout.cache_dir, f"{want[:12]}.rank{rank}")
    timings["load_target_s"] = time.time() - t0

    t0 = time.time()
    if cfg.data.source == "synth":
        if rank != 0:  # synthesis is one sampling stream; the other ranks wait for its result
            return _wait_for_rank0(data_dir)
        synthesized, collect_rejects = _synthesized(cfg, tgt, chat, cache, data_dir / "engine")
        stream, counted = iter(synthesized), RejectLog()  # synthesis filters are not bad input
    else:
        sources = SourceConversations(cfg, tgt, chat, cache, rank, world, data_dir / "engine")
        if rank != 0:  # regenerate this rank's share of every window; rank 0 writes the samples
            if cfg.data.regenerate:
                for _ in sources:
                    pass
            return _wait_for_rank0(data_dir)
        stream, collect_rejects = iter(sources), sources.rejects
        counted = collect_rejects
    first = next(stream, None)  # read here, not inside `from_generator`, whose wrapper hides the cause
    if first is None:
        _no_usable_rows(cfg.data, data_dir, collect_rejects, 0 if cfg.data.source == "synth" else sources.total)
    build_dir = data_dir / ".build"  # Arrow files of the conversations and tokenized rows, until saved
    shutil.rmtree(build_dir, ignore_errors=True)
    conversations = datasets.Dataset.from_generator(
        _conversation_rows, gen_kwargs={"stream": itertools.chain([first], stream)}, features=CONVERSATION_FEATURES,
        cache_dir=str(build_dir), fingerprint=want)
    total_rows = len(conversations) if cfg.data.source == "synth" else sources.total  # counted while drained
    timings["conversations_s"] = time.time() - t0

    t0 = time.time()
    samples, tok_rejects = tokenize_conversations(conversations, chat, cfg.data)
    timings["tokenize_s"] = time.time() - t0

    t0 = time.time()
    counts_V, lengths = sample_statistics(samples, tgt.vocab_size)
    vocab = build_draft_vocab(counts_V, cfg.data.draft_vocab_size)
    timings["vocab_s"] = time.time() - t0

    rejects = RejectLog()
    for part in (collect_rejects, tok_rejects):
        rejects.extend(part)
    rejects.write(data_dir / "rejects.jsonl")
    failing = RejectLog()
    for part in (counted, tok_rejects):
        failing.extend(part)
    failing.check_share(total_rows, cfg.data.max_reject_share, data_dir / "rejects.jsonl")
    if len(samples) == 0:
        raise TooManyRejects(f"prepare produced no samples from {total_rows} conversations; see "
                             f"{data_dir / 'rejects.jsonl'}")
    _save_samples(samples, data_dir / "samples")
    shutil.rmtree(build_dir, ignore_errors=True)
    vocab.save(data_dir / "vocab.safetensors")
    summary = _summary(cfg, want, lengths, vocab, rejects, total_rows, timings)
    write_json(data_dir / "summary.json", summary)
    from_data = min(vocab.size, summary["distinct_loss_tokens"])
    log.info("prepare: %d samples, %d loss tokens, draft vocab %d (%d seen in the answers, %d lowest unseen ids) "
             "covers %.1f%%; wrote %s", summary["samples"], summary["loss_tokens"], vocab.size, from_data,
             vocab.size - from_data, 100 * vocab.coverage, data_dir)
    if world > 1:
        torch.distributed.barrier()
    return summary


def _synthesized(cfg: RunConfig, tgt: Target, chat: ChatFormat, cache: ResultCache, engine_dir: Path):
    """Rank 0's self-synthesised conversations and the rejects its filters collected."""
    generation, batch_size = cfg.data.generation, cfg.data.synth.batch_size
    generator = (vllm_generator(generation, cfg.target, cfg.eval.engine.python, tgt, chat, 0, engine_dir,
                                batch_size) if generation.backend == "vllm" else
                 local_generator(generation.dtype, tgt, chat, batch_size))
    try:
        return synthesize(generator, chat, cfg.data.synth, cfg.data.documents, generation, cache, cfg.target.name,
                          cfg.seed)
    finally:
        if generation.backend == "vllm":
            generator.close()  # its memory is the next stage's


def _no_usable_rows(data: DataConfig, data_dir: Path, rejects: RejectLog, total_rows: int) -> NoReturn:
    """Not one conversation to tokenize: say why, with every reject written for the user to read."""
    if data.source != "synth" and total_rows == 0:
        raise ConfigError(f"config field `data.path`: {source_paths(data)} holds no rows")
    rejects.write(data_dir / "rejects.jsonl")
    what = "synthesis kept no conversation" if data.source == "synth" else f"all {total_rows} rows were rejected"
    raise TooManyRejects(f"{what} ({rejects.by_reason()}); see {data_dir / 'rejects.jsonl'}")


def _wait_for_rank0(data_dir: Path) -> dict:
    torch.distributed.barrier()
    return json.loads((data_dir / "summary.json").read_text())



def _conversation_rows(stream: Iterator[dict]) -> Iterator[dict]:
    """{messages, provenance} dicts -> the JSON-string rows of the Arrow file `from_generator` writes."""
    for c in stream:
        yield {"messages": json.dumps(c["messages"], ensure_ascii=False),
               "provenance": json.dumps(c["provenance"], ensure_ascii=False)}



def _tokenize_row(row: dict, chat: ChatFormat, max_length: int, overlong: str, last_turn_only: bool) -> dict:
    try:
        out = chat.tokenize(json.loads(row["messages"]), max_length, overlong, last_turn_only)
    except RowError as err:
        return {"input_ids": [], "loss_mask": [], "truncated": False,
                "reject": json.dumps({"reason": err.reason, "detail": err.detail})}
    return {"input_ids": out.input_ids, "loss_mask": out.loss_mask, "truncated": out.truncated, "reject": ""}


def tokenize_conversations(rows: datasets.Dataset, chat: ChatFormat,
                           data: DataConfig) -> tuple[datasets.Dataset, RejectLog]:
    """Tokenize {messages, provenance} rows with `datasets.map` (num_proc, on disk); rejected rows are split off."""
    features = datasets.Features({**SAMPLE_FEATURES, "truncated": datasets.Value("bool"),
                                  "reject": datasets.Value("string")})
    mapped = rows.map(_tokenize_row, features=features, num_proc=data.num_proc if len(rows) > 1 else None,
                      fn_kwargs={"chat": chat, "max_length": data.max_length, "overlong": data.overlong,
                                 "last_turn_only": data.last_turn_only},
                      desc="tokenize", load_from_cache_file=False)
    rejects = RejectLog()
    bad = mapped.filter(lambda r: r != "", input_columns="reject", desc="find rejects")
    for row in bad.select_columns(["reject", "provenance"]):
        info, origin = json.loads(row["reject"]), json.loads(row["provenance"])
        rejects.add(origin.get("source", "?"), origin.get("row", "?"), RowError(info["reason"], info["detail"]))
    kept = mapped.filter(lambda r: r == "", input_columns="reject", desc="drop rejects")
    log.info("tokenized %d conversations: %d samples, %d rejected", len(rows), len(kept), len(rejects))
    return kept.remove_columns("reject"), rejects


def sample_statistics(samples: datasets.Dataset, vocab_size: int,
                      batch_rows: int = 1024) -> tuple[torch.Tensor, dict]:
    """One pass over the samples in batches: loss-masked token counts [V] and the length statistics."""
    counts_V = torch.zeros(vocab_size, dtype=torch.int64)
    lengths = {"samples": len(samples), "tokens": 0, "max_len": 0, "truncated": 0}
    for batch in samples.select_columns(["input_ids", "loss_mask", "truncated"]).iter(batch_size=batch_rows):
        counts_V += count_tokens(batch["input_ids"], batch["loss_mask"], vocab_size)
        sizes = [len(ids) for ids in batch["input_ids"]]
        lengths["tokens"] += sum(sizes)
        lengths["max_len"] = max(lengths["max_len"], max(sizes, default=0))
        lengths["truncated"] += sum(batch["truncated"])
    return counts_V, lengths


def _save_samples(samples: datasets.Dataset, out: Path) -> None:
    """save_to_disk into a temp dir beside `out`, then swap it in (readers never see a partial dir)."""
    with atomic_dir(out) as tmp:
        samples.remove_columns("truncated").save_to_disk(str(tmp))


def _summary(cfg: RunConfig, want: str, lengths: dict, vocab: DraftVocab, rejects: RejectLog, total_rows: int,
             timings: dict[str, float]) -> dict:
    return {
        "fingerprint": want,
        "source": cfg.data.source,
        "target": cfg.target.name,
        "conversations": total_rows,
        **lengths,  # samples, tokens, max_len, truncated
        "loss_tokens": int(vocab.counts_V.sum()),
        "rejects": len(rejects),
        "rejects_by_reason": rejects.by_reason(),
        "decontamination": _decontamination(cfg.data, cfg.eval.bench, rejects),
        "draft_vocab_size": vocab.size,
        "distinct_loss_tokens": int((vocab.counts_V > 0).sum()),
        "coverage": round(vocab.coverage, 6),
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
    }


def _decontamination(data: DataConfig, eval_bench: str, rejects: RejectLog) -> dict | None:
    """What decontamination checked against and how many conversations it dropped; None where it did not run."""
    bench = decontaminated_against(data, eval_bench)
    if bench is None:
        return None
    dropped = sum(r["reason"] == "benchmark_overlap" for r in rejects.rows)
    return {"bench": bench, "ngram": data.decontaminate_ngram, "dropped": dropped}
