"""The evaluate stage: real tau, per-depth acceptance, speedup and a lossless check on the real target,
with baselines (prompt lookup, the head as a chain) and serving advice, all in one report.

Every prompt is decoded by plain decoding (the speed baseline and, at temperature 0, the reference)
and by each drafter, in the same run and the same batches. Later turns of multi-turn items follow
the target's own plain-decoding answers. Each finished batch is kept in `<out>/partial/` (its tokens,
acceptance and wall times), so a killed evaluation resumes at the batch it was in. Under `accelerate launch
--num_processes N` the ranks share the batches and rank 0 writes the report, equal to a one-process run's.
Also `evaluate_head_tau`, the cheap in-training tau.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from math import prod
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from specdistill.cache import ResultCache, content_key
from specdistill.config import EvalConfig, RunConfig
from specdistill.decode import kernels
from specdistill.decode.drafters import HeadProposer, LookupProposer, chain_proposer
from specdistill.decode.loop import GenerationStats, plain_generate, speculative_generate
from specdistill.decode.verify import GREEDY, Sampling
from specdistill.distributed import gather_objects, rank_and_world
from specdistill.evaluate import metrics
from specdistill.evaluate.advice import advise, head_cost, target_cost
from specdistill.evaluate.bench import conversation_ids, load_prompts, turn_batches
from specdistill.evaluate.engine import engine_digest, evaluate_in_engine
from specdistill.evaluate.report import write_report
from specdistill.heads.base import drafts_in_parallel
from specdistill.heads.checkpoint import HEAD_CONFIG, check_head_fits_target, load_head
from specdistill.io import weights_fingerprint
from specdistill.layout import RunLayout
from specdistill.target import Target
from specdistill.target_runner import TargetRunner

log = logging.getLogger(__name__)
MAIN = "head tree"
PARTIAL = "partial"  # finished batches of an evaluation still running (or killed), removed when it completes


def load_any_head(path: str | Path, target: Target):
    """A training checkpoint (head_config.json) or an exported EAGLE-3 directory (config.json), refused unless it
    fits `target`; an export without the embedding gets the target's, as the engines do."""
    path = Path(path)
    if (path / HEAD_CONFIG).exists():
        head = load_head(path)
        check_head_fits_target(head, target, path)
        return head
    from specdistill.export import common
    from specdistill.export.reader import read_head

    if not (path / common.CONFIG_FILE).exists():
        raise FileNotFoundError(f"{path}: neither {HEAD_CONFIG} (a checkpoint) nor {common.CONFIG_FILE} (an export)")
    head = read_head(path)
    with safe_open(str(path / common.WEIGHTS_FILE), "pt") as f:
        has_embedding = any(k.endswith("embed_tokens.weight") for k in f.keys())
    check_head_fits_target(head, target, path)
    if not has_embedding:
        head.embed_tokens.weight.data.copy_(target.model.get_input_embeddings().weight.float())
    return head


def tree_shape(ev: EvalConfig, parallel: bool = False) -> dict:
    """The head tree's (depth, topk, num_draft_tokens): the dynamic tree's, or the sampled tree's; a P-EAGLE or DFlash head
    (`parallel`) drafts a chain of the tree's depth, as vLLM serves it (its depths past the first do not read the
    draft before them, so a tree would branch into copies of one distribution)."""
    if parallel:
        return {"depth": ev.tree.depth, "topk": 1, "num_draft_tokens": ev.tree.depth}
    if ev.temperature > 0 and ev.rejection == "multi_candidate":
        nodes = sum(prod(ev.branching[: d + 1]) for d in range(len(ev.branching)))
        return {"depth": len(ev.branching), "topk": max(ev.branching), "num_draft_tokens": nodes}
    return {"depth": ev.tree.depth, "topk": ev.tree.topk, "num_draft_tokens": ev.tree.num_draft_tokens}


def evaluated_shapes(report: dict, tallies: dict[str, Tally]) -> list[dict]:
    """The head shapes this evaluation measured, with their tau: what the serving advice checks itself on."""
    shapes = [{"drafter": MAIN, **report["tree"], "tau": round(report["tau"], 3)}]
    if "chain" in tallies:
        depth = tallies["chain"].depth
        shapes.append({"drafter": "chain", "depth": depth, "topk": 1, "num_draft_tokens": depth,
                       "tau": round(report["baselines"]["chain"]["tau"], 3)})
    return shapes


