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
Nothing is held whole in memory: sources stream one window at a time (`SourceConversations`), rows go to
Arrow files on disk, and the statistics are gathered batch by batch.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import datasets
import torch

from specdistill.cache import ResultCache
from specdistill.config import ConfigError, RunConfig
from specdistill.data.decontaminate import BenchmarkSpans, decontaminated_against
from specdistill.data.documents import answers_needed, document_tasks, documents_wanted
from specdistill.data.generate import LocalGenerator
from specdistill.data.openai_client import OpenAIBackend
from specdistill.data.regenerate import (
    LocalBackend,
    regenerate_rows,
    row_key,
    sampling_params,
)
from specdistill.data.rejects import RejectLog, RowError, TooManyRejects
from specdistill.data.sources import SourceRow, read_conversations, source_paths
from specdistill.data.synth import synthesize
from specdistill.data.template import ChatFormat
from specdistill.data.vllm_generate import VllmGenerator
from specdistill.data.vocab import DraftVocab, build_draft_vocab, count_tokens
from specdistill.distributed import gather_objects, join_launch
from specdistill.engines import engine_python
from specdistill.io import atomic_dir, write_json
from specdistill.layout import RunLayout
from specdistill.target import Target, check_vocab_fits, computing_in, resolve_dtype, served_dir

log = logging.getLogger(__name__)

MAX_CHARS_PER_TOKEN = 64  # more than any real token spans (runs of whitespace aside)
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


def generation_model(target: Target, dtype_name: str) -> torch.nn.Module:
    """The target in the generation dtype: a copy when it differs (native bf16 decodes ~3x faster on CPU)."""
    model = computing_in(target, dtype_name).model
    log.info("regeneration runs in %s", str(next(model.parameters()).dtype).removeprefix("torch."))
    return model


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
        synthesized, collect_rejects = synthesize(_local_generator(cfg, tgt, chat, cfg.data.synth.batch_size), chat,
                                                  cfg.data.synth, cfg.data.documents, cfg.data.generation, cache,
                                                  cfg.target.name, cfg.seed)
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
        _no_usable_rows(cfg, data_dir, collect_rejects, 0 if cfg.data.source == "synth" else sources.total)
    build_dir = data_dir / ".build"  # Arrow files of the conversations and tokenized rows, until saved
    shutil.rmtree(build_dir, ignore_errors=True)
    conversations = datasets.Dataset.from_generator(
        _conversation_rows, gen_kwargs={"stream": itertools.chain([first], stream)}, features=CONVERSATION_FEATURES,
        cache_dir=str(build_dir), fingerprint=want)
    total_rows = len(conversations) if cfg.data.source == "synth" else sources.total  # counted while drained
    timings["conversations_s"] = time.time() - t0

    t0 = time.time()
    samples, tok_rejects = tokenize_conversations(conversations, chat, cfg)
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


def _no_usable_rows(cfg: RunConfig, data_dir: Path, rejects: RejectLog, total_rows: int) -> NoReturn:
    """Not one conversation to tokenize: say why, with every reject written for the user to read."""
    if cfg.data.source != "synth" and total_rows == 0:
        raise ConfigError(f"config field `data.path`: {source_paths(cfg.data)} holds no rows")
    rejects.write(data_dir / "rejects.jsonl")
    what = "synthesis kept no conversation" if cfg.data.source == "synth" else f"all {total_rows} rows were rejected"
    raise TooManyRejects(f"{what} ({rejects.by_reason()}); see {data_dir / 'rejects.jsonl'}")


def _wait_for_rank0(data_dir: Path) -> dict:
    torch.distributed.barrier()
    return json.loads((data_dir / "summary.json").read_text())


def _local_generator(cfg: RunConfig, tgt: Target, chat: ChatFormat, batch_size: int) -> LocalGenerator:
    return LocalGenerator(generation_model(tgt, cfg.data.generation.dtype), tgt.tokenizer.pad_token_id,
                          chat.stop_token_ids(), batch_size, num_tokens=len(tgt.tokenizer))


def _vllm_generator(cfg: RunConfig, tgt: Target, chat: ChatFormat, rank: int, log_dir: Path) -> VllmGenerator:
    """vLLM serving the target's folder in the generation dtype, on this rank's device, stopping where our decode
    loop stops. The engine's interpreter is the evaluation's (`eval.engine.python`, else `.engine/`)."""
    device = next(tgt.model.parameters()).device
    python = engine_python("vllm", cfg.eval.engine.python, "data.generation.backend=vllm")
    return VllmGenerator(served_dir(cfg.target), python, resolve_dtype(cfg.data.generation.dtype, device),
                         tgt.config.max_position_embeddings, chat.stop_token_ids(), cfg.data.generation.batch_size,
                         len(tgt.tokenizer), tgt.vocab_size, device,
                         log_dir / f"regenerate.rank{rank}.log")


