"""The exported head served by a real engine: its own acceptance counters beside our chain drafter's.

Our evaluator measures a head with our code; a user serves it with an engine that reads our export its
own way. Here the engine (vLLM) runs in its own environment (it pins its own transformers) through
`vllm_worker.py`: once without a draft, for its plain greedy outputs and speed, then once per export
layout. Both sides decode the very same token ids (our chat template, greedy, `eval.max_new_tokens`);
ours drafts a chain of `num_speculative_tokens`, in the engine's dtype, with the head read back from its export
(a target's own MTP module: from the checkpoint it is laid over). In float32 the two must agree count for count:
any difference is a finding about the export or the engine (a layer-id convention, a norm flag, the vocabulary
map), and is reported loudly, never tuned away. The engine serves one request at a time, so each prompt's counts are compared
with ours: a prompt whose plain output already differs is set aside, and a count that differs is an argmax near-tie
only where `near_ties.py` shows it (one draft within the kernels' measured margin, flipped, reproduces it). In
bfloat16 the two decodes part ways by rounding, so the engine's tau is held against our chain replayed along the
engine's own outputs (`forced.py`), within a bound measured on correct exports.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import subprocess
from pathlib import Path

from tqdm import tqdm

from specdistill.cache import ResultCache, content_key
from specdistill.config import ENGINE_LAYOUTS, EngineConfig, EvalConfig, TargetConfig
from specdistill.decode.drafters import chain_proposer
from specdistill.decode.loop import speculative_generate
from specdistill.decode.verify import GREEDY
from specdistill.engines import EXCEPTION_LINE, EngineError, engine_env, engine_python, log_tail
from specdistill.evaluate.bench import conversation_ids, load_prompts, turn_batches
from specdistill.evaluate.counters import COUNTED, chain_counters, same_counts, tau_of
from specdistill.evaluate.forced import bf16_spread, detectable_tau_loss, replay_bound, replayed_counters
from specdistill.evaluate.near_ties import explain, kernel_margin_gap
from specdistill.export import export_dflash, export_eagle3, export_mtp
from specdistill.export.common import CONFIG_FILE, WEIGHTS_FILE, read_config
from specdistill.export.reader import detect_layout, read_head
from specdistill.heads.native_mtp import checkpoint_mtp_state
from specdistill.io import atomic_dir, write_json
from specdistill.target import Target, computing_in, served_dir
from specdistill.target_runner import TargetRunner, keeps_recurrent_state

log = logging.getLogger(__name__)
WORKERS = {"vllm": Path(__file__).with_name("vllm_worker.py")}
# Log lines in which an engine says weights were skipped, left uninitialised or not found.
WEIGHT_PROBLEM = re.compile(r"missing (keys?|weights?|parameters?)|unexpected (keys?|weights?|parameters?)"
                            r"|not (been )?(loaded|initiali[sz]ed)|were not used|weights not found", re.IGNORECASE)


def served_module(head, target_model, checkpoint: Path):
    """A copy of the native MTP `head` whose layer is the one `checkpoint` (the export laid over the target)
    holds, read as the engine reads it: a copy rounded in memory is not bit for bit the export."""
    out = copy.deepcopy(head)
    out.layer.load_state_dict(checkpoint_mtp_state(target_model, head.family, checkpoint))
    return out


def our_chain(target: Target, head, ev: EvalConfig, k: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Our chain of `k` over the benchmark: prompt ids (later turns follow our greedy answers), outputs, and each
    prompt's accepted drafts per round."""
    items, _ = load_prompts(ev.bench, ev.limit, ev.max_turns, ev.split)
    runner, proposer = TargetRunner(target), chain_proposer(head, target.vocab_size, k)
    prompts, outputs, rounds, answers = [], [], [], [[] for _ in items]
    batch_size = 1 if keeps_recurrent_state(target.model) else ev.batch_size  # one row is replayed (ReplayCache)
    bar = tqdm(total=sum(len(it) for it in items), desc=f"our chain of {k}", unit="prompt")
    for turn, chunk in turn_batches(items, batch_size):
        ids = [conversation_ids(target.tokenizer, items[i][: turn + 1], answers[i]) for i in chunk]
        stats = speculative_generate(runner, proposer, ids, ev.max_new_tokens, target.eos_ids, GREEDY, None,
                                     target.tokenizer.pad_token_id)
        for i, tokens in zip(chunk, stats.tokens):
            answers[i].append(target.tokenizer.decode(tokens, skip_special_tokens=True))
        prompts += ids
        outputs += stats.tokens
        rounds += stats.accepted
        bar.update(len(chunk))
    bar.close()
    return prompts, outputs, rounds