def drafters(head, target: Target, ev: EvalConfig) -> dict[str, tuple[object, int]]:
    """name -> (proposer, depth of its trees)."""
    t = ev.tree
    parallel = drafts_in_parallel(head)
    shape = "sampled" if ev.temperature > 0 and ev.rejection == "multi_candidate" else "tree"
    main = (chain_proposer(head, target.vocab_size, t.depth) if parallel else
            HeadProposer(head, target.vocab_size, shape, t.depth, t.topk, t.num_draft_tokens, ev.branching))
    out = {MAIN: (main, tree_shape(ev, parallel)["depth"])}
    if "chain" in ev.baselines:
        out["chain"] = (chain_proposer(head, target.vocab_size, t.depth), t.depth)
    if "prompt_lookup" in ev.baselines:
        out["prompt_lookup"] = (LookupProposer(ev.lookup_tokens, ev.lookup_max_ngram), ev.lookup_tokens)
    return out


@dataclass
class Tally:
    """One drafter's totals over the whole benchmark."""

    depth: int
    accepted: list[int] = field(default_factory=list)
    copy_rounds: list[bool] = field(default_factory=list)  # per round: starts on a token copied from the context
    categories: list[str | None] = field(default_factory=list)  # per round: its prompt's benchmark category
    prompt_of_round: list[int] = field(default_factory=list)  # per round: which prompt (in evaluation order)
    prompts: int = 0
    hits: list[tuple[int, int, int]] = field(default_factory=list)
    new_tokens: int = 0
    target_forwards: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    mismatches: int = 0

    def add(self, stats, seconds: float, reference: list[list[int]] | None, prompt_ids: list[list[int]],
            categories: list[str | None]) -> None:
        """reference: plain decoding's tokens, the lossless check's; None where no plain decoding ran (nothing
        is checked then, rather than the tokens against themselves)."""
        self.accepted += [a for row in stats.accepted for a in row]
        self.categories += [c for c, row in zip(categories, stats.accepted) for _ in row]
        self.prompt_of_round += [self.prompts + j for j, row in enumerate(stats.accepted) for _ in row]
        self.prompts += len(stats.accepted)
        self.copy_rounds += [c for ids, out, row in zip(prompt_ids, stats.tokens, stats.accepted)
                             for c in metrics.copy_rounds(ids, out, row)]
        self.hits += stats.hits
        self.new_tokens += sum(len(t) for t in stats.tokens)
        self.target_forwards += stats.target_forwards
        self.wall_s += seconds
        self.draft_s += stats.draft_s
        self.verify_s += stats.verify_s
        if reference is not None:
            self.mismatches += sum(t != r for t, r in zip(stats.tokens, reference))

    def split_rounds(self) -> tuple[list[int], list[int]]:
        """Accepted counts of the copy rounds and of the others."""
        copied = [a for a, c in zip(self.accepted, self.copy_rounds) if c]
        return copied, [a for a, c in zip(self.accepted, self.copy_rounds) if not c]

    def tau_split(self, split: tuple[list[int], list[int]] | None = None) -> dict:
        """tau over all rounds, over copy rounds, over the rest, the copy rounds' share, and tau per benchmark
        category (where the rows name one). split: `split_rounds()`, where the caller has it already."""
        copied, elsewhere = split or self.split_rounds()
        named = sorted({c for c in self.categories if c is not None})
        by_category = {name: metrics.tau([a for a, c in zip(self.accepted, self.categories) if c == name])
                       for name in named}
        return {"tau": metrics.tau(self.accepted), "tau_copy": metrics.tau(copied),
                "tau_elsewhere": metrics.tau(elsewhere), "copy_round_share": len(copied) / max(1, len(self.accepted)),
                "tau_by_category": by_category}

    def report(self, baseline_wall_s: float, greedy: bool) -> dict:
        copied, elsewhere = self.split_rounds()
        return {
            **self.tau_split((copied, elsewhere)),
            "accept_per_depth": metrics.accept_per_depth(self.accepted, self.depth),
            "accept_per_depth_conditional": metrics.accept_per_depth_conditional(self.accepted, self.depth),
            # where a drafter loses its copies: at the first token, or deeper in the span
            "accept_per_depth_conditional_copy": metrics.accept_per_depth_conditional(copied, self.depth),
            "accept_per_depth_conditional_elsewhere": metrics.accept_per_depth_conditional(elsewhere, self.depth),
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "wall_s": round(self.wall_s, 3),
            "baseline_wall_s": round(baseline_wall_s, 3),
            "speedup": baseline_wall_s / self.wall_s if self.wall_s else 0.0,
            "draft_s": round(self.draft_s, 3),
            "verify_s": round(self.verify_s, 3),
            "lossless_mismatches": self.mismatches if greedy else None,
        }