def _conversation_rows(stream: Iterator[dict]) -> Iterator[dict]:
    """{messages, provenance} dicts -> the JSON-string rows of the Arrow file `from_generator` writes."""
    for c in stream:
        yield {"messages": json.dumps(c["messages"], ensure_ascii=False),
               "provenance": json.dumps(c["provenance"], ensure_ascii=False)}


class SourceConversations:
    """The configured sources as usable conversations, in source order, read one window at a time.

    With `data.regenerate`, a window is `chunk_rows x world` rows: each rank regenerates its share into the
    conversation cache, the ranks meet at a barrier, and rank 0 reads the window's answers back from the
    cache (every rank iterates; only rank 0's iteration yields). Only one window is ever held in memory.
    `rejects` and `total` (rows read) are complete once the iteration ends."""

    def __init__(self, cfg: RunConfig, tgt: Target, chat: ChatFormat, cache: ResultCache, rank: int = 0,
                 world: int = 1, engine_log_dir: Path | None = None):
        """engine_log_dir: where the vLLM backend's worker logs (data.generation.backend=vllm)."""
        self.cfg, self.cache, self.rank, self.world = cfg, cache, rank, world
        self.rejects, self.total = RejectLog(), 0
        self.regenerated = 0  # conversations yielded (rank 0)
        self.long_answers: list[tuple[str, str]] = []  # (position, cache key) of those with a document-long answer
        self.paths = source_paths(cfg.data)  # a missing package fails here, before any row is read
        bench = decontaminated_against(cfg)
        self.benchmark = None if bench is None else BenchmarkSpans(bench, tgt.tokenizer, cfg.data.decontaminate_ngram)
        generation = cfg.data.generation
        self.params = sampling_params(generation, generation.backend)
        self.engine: VllmGenerator | None = None  # stopped once the sources are read
        if not cfg.data.regenerate:
            self.backend = None
        elif generation.backend == "openai":
            self.backend = OpenAIBackend(generation, cfg.target.name)
        else:
            if generation.backend == "vllm":
                self.engine = _vllm_generator(cfg, tgt, chat, rank, engine_log_dir or Path("."))
            generator = self.engine or _local_generator(cfg, tgt, chat, generation.batch_size)
            self.backend = LocalBackend(generator, chat, generation, cfg.seed, max_prompt_tokens=cfg.data.max_length)

    def __iter__(self) -> Iterator[dict]:
        data = self.cfg.data
        rows = read_conversations(self.paths, data.format, data.split, data.streaming, data.limit, data.max_turns)
        try:
            yield from self._windows(rows, check=True)
            if data.documents.share > 0 and not data.regenerate:
                log.info("data.regenerate=false: no document tasks (data.documents.share), which need the target's "
                         "answers")
            elif data.documents.share > 0:
                yield from self._windows(iter(self._document_rows()), check=False)
        finally:
            if self.engine is not None:
                self.engine.close()  # its memory is the next stage's

    def _windows(self, rows: Iterator[SourceRow], check: bool) -> Iterator[dict]:
        """`rows` one window at a time, the bad ones rejected (`check`: the source rows' checks), the rest
        regenerated or passed on as they are."""
        data = self.cfg.data
        window_rows = data.generation.chunk_rows * (self.world if data.regenerate else 1)
        while window := list(itertools.islice(rows, window_rows)):
            self.total += len(window)
            good = []
            for item in window:
                if check and item.error is None and data.regenerate:
                    item.error = prompt_too_long(item.row["messages"], data.max_length)
                if check and item.error is None and self.benchmark is not None:
                    item.error = self.benchmark.overlap(item.row["messages"], answers=not data.regenerate)
                if item.error is not None:
                    self.rejects.add(item.source, item.position, item.error)
                else:
                    good.append(item)
            yield from (self._regenerated(good) if data.regenerate else map(self._as_is, good))

    def _document_rows(self) -> list[SourceRow]:
        """Document tasks over the regenerated answers (`documents.document_tasks`), as rows every rank has:
        rank 0, which read every regenerated conversation, picks the answers and shares the rows."""
        docs, rows = self.cfg.data.documents, None
        if self.rank == 0:
            wanted = documents_wanted(docs, self.regenerated)
            picked = random.Random(self.cfg.seed).sample(self.long_answers,
                                                         min(len(self.long_answers), answers_needed(docs, wanted)))
            answers = [(position, self._long_answer(key)) for position, key in picked]
            rows = [SourceRow("documents", position, {"messages": [{"role": "user", "content": text}],
                                                      "provenance": provenance})
                    for position, text, provenance in document_tasks(answers, wanted, docs, self.cfg.seed)]
            log.info("%d document tasks over %d of the %d regenerated answers of %d characters or more", len(rows),
                     len(answers), len(self.long_answers), docs.min_chars)
        return gather_objects(rows)[0]

    def _long_answer(self, key: str) -> str:
        """The first answer of the cached conversation `key` that is long enough to be a document."""
        messages = self.cache.get(key)["messages"]
        return next(m["content"] for m in messages
                    if m["role"] == "assistant" and len(m["content"]) >= self.cfg.data.documents.min_chars)

    def _provenance(self, row: SourceRow, regenerated: bool) -> dict:
        provenance = {"source": row.source, "row": row.position, "target": self.cfg.target.name,
                      "regenerated": regenerated, **row.row.get("provenance", {})}
        return {**provenance, "sampling": self.params} if regenerated else provenance

    def _as_is(self, row: SourceRow) -> dict:
        return {"messages": row.row["messages"], "provenance": self._provenance(row, False)}

    def _regenerated(self, good: list[SourceRow]) -> Iterator[dict]:
        target_name, chunk_rows = self.cfg.target.name, self.cfg.data.generation.chunk_rows
        failed = regenerate_rows(good, self.backend, self.cache, self.params, target_name, chunk_rows, self.rank,
                                 self.world)
        if self.world > 1:
            torch.distributed.barrier()  # every rank's share of the window is in the cache
            self.cache.reload()
        if self.rank != 0:
            return
        failures = {(r["source"], r["position"]): r for r in failed.rows}
        for row in good:
            key = row_key(row.row["messages"], self.params, target_name)
            entry = self.cache.get(key)
            if entry is None:
                known = failures.get((row.source, row.position))
                self.rejects.add(row.source, row.position, RowError(known["reason"], known["detail"]) if known else
                                 RowError("regeneration_failed", "no regenerated answer (see the other ranks' logs)"))
                continue
            self.regenerated += 1
            if any(m["role"] == "assistant" and len(m["content"]) >= self.cfg.data.documents.min_chars
                   for m in entry["messages"]):
                self.long_answers.append((row.position, key))
            yield {"messages": entry["messages"], "provenance": self._provenance(row, True)}