def files_fingerprint(directory: str | None) -> list:
    """Each file's name, size and modification time: a folder rewritten since is served afresh."""
    if directory is None:
        return []
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(Path(directory).iterdir()) if p.is_file()]


def run_worker(engine: str, python: str, request: dict, work: Path, run_name: str) -> dict:
    """One engine process over the prompts; its result, with the log lines about weights it did not load. A run
    already finished for the same request, target and draft files is taken from `<work>/runs.jsonl`."""
    done = ResultCache(work, stem="runs")
    key = content_key(engine, python, request, files_fingerprint(request["target"]), files_fingerprint(request["draft"]))
    if (cached := done.get(key)) is not None:
        log.info("%s (%s): the same run finished before; its result is reused from %s", engine, run_name, work)
        return cached
    request_path, result_path, log_path = (work / f"{run_name}.{suffix}" for suffix in ("request.json", "result.json", "log"))
    write_json(request_path, request)
    result_path.unlink(missing_ok=True)
    with open(log_path, "w") as log_file:
        proc = subprocess.run([python, str(WORKERS[engine]), str(request_path), str(result_path)], env=engine_env(),
                              stdout=log_file, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not result_path.exists():
        raise EngineError(f"{engine} ({run_name}, {python}) exited with code {proc.returncode}; its log is "
                          f"{log_path}, ending:\n{log_tail(log_path)}")
    result = json.loads(result_path.read_text())
    lines = log_path.read_text(errors="replace").splitlines()
    result["weight_warnings"] = [line for line in lines if WEIGHT_PROBLEM.search(line)]
    done.put(key, result)
    return result


def root_cause(message: str) -> str:
    """The first exception line of an EngineError's log tail (later ones wrap it), and the error's first line."""
    first, *tail = message.splitlines() or [""]
    cause = next((line.strip() for line in tail if EXCEPTION_LINE.search(line)), tail[-1].strip() if tail else "")
    return f"{cause} ({first})"


def compare(ours: dict, served: dict, plain: dict, our_outputs: list[list[int]], dtype: str, explain_prompt=None,
            epsilon: float | None = None, replayed: dict | None = None) -> dict:
    """One layout's engine run beside ours: counters (in all and per prompt), tau ratio, lossless check, speed, and
    any finding. In float32 `explain_prompt(i, engine_counters)` says why prompt i's counts differ
    (`near_ties.explain`), prompt after prompt up to the first that is no near-tie. In bfloat16 `replayed` holds our
    chain's counters along the engine's outputs (`forced.chain_along`), which its tau is held against."""
    if dtype != "float32" and replayed is None:
        raise ValueError(f"a {dtype} engine run is judged against our chain along its outputs: pass `replayed`")
    counters = served["counters"]
    new_tokens = sum(len(o) for o in served["outputs"])
    mismatched = [i for i, (a, b) in enumerate(zip(served["outputs"], plain["outputs"])) if a != b]
    set_aside = [i for i, (a, b) in enumerate(zip(plain["outputs"], our_outputs)) if a != b and dtype == "float32"]
    differing = [i for i, (a, b) in enumerate(zip(served["per_prompt"], ours["per_prompt"]))
                 if i not in set_aside and not same_counts(a, b)]
    explained = ({} if dtype != "float32" or explain_prompt is None else
                 until_read_differently(differing, lambda i: explain_prompt(i, served["per_prompt"][i])))
    entry = {
        **counters,
        "tau": tau_of(counters),
        "acceptance_per_pos": [a / counters["drafts"] if counters["drafts"] else 0.0
                               for a in counters["accepted_per_pos"]],
        "counters_equal_ours": same_counts(counters, ours),
        "prompts_equal_ours": sum(same_counts(a, b) for a, b in zip(served["per_prompt"], ours["per_prompt"])),
        "set_aside": set_aside,
        "differing_prompts": differing,
        "epsilon": epsilon,
        "per_prompt": served["per_prompt"],
        "near_ties": [{"prompt": i, **e} for i, e in explained.items() if e["near_tie"]],
        "read_differently": [{"prompt": i, **e} for i, e in explained.items() if not e["near_tie"]],
        "not_replayed": [i for i in differing if i not in explained] if explained else [],
        "tau_ratio_to_ours": tau_of(counters) / tau_of(ours),
        **({} if replayed is None else {
            "replay": replayed, "tau_ratio_to_replay": tau_of(counters) / tau_of(replayed),
            "replay_bound": (replay_bound(replayed["drafts"]) or (None,))[0],
            "detectable_tau_loss": detectable_tau_loss(replayed["drafts"])}),
        "outputs_equal_plain": len(served["outputs"]) - len(mismatched),
        "mismatched_prompts": mismatched,
        "outputs_equal_ours": sum(a == b for a, b in zip(served["outputs"], our_outputs)),
        "new_tokens": new_tokens,
        "wall_s": served["wall_s"],
        "load_s": served["load_s"],
        "tokens_per_s": new_tokens / served["wall_s"] if served["wall_s"] else 0.0,
        "speedup_vs_plain": plain["wall_s"] / served["wall_s"] if served["wall_s"] else 0.0,
        "weight_warnings": served["weight_warnings"],
    }
    return {**entry, "finding": finding_of(entry, ours, len(our_outputs), dtype)}


def until_read_differently(differing: list[int], explain_one) -> dict[int, dict]:
    """`explain_one(i)` for each differing prompt in turn, up to the first that is no near-tie: that one already
    makes the float32 finding, and the rest's replays (a few full decodes each) could not lift it."""
    explained = {}
    for i in differing:
        explained[i] = explain_one(i)
        if not explained[i]["near_tie"]:
            break
    return explained


def finding_of(entry: dict, ours: dict, num_prompts: int, dtype: str) -> str | None:
    """Why the engine's count is not ours, in words, or None. In float32 every prompt's counts must equal ours: a
    prompt whose plain output differs is set aside (all of them set aside leaves nothing checked), and a count that
    differs is a finding unless a near-tie reproduces it. Speculative outputs that are not the engine's own plain
    ones are a finding in float32 whatever the counters say. In bfloat16 the decodes part ways by rounding, and the
    check is statistical."""
    findings, spread = [], bf16_spread() if dtype != "float32" else None
    if dtype == "float32" and len(entry["set_aside"]) == num_prompts:
        findings.append(f"the target itself decodes differently in the engine (all {num_prompts} plain greedy "
                        "outputs differ from ours), so no prompt's counts can be compared with ours")
    elif dtype == "float32" and entry["differing_prompts"] and len(entry["near_ties"]) < len(entry["differing_prompts"]):
        near_ties = {t["prompt"] for t in entry["near_ties"]}
        unexplained = [i for i in entry["differing_prompts"] if i not in near_ties]
        flips = "; ".join(f"on prompt {e['prompt']} one draft turned to its runner-up (round {e['round']}, position "
                          f"{e['position']}) reproduces them, at a margin of {e['margin']:.2g}"
                          for e in entry["read_differently"] if "margin" in e)
        findings.append(f"the engine's counters differ from ours in float32 on prompts {unexplained} (engine tau "
                        f"{entry['tau']:.3f}, ours {tau_of(ours):.3f}; per position {entry['accepted_per_pos']} vs "
                        f"{ours['accepted_per_pos']}) beyond a near-tie of the kernels' measured margin (epsilon "
                        f"{entry['epsilon']:.2g}){': ' + flips if flips else ''}: the export is read differently from "
                        "how it was trained")
    elif dtype != "float32" and spread is None:
        findings.append(f"no measured {dtype} bound to judge the engine's tau by (scripts/bf16_spread.py writes it)")
    elif dtype != "float32" and abs(entry["tau_ratio_to_replay"] - 1) > entry["replay_bound"]:
        findings.append(f"engine tau / our chain's along the engine's outputs = {entry['tau_ratio_to_replay']:.3f} "
                        f"({entry['tau']:.3f} against {tau_of(entry['replay']):.3f}): beyond {dtype} rounding (bound "
                        f"{entry['replay_bound']:.1%} at {entry['replay']['drafts']} drafts)")
    if dtype == "float32" and entry["mismatched_prompts"]:  # bfloat16 rounds a k-token verify unlike a 1-token step
        findings.append(f"speculation is not lossless in the engine: {len(entry['mismatched_prompts'])} of "
                        f"{num_prompts} speculative outputs differ from its plain greedy ones (prompts "
                        f"{entry['mismatched_prompts']})")
    if entry["weight_warnings"]:
        findings.append("the engine reported weights it did not load")
    return "; ".join(findings) or None


def serve_request(target: Target, target_dir: Path, prompts: list[list[int]], k: int, dtype: str,
                  max_new_tokens: int, max_num_seqs: int = 1) -> dict:
    """A worker request serving the plain target in `target_dir` on `prompts` (token ids); a head is served by adding
    its `draft` directory and `layout`."""
    return {"target": str(target_dir), "draft": None, "layout": None, "num_speculative_tokens": k, "dtype": dtype,
            "enforce_eager": True, "max_model_len": target.config.max_position_embeddings,
            "max_num_seqs": max_num_seqs, "max_new_tokens": max_new_tokens, "prompts": prompts}


def engine_evaluation(ec: EngineConfig, ev: EvalConfig, target: Target, head, exports: dict[str, Path],
                      target_dir: Path, out_dir: Path) -> dict:
    """Serve each export in `exports` ({name: dir}, the layout read from its config) with the target in
    `target_dir`; compare with `head` (the weights the exports hold) drafting as our chain. Writes
    `<out_dir>/engine.json` and returns it."""
    target = computing_in(target, ec.dtype)
    head = head.to(device=next(target.model.parameters()).device, dtype=target.model.dtype).eval()
    k = ec.num_speculative_tokens
    log.info("our chain of %d on %s (%d prompts, %s)", k, ev.bench, ev.limit, ec.dtype)
    prompts, our_outputs, rounds = our_chain(target, head, ev, k)
    ours = {"drafter": f"chain of {k}", **chain_counters([a for row in rounds for a in row], k)}
    ours |= {"tau": tau_of(ours), "per_prompt": [chain_counters(row, k) for row in rounds]}
    python, work = engine_python(ec.name, ec.python, f"eval.engine.name={ec.name}"), out_dir / "engine"
    request = serve_request(target, target_dir, prompts, k, ec.dtype, ev.max_new_tokens, ec.max_num_seqs)
    log.info("%s: plain greedy decoding of %d prompts (log in %s)", ec.name, len(prompts), work)
    plain = run_worker(ec.name, python, {**request, "top2_logprobs": ec.dtype == "float32"}, work, "plain")
    plain_tokens = sum(len(o) for o in plain["outputs"])
    epsilon = kernel_margin_gap(target, prompts, plain["top2"]) if ec.dtype == "float32" else None

    def explain_prompt(i: int, engine_counters: dict) -> dict:
        return explain(target, head, prompts[i], k, ev.max_new_tokens, {key: engine_counters[key] for key in COUNTED},
                       epsilon, lambda accepted: chain_counters(accepted, k))

    report = {
        "engine": ec.name, "version": plain["version"], "dtype": ec.dtype, "num_speculative_tokens": k,
        "bench": ev.bench, "split": ev.split, "num_prompts": len(prompts), "max_new_tokens": ev.max_new_tokens,
        "max_num_seqs": ec.max_num_seqs, "target_dir": str(target_dir), "ours": ours, "epsilon": epsilon,
        "plain": {"wall_s": plain["wall_s"], "load_s": plain["load_s"], "new_tokens": plain_tokens,
                  "tokens_per_s": plain_tokens / plain["wall_s"] if plain["wall_s"] else 0.0,
                  "outputs_equal_ours": sum(a == b for a, b in zip(plain["outputs"], our_outputs))},
        "layouts": {},
    }
    replays = {}  # the engine's outputs -> our chain along them: layouts that answer alike are replayed once
    for name, directory in exports.items():
        layout = detect_layout(read_config(directory))
        log.info("%s: the %s export %s drafting %d tokens", ec.name, layout, directory, k)
        try:
            served = run_worker(ec.name, python, {**request, "draft": str(directory), "layout": layout}, work, name)
            replayed = None
            if ec.dtype != "float32":
                if (key := json.dumps(served["outputs"])) not in replays:
                    replays[key] = replayed_counters(target, head, prompts, served["outputs"], k, ev.max_new_tokens)
                replayed = replays[key]
            entry = compare(ours, served, plain, our_outputs, ec.dtype, explain_prompt, epsilon, replayed)
        except EngineError as err:  # the other layouts still run; the failure is the finding
            entry = {"failed": True, "finding": f"{ec.name} failed serving this export: {root_cause(str(err))}"}
        report["layouts"][name] = {"layout": layout, "dir": str(directory), **entry}
        if entry["finding"]:
            log.warning("FINDING (%s, %s): %s", ec.name, name, entry["finding"])
    write_json(out_dir / "engine.json", report)
    log.info("%s", engine_summary_line(report))
    return report


def explained_differences(m: dict) -> str:
    """The differences that are not findings: near-ties shown by a replay, prompts set aside, a bfloat16 tau within
    its bound."""
    notes = [f"prompt {t['prompt']} a near-tie (round {t['round']}, position {t['position']}: margin "
             f"{t['margin']:.2g} < epsilon {m['epsilon']:.2g})" for t in m.get("near_ties", [])]
    if m.get("set_aside"):
        notes.append(f"prompts {m['set_aside']} set aside (the target decodes them differently in the engine)")
    if m.get("replay_bound") is not None:
        notes.append(f"{m['tau_ratio_to_replay']:.3f}x our chain along the engine's outputs (bound "
                     f"{m['replay_bound']:.1%}; this size flags a tau {m['detectable_tau_loss']:.0%} lower 19 times in 20)")
    return "; ".join(notes)


def engine_summary_line(report: dict) -> str:
    """One line per layout: engine tau beside ours, their ratio, the lossless count, findings and explained
    differences."""
    ours = report["ours"]
    parts = [f"{layout} FAILED (see engine.json)" if m.get("failed") else
             f"{layout} {m['tau']:.3f} ({m['tau_ratio_to_ours']:.3f}x ours, prompts with our counts "
             f"{m['prompts_equal_ours']}/{report['num_prompts']}, outputs equal plain "
             f"{m['outputs_equal_plain']}/{report['num_prompts']}"
             + "".join(", " + text for text in (m["finding"], explained_differences(m)) if text) + ")"
             for layout, m in report["layouts"].items()]
    return (f"{report['engine']} {report['version']} tau ({report['dtype']}, {report['num_speculative_tokens']} "
            f"speculative tokens): {'; '.join(parts)}; ours (chain) {ours['tau']:.3f}")


def evaluate_in_engine(ev: EvalConfig, export_dtype: str, target_cfg: TargetConfig, target: Target, head,
                       out_dir: Path) -> dict:
    """The evaluate stage's `eval.engine`: export `head` in `export_dtype` in each layout the engine loads (the
    speculators verifier being the local target; a target's own MTP module laid over its checkpoint) and serve
    them."""
    ec = ev.engine
    target_dir = served_dir(target_cfg)
    work = out_dir / "engine"
    if head.config.kind == "native_mtp":
        export = export_mtp(head, work / "native_mtp-export", export_dtype, target_dir)
        exports = {"native_mtp": laid_over(export, target_dir, work / "native_mtp")}
        ours = served_module(head, target.model, exports["native_mtp"])
    elif head.config.kind in ("eagle3", "dflash"):
        write = export_dflash if head.config.kind == "dflash" else export_eagle3
        exports = {layout: write(head, layout, work / layout, export_dtype, str(target_dir))
                   for layout in ec.layouts if layout in ENGINE_LAYOUTS[ec.name]}
        # our chain drafts with the weights read back from the export, exactly what the engine reads: a rounded
        # copy of the in-memory head is not bit for bit what the export holds
        ours = read_head(next(iter(exports.values())))
    else:
        raise EngineError(f"no engine serves the {head.config.kind} head: an MTP head on a target without its own "
                          "MTP layers has no engine layout (set eval.engine.name=null)")
    return engine_evaluation(ec, ev, target, ours, exports, target_dir, out_dir)


def laid_over(export_dir: Path, target_dir: Path, out: Path) -> Path:
    """The target checkpoint with an MTP export laid over it, as a user serves it: links to the target's files,
    the export's own files in their place."""
    ours = {p.name for p in export_dir.iterdir() if p.is_file()}
    with atomic_dir(out) as tmp:
        for path in [*(p for p in target_dir.iterdir() if p.is_file() and p.name not in ours),
                     *(export_dir / name for name in sorted(ours))]:
            (tmp / path.name).symlink_to(path.resolve())
    return out


def served_exports(export_dir: Path, target_dir: Path, out_dir: Path) -> dict[str, Path]:
    """An existing export as {layout: dir}. A speculators export names its verifier, which the engine serves: one
    that is not the local target is served from a copy (the weights linked) whose verifier is."""
    config = read_config(export_dir)
    layout = detect_layout(config)
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    if layout != "speculators" or verifier.get("name_or_path") == str(target_dir):
        return {layout: export_dir}
    served = out_dir / "engine" / "speculators-served"
    with atomic_dir(served) as tmp:
        (tmp / WEIGHTS_FILE).symlink_to((export_dir / WEIGHTS_FILE).resolve())
        config["speculators_config"]["verifier"] = {**verifier, "name_or_path": str(target_dir)}
        write_json(tmp / CONFIG_FILE, config)
    log.info("serving %s with its verifier set to the local target %s (from %s)", export_dir, target_dir, served)
    return {layout: served}


def engine_digest(report: dict) -> dict:
    """What `report.json` and `summary.md` keep of `engine.json`: each layout's tau beside ours."""
    return {"engine": report["engine"], "version": report["version"], "dtype": report["dtype"],
            "num_speculative_tokens": report["num_speculative_tokens"], "num_prompts": report["num_prompts"],
            "ours_chain_tau": report["ours"]["tau"], "ours_accepted_per_pos": report["ours"]["accepted_per_pos"],
            "layouts": {layout: {key: m.get(key) for key in ("tau", "tau_ratio_to_ours", "tau_ratio_to_replay",
                                                             "counters_equal_ours", "prompts_equal_ours",
                                                             "accepted_per_pos", "outputs_equal_plain", "finding")}
                        | {"explained": explained_differences(m)}
                        for layout, m in report["layouts"].items()},
            "line": engine_summary_line(report)}