def outside_draft_vocab(head, outputs: list[list[int]]) -> float:
    """Share of the target's output tokens the head cannot propose: outside its draft vocabulary."""
    tokens = torch.tensor([t for out in outputs for t in out], dtype=torch.long, device=head.t2d.device)
    return float((~head.t2d[tokens]).float().mean()) if len(tokens) else 0.0


def _timed(device: torch.device, fn, *args):
    """fn(*args) and its wall time (CUDA synchronised)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - t0


def evaluation_fingerprint(ev: EvalConfig, seed: int, target: Target, head) -> str:
    """Everything a batch's results depend on besides its prompts; a killed evaluation re-uses a finished
    batch only where all of it matches (the slice size and the serving-advice settings do not enter)."""
    fields = {k: v for k, v in asdict(ev).items() if k not in ("limit", "advice", "loop_limit", "loop_max_new_tokens")}
    parameter = next(target.model.parameters())
    return content_key("evaluate", fields, target.name, target.revision, weights_fingerprint(target.model),
                       weights_fingerprint(head), str(parameter.dtype), parameter.device.type, seed)


def decode_batch(target: Target, runner: TargetRunner, proposers: dict, ids: list[list[int]], ev: EvalConfig,
                 sampling: Sampling, seed: int) -> dict:
    """One batch by plain decoding and by every drafter, as a JSON record: tokens, per-round acceptance and wall
    times. Each decoder samples from its own generator seeded with `seed`, the batch's own, so a batch decodes
    alike whichever rank takes it and whatever ran before it."""
    device, eos, pad = next(target.model.parameters()).device, target.eos_ids, target.tokenizer.pad_token_id
    reference, seconds = _timed(device, plain_generate, target.model, ids, ev.max_new_tokens, eos, sampling,
                                torch.Generator(device).manual_seed(seed), pad)
    record = {"plain": {"tokens": reference, "seconds": seconds}, "drafters": {}}
    for name, (proposer, _) in proposers.items():
        stats, seconds = _timed(device, speculative_generate, runner, proposer, ids, ev.max_new_tokens, eos,
                                sampling, torch.Generator(device).manual_seed(seed), pad)
        record["drafters"][name] = {**asdict(stats), "seconds": seconds}
    return record


def generation_stats(record: dict) -> GenerationStats:
    """A drafter's stats back from its JSON record."""
    fields = {k: v for k, v in record.items() if k != "seconds"}
    return GenerationStats(**{**fields, "hits": [tuple(h) for h in fields["hits"]]})


def decode_shared(ev: EvalConfig, seed: int, target: Target, head, proposers: dict, items: list[list[str]],
                  out_dir: Path) -> tuple[list[tuple[int, list[int]]], dict[int, dict], dict]:
    """Decode every batch, shared between the ranks: rank r takes every N-th batch of each turn, and after each
    turn the ranks swap their records (a later turn asks after the target's own earlier answers). Each finished
    batch is kept in `<out>/partial/` under a key of everything it depends on (this rank's file; every rank's
    file is read), so a killed evaluation resumes at the batches it had not finished, under any number of ranks.
    Returns the batches (turn, item indices), each batch's {"ids", "record"} on every rank, and
    {"resumed": batches taken from the cache, "prompts_per_rank": [...]}."""
    rank, world = rank_and_world()
    runner, sampling = TargetRunner(target), Sampling(ev.temperature, ev.top_k, ev.top_p)
    done = ResultCache(out_dir / PARTIAL, f"rank{rank}", stem="batches")
    fingerprint = evaluation_fingerprint(ev, seed, target, head)
    batches = list(turn_batches(items, ev.batch_size))
    decoded, answers, resumed, prompts = {}, [[] for _ in items], 0, 0
    bar = tqdm(total=sum(len(chunk) for _, chunk in batches[rank::world]), unit="prompt", position=rank,
               desc=f"evaluate {ev.bench}" + (f" rank {rank}" if world > 1 else ""))
    for turn in sorted({t for t, _ in batches}):
        in_turn = [b for b, (t, _) in enumerate(batches) if t == turn]
        mine = {}
        for b in in_turn[rank::world]:
            chunk = batches[b][1]
            ids = [conversation_ids(target.tokenizer, items[i][: turn + 1], answers[i]) for i in chunk]
            key = content_key(fingerprint, ids)
            record = done.get(key)
            if record is None:
                record = decode_batch(target, runner, proposers, ids, ev, sampling, int(key[:15], 16))
                done.put(key, record)
            else:
                resumed += 1
            mine[b] = {"ids": ids, "record": record}
            prompts += len(chunk)
            bar.update(len(chunk))
        for share in gather_objects(mine):
            decoded.update(share)
        for b in in_turn:
            for j, i in enumerate(batches[b][1]):
                answers[i].append(target.tokenizer.decode(decoded[b]["record"]["plain"]["tokens"][j],
                                                          skip_special_tokens=True))
    bar.close()
    counts = gather_objects((resumed, prompts))
    return batches, decoded, {"resumed": sum(r for r, _ in counts), "prompts_per_rank": [p for _, p in counts]}