def prompt_too_long(messages: list[dict], max_length: int) -> RowError | None:
    """A RowError when the turns the target reads (system and user; the answers are regenerated) hold more
    characters than `max_length` tokens can: such a row is rejected before it is tokenized or generated."""
    chars = sum(len(m["content"]) for m in messages if m["role"] != "assistant")
    if chars > max_length * MAX_CHARS_PER_TOKEN:
        return RowError("overlong_prompt", f"the prompt turns hold {chars} characters, more than data.max_length="
                                           f"{max_length} tokens can (at most {MAX_CHARS_PER_TOKEN} characters each)")
    return None


def _tokenize_row(row: dict, chat: ChatFormat, max_length: int, overlong: str, last_turn_only: bool) -> dict:
    try:
        out = chat.tokenize(json.loads(row["messages"]), max_length, overlong, last_turn_only)
    except RowError as err:
        return {"input_ids": [], "loss_mask": [], "truncated": False,
                "reject": json.dumps({"reason": err.reason, "detail": err.detail})}
    return {"input_ids": out.input_ids, "loss_mask": out.loss_mask, "truncated": out.truncated, "reject": ""}


def tokenize_conversations(rows: datasets.Dataset, chat: ChatFormat,
                           cfg: RunConfig) -> tuple[datasets.Dataset, RejectLog]:
    """Tokenize {messages, provenance} rows with `datasets.map` (num_proc, on disk); rejected rows are split off."""
    features = datasets.Features({**SAMPLE_FEATURES, "truncated": datasets.Value("bool"),
                                  "reject": datasets.Value("string")})
    data = cfg.data
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
        "decontamination": _decontamination(cfg, rejects),
        "draft_vocab_size": vocab.size,
        "distinct_loss_tokens": int((vocab.counts_V > 0).sum()),
        "coverage": round(vocab.coverage, 6),
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
    }


def _decontamination(cfg: RunConfig, rejects: RejectLog) -> dict | None:
    """What decontamination checked against and how many conversations it dropped; None where it did not run."""
    bench = decontaminated_against(cfg)
    if bench is None:
        return None
    dropped = sum(r["reason"] == "benchmark_overlap" for r in rejects.rows)
    return {"bench": bench, "ngram": cfg.data.decontaminate_ngram, "dropped": dropped}