def evaluate(cfg: RunConfig, target: Target, head, out_dir: Path, head_path: str = "",
             serve_dirs: dict[str, str] | None = None) -> dict | None:
    """Decode the benchmark with plain decoding and every drafter; write and return the report. The serving
    advice names `serve_dirs` ({"sglang": dir, "vllm": dir}; default: `head_path` for both). Under N ranks the
    batches are shared (`decode_shared`) and rank 0 alone writes the report, runs the engine check and returns
    the report; the other ranks return None."""
    ev = cfg.eval
    kernels.set_backend(ev.kernels)
    device = next(target.model.parameters()).device
    head = head.to(device=device, dtype=target.model.dtype).eval()
    fingerprint = content_key(evaluation_fingerprint(ev, cfg.seed, target, head), asdict(ev))
    done = json.loads((out_dir / "report.json").read_text()) if (out_dir / "report.json").exists() else {}
    if done.get("fingerprint") == fingerprint:
        log.info("%s already holds this evaluation (the same head, target and settings): kept; remove it to measure "
                 "again", out_dir / "report.json")
        return done if rank_and_world()[0] == 0 else None
    items, categories = load_prompts(ev.bench, ev.limit, ev.max_turns, ev.split)
    proposers = drafters(head, target, ev)
    batches, decoded, sharing = decode_shared(ev, cfg.seed, target, head, proposers, items, out_dir)
    if rank_and_world()[0] != 0:
        return None
    tallies = {name: Tally(depth) for name, (_, depth) in proposers.items()}
    rows, plain_s = [], 0.0
    for b, (turn, chunk) in enumerate(batches):
        ids, record = decoded[b]["ids"], decoded[b]["record"]
        reference = record["plain"]["tokens"]
        plain_s += record["plain"]["seconds"]
        outputs = {name: generation_stats(r) for name, r in record["drafters"].items()}
        for name, stats in outputs.items():
            tallies[name].add(stats, record["drafters"][name]["seconds"], reference, ids,
                              [categories[i] for i in chunk])
        main = outputs[MAIN]
        for j, i in enumerate(chunk):
            rows.append({"item": i, "turn": turn, "prompt": items[i][turn], "prompt_ids": ids[j],
                         "output_ids": main.tokens[j], "plain_output_ids": reference[j],
                         "accepted_per_round": main.accepted[j], "matches_plain": main.tokens[j] == reference[j]})
    greedy = ev.temperature == 0
    report = {
        **tallies[MAIN].report(plain_s, greedy),
        "tree": tree_shape(ev, drafts_in_parallel(head)),
        "temperature": ev.temperature,
        "num_prompts": len(rows),
        "bench": ev.bench,
        "split": ev.split,
        "batch_size": ev.batch_size,
        "max_new_tokens": ev.max_new_tokens,
        "target": target.name,
        "head": head_path or head.config.kind,
        "plain_new_tokens": sum(len(r["plain_output_ids"]) for r in rows),
        "outside_draft_vocab": outside_draft_vocab(head, [r["plain_output_ids"] for r in rows]),
        "baselines": {name: t.report(plain_s, greedy) for name, t in tallies.items() if name != MAIN},
        "fingerprint": fingerprint,  # a rerun of the same evaluation keeps this report
        "resumed_batches": sharing["resumed"],  # batches (and their wall times) taken from a killed earlier sitting
        "world": len(sharing["prompts_per_rank"]),  # ranks that shared the decoding
        "prompts_per_rank": sharing["prompts_per_rank"],
    }
    intervals = metrics.tau_intervals({n: t.accepted for n, t in tallies.items()},
                                      {n: t.prompt_of_round for n, t in tallies.items()}, len(rows), MAIN, cfg.seed)
    report["tau_ci"] = intervals[MAIN]["tau_ci"]
    for name, baseline in report["baselines"].items():
        baseline.update(tau_ci=intervals[name]["tau_ci"],
                        head_ratio=report["tau"] / baseline["tau"] if baseline["tau"] else 0.0,
                        head_ratio_ci=intervals[name]["head_ratio_ci"])
    table = metrics.coverage(tallies[MAIN].hits + (tallies["chain"].hits if "chain" in tallies else []),
                             ev.advice.min_rounds)
    report["serving_advice"] = advise(table, target_cost(target.model, ev.advice), head_cost(head, ev.advice),
                                      ev.advice, head.config.kind,
                                      serve_dirs or dict.fromkeys(("sglang", "vllm"), head_path or "<head dir>"),
                                      evaluated_shapes(report, tallies), drafts_in_parallel(head),
                                      head.config.block_size - 1 if head.config.kind == "dflash" else None)
    if ev.engine.name:  # the same head served by the engine, its tau beside our chain's
        report["engine"] = engine_digest(evaluate_in_engine(cfg.eval, cfg.export.dtype, cfg.target, target, head,
                                                            out_dir))
    write_report(report, rows, out_dir, cfg.wandb)
    shutil.rmtree(out_dir / PARTIAL)  # finished: a later evaluation measures afresh
    return report


@torch.inference_mode()
def evaluate_head_tau(head, target: Target, prompts: list[str], cfg: EvalConfig) -> dict:
    """Greedy tau of `head` with the tree verifier on `prompts` (`cfg.loop_max_new_tokens` each, batches of
    `cfg.batch_size`): cheap enough to run every `train.eval_every` steps. Under N ranks each rank decodes every
    N-th batch and every rank returns the same result, a one-process run's. The head is left as it was."""
    was_training = head.training
    head.eval()
    t = cfg.tree
    proposer = (chain_proposer(head, target.vocab_size, t.depth) if drafts_in_parallel(head) else
                HeadProposer(head, target.vocab_size, "tree", t.depth, t.topk, t.num_draft_tokens))
    runner, eos, pad = TargetRunner(target), target.eos_ids, target.tokenizer.pad_token_id
    rank, world = rank_and_world()
    starts = range(0, len(prompts), cfg.batch_size)
    mine = {}
    t0 = time.perf_counter()
    try:
        for start in starts[rank::world]:
            ids = [target.prompt_ids(p) for p in prompts[start : start + cfg.batch_size]]
            mine[start] = (ids, speculative_generate(runner, proposer, ids, cfg.loop_max_new_tokens, eos, GREEDY,
                                                     None, pad))
    finally:
        head.train(was_training)
    decoded = {start: batch for share in gather_objects(mine) for start, batch in share.items()}
    tally = Tally(t.depth)
    for start in starts:
        ids, stats = decoded[start]
        tally.add(stats, 0.0, None, ids, [None] * len(ids))
    return {**tally.tau_split(), "accept_per_depth": metrics.accept_per_depth(tally.accepted, t.depth),
            "new_tokens": tally.new_tokens, "target_forwards": tally.target_forwards,
            "seconds": round(time.perf_counter() - t0, 3)}


def run(cfg: RunConfig, layout: RunLayout, target) -> dict:
    out_dir, path = layout.eval_dir, layout.trained_head_dir()
    serve_dirs = {engine: str(layout.export_dir / engine) for engine in ("sglang", "vllm")}
    report = evaluate(cfg, target.get(), load_head(path), out_dir, str(path), serve_dirs)
    if report is None:  # a rank other than 0: its share is in rank 0's report
        return {}
    log.info("tau %.2f, speedup %.2fx, lossless mismatches %s; report in %s", report["tau"], report["speedup"],
             report["lossless_mismatches"], out_dir / "report.json")
    return {"report": str(out_dir / "report.json"), "engine": report.get("engine"),
            **{k: report[k] for k in ("tau", "tau_ci", "speedup", "lossless_mismatches", "split", "num_prompts")}}
