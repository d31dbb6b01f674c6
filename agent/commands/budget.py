"""`hybridmon budget`: what a model's KV cache costs, and what offloading part of it costs.

This answers the planning question of the seed handbook (chapter 4): how many bytes of KV cache one
token costs, how much of a context fits in the VRAM left for it, and how long moving the rest back
across PCIe takes at a given host-to-device bandwidth.

KV bytes per token = 2 (K and V) × layers × KV heads × head_dim × bytes per element for standard
(multi-head, grouped-query) attention, and layers × (kv_lora_rank + qk_rope_head_dim) × bytes per
element for multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2), which caches one compressed
latent per layer, shared by every head, instead of K and V. Everything here is exact integer
arithmetic on bytes except the divisions by a bandwidth (bytes per second). The model shape comes
from a preset or from a Hugging Face `config.json`; a config.json whose attention this arithmetic
does not describe (hybrid linear attention, state-space layers, compressed KV) is refused with the
reason rather than sized wrongly.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridmon.exporters.jsonsafe import loads_bounded


class BudgetError(ValueError):
    """Bad input to the budget (unknown model, unreadable config.json, unparseable size)."""


class StoredResultError(BudgetError):
    """A stored `hybridmon bench` result exists but cannot be read: bad data, not a bad flag."""


MAX_CONFIG_JSON_BYTES = 16 * 1024 * 1024
"""A Hugging Face config.json is a few KB; multimodal ones with vocabularies inside stay well under this."""

# Element size of the KV cache in bits, so that 4-bit quantization stays integer arithmetic.
DTYPE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "q8": 8, "q4": 4}
QUANTIZED_DTYPES = {"q8", "q4"}
QUANTIZED_CAVEAT = (
    "quantized KV cache ({dtype}) trades accuracy for size (quality loss grows as bits shrink, most at "
    "4 bits); sizes are nominal and leave out the per-block scales (llama.cpp's q8_0 is 8.5 and q4_0 "
    "4.5 bits per element)"
)
# Hugging Face `torch_dtype` (newer transformers write `dtype`) to the names above: servers default
# the KV cache to the weights' dtype (vLLM's kv_cache_dtype="auto").
TORCH_DTYPES = {
    "float32": "fp32", "float": "fp32",
    "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}


@dataclass(frozen=True)
class ModelShape:
    """The attention shape that sets a model's KV cache size.

    For MLA, kv_lora_rank and qk_rope_head_dim are set, and kv_heads and head_dim are what vLLM's
    MLAAttentionSpec uses (vllm/v1/kv_cache_interface.py; num_kv_heads=1 and head_size =
    kv_lora_rank + qk_rope_head_dim from ModelConfig.get_head_size in vllm/config/model.py): one
    cached vector per layer, its page size without the factor 2 of K and V.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # the model's own dtype, a key of DTYPE_BITS; the default KV cache dtype
    source: str = ""
    notes: tuple[str, ...] = field(default=())
    kv_lora_rank: int = 0  # MLA: width of the compressed KV latent; 0 for standard attention
    qk_rope_head_dim: int = 0  # MLA: the decoupled RoPE key cached beside the latent

    @classmethod
    def mla(cls, name: str, layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: str,
            source: str = "", notes: tuple[str, ...] = ()) -> "ModelShape":
        return cls(name, layers, 1, kv_lora_rank + qk_rope_head_dim, dtype, source, notes,
                   kv_lora_rank, qk_rope_head_dim)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def kv_bytes_per_token(self, dtype: str | None = None) -> int:
        """Bytes of KV cache one token occupies across all layers."""
        bits = DTYPE_BITS[dtype or self.dtype]
        vectors_per_head = 1 if self.is_mla else 2  # MLA's latent stands for K and V together
        return vectors_per_head * self.layers * self.kv_heads * self.head_dim * bits // 8


_MISTRAL_WINDOW_NOTE = (
    "Mistral-7B-v0.1 declares a 4,096-token sliding window: a server that honours it keeps at most "
    "4,096 tokens of KV per sequence, so figures past that are an upper bound (v0.2 and later have none)"
)

# Values checked against each model's published config.json on huggingface.co (num_hidden_layers,
# num_key_value_heads; head_dim = hidden_size / num_attention_heads, none of them sets head_dim).
PRESETS: dict[str, ModelShape] = {
    shape.name.lower(): shape
    for shape in (
        # mistralai/Mistral-7B-v0.1: 32 layers, 32 heads, 8 KV heads, hidden 4096, bfloat16, sliding_window 4096
        ModelShape("Mistral-7B", 32, 8, 128, "bf16", "mistralai/Mistral-7B-v0.1/config.json", (_MISTRAL_WINDOW_NOTE,)),
        # meta-llama/Meta-Llama-3-8B: 32 layers, 32 heads, 8 KV heads, hidden 4096, bfloat16
        ModelShape("Llama-3-8B", 32, 8, 128, "bf16", "meta-llama/Meta-Llama-3-8B/config.json"),
        # meta-llama/Meta-Llama-3-70B: 80 layers, 64 heads, 8 KV heads, hidden 8192, bfloat16
        ModelShape("Llama-3-70B", 80, 8, 128, "bf16", "meta-llama/Meta-Llama-3-70B/config.json"),
        # Qwen/Qwen2.5-7B: 28 layers, 28 heads, 4 KV heads, hidden 3584, bfloat16 (use_sliding_window false)
        ModelShape("Qwen2.5-7B", 28, 4, 128, "bf16", "Qwen/Qwen2.5-7B/config.json"),
        # Qwen/Qwen2.5-72B: 80 layers, 64 heads, 8 KV heads, hidden 8192, bfloat16
        ModelShape("Qwen2.5-72B", 80, 8, 128, "bf16", "Qwen/Qwen2.5-72B/config.json"),
        # meta-llama/Llama-2-7b-hf: 32 layers, 32 heads, 32 KV heads (no GQA), hidden 4096, float16
        ModelShape("Llama-2-7B", 32, 32, 128, "fp16", "meta-llama/Llama-2-7b-hf/config.json"),
        # MLA. deepseek-ai/DeepSeek-V2-Lite: num_hidden_layers 27, kv_lora_rank 512, qk_rope_head_dim 64,
        # torch_dtype bfloat16 (its model card: "27 layers ... KV compression dimension is 512 ... per-head
        # dimension of 64" for the decoupled key; kv_a_proj_with_mqa is 2048 -> 576 = 512 + 64).
        ModelShape.mla("DeepSeek-V2-Lite", 27, 512, 64, "bf16", "deepseek-ai/DeepSeek-V2-Lite/config.json"),
        # deepseek-ai/DeepSeek-V2: num_hidden_layers 60, kv_lora_rank 512, qk_rope_head_dim 64, bfloat16
        ModelShape.mla("DeepSeek-V2", 60, 512, 64, "bf16", "deepseek-ai/DeepSeek-V2/config.json"),
        # deepseek-ai/DeepSeek-V3: num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64, torch_dtype
        # bfloat16 (the weights ship in fp8; vLLM's kv_cache_dtype "auto" follows the model dtype, bf16).
        # Its one multi-token-prediction layer (num_nextn_predict_layers 1) is left out: it holds KV only
        # when a server runs it for speculative decoding.
        ModelShape.mla("DeepSeek-V3", 61, 512, 64, "bf16", "deepseek-ai/DeepSeek-V3/config.json"),
    )
}


def preset(name: str) -> ModelShape:
    """The preset called `name` (case-insensitive, '_' for '-'); the error lists the presets."""
    shape = PRESETS.get(name.strip().lower().replace("_", "-"))
    if shape is None:
        raise BudgetError(f"unknown model {name!r}; presets: {', '.join(s.name for s in PRESETS.values())} "
                          "(or pass --config-json PATH)")
    return shape


# model_type values whose config.json fields this arithmetic was checked against (the fields each
# architecture's transformers configuration defines and vLLM sizes its KV cache from). Another
# model_type is still sized, under a note saying that nobody checked it.
STANDARD_ATTENTION_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "phi3",
})
# vLLM's ModelConfig.is_deepseek_mla names these (with kv_lora_rank set) as MLA models.
MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2"})
MLA_ONLY_FIELDS = ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")

# layer_types entries (transformers >= 4.53 writes one per layer) that hold KV for every token.
PER_TOKEN_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# Fields that declare layers without a per-token KV cache, or a KV cache of another shape: the
# formula above would size them wrongly, so such a config is refused with the field named.
UNSIZED_ATTENTION_FIELDS = {
    "linear_attn_config": "Kimi-Linear's linear-attention layers keep a fixed-size state, not KV per token",
    "attn_layer_period": "Jamba-style hybrids interleave Mamba layers (a fixed-size state) with attention",
    "hybrid_override_pattern": "Nemotron-H-style hybrids interleave Mamba layers (a fixed-size state) with attention",
    "attn_type_list": "MiniMax-style hybrids interleave linear-attention layers (a fixed-size state) with attention",
    "block_types": "RecurrentGemma-style models interleave recurrent blocks (a fixed-size state) with local attention",
    "compress_ratios": "DeepSeek-V4-style compressed KV stores a layer-dependent fraction of the tokens",
}


def load_config_json(path: str | Path) -> ModelShape:
    """The shape of the model a Hugging Face `config.json` describes.

    Standard attention: num_hidden_layers, num_attention_heads, num_key_value_heads (default:
    num_attention_heads, i.e. no grouped-query attention), head_dim (default: hidden_size /
    num_attention_heads). MLA, when kv_lora_rank is set: num_hidden_layers, kv_lora_rank and
    qk_rope_head_dim (the head counts and head_dim do not change its cache). Both: torch_dtype (or
    `dtype`; default fp16). Multimodal configs that nest the language model under `text_config`
    are read from there. Layers that keep a fixed-size state instead of KV per token (hybrid
    linear attention, Mamba) or compressed KV are refused: a wrong figure would pass for a right one.
    """
    path = Path(path)
    config = _read_config_json(path)
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}
    _refuse_unsized_attention(config, path)

    layers = _positive_int(config, "num_hidden_layers", path)
    notes: list[str] = []
    torch_dtype = config.get("torch_dtype", config.get("dtype"))
    if torch_dtype is None:
        dtype = "fp16"
        notes.append("config.json names no torch_dtype; assumed fp16 (pass --dtype to choose)")
    else:
        dtype = TORCH_DTYPES.get(str(torch_dtype).removeprefix("torch."), "")
        if not dtype:
            # Left for `compute` to reject unless --dtype overrides it.
            dtype = f"unknown:{torch_dtype}"
    notes += _window_notes(config, layers)
    model_type = config.get("model_type")
    name = str(config.get("_name_or_path") or path.parent.name or path.name)

    if config.get("kv_lora_rank") is not None:
        kv_lora_rank = _positive_int(config, "kv_lora_rank", path)
        rope = _positive_int(config, "qk_rope_head_dim", path, why=" (MLA caches it beside the kv_lora_rank latent)")
        if model_type not in MLA_MODEL_TYPES:
            notes.append(f"model_type {model_type!r} is not one this calculator was checked against; sized as "
                         "DeepSeek-style MLA because config.json sets kv_lora_rank")
        if config.get("index_head_dim") is not None:
            notes.append(f"DeepSeek sparse attention: each layer also caches an indexer key of index_head_dim "
                         f"{config['index_head_dim']!r} per token, not counted here, so figures are a lower bound")
        if isinstance(config.get("num_nextn_predict_layers"), int) and config["num_nextn_predict_layers"] > 0:
            notes.append(f"config.json declares {config['num_nextn_predict_layers']} multi-token-prediction "
                         "layer(s), not counted: a server that runs them for speculative decoding caches KV for them too")
        return ModelShape.mla(name, layers, kv_lora_rank, rope, dtype, str(path), tuple(notes))

    stray = [key for key in MLA_ONLY_FIELDS if config.get(key) is not None]
    if stray:
        # DeepSeek's fields without the latent: K (qk_nope + qk_rope) and V (v_head_dim) differ in
        # width, which the K-and-V formula cannot express.
        raise BudgetError(f"{path}: sets {', '.join(stray)} but kv_lora_rank is {config.get('kv_lora_rank')!r}: MLA "
                          "needs kv_lora_rank, and without it K and V differ in width; not sized rather than "
                          "sized wrongly")
    heads = _positive_int(config, "num_attention_heads", path)
    kv_heads = _positive_int(config, "num_key_value_heads", path) if config.get("num_key_value_heads") is not None else heads
    if config.get("head_dim") is not None:
        head_dim = _positive_int(config, "head_dim", path)
    else:
        hidden = _positive_int(config, "hidden_size", path, why=" (needed when head_dim is absent)")
        if hidden % heads:
            raise BudgetError(f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}; "
                              "the file needs an explicit head_dim")
        head_dim = hidden // heads
    if model_type not in STANDARD_ATTENTION_MODEL_TYPES:
        notes.append(f"model_type {model_type!r} is not one this calculator was checked against; sized as "
                     "standard attention (2 x layers x KV heads x head_dim): compare with the KV cache size "
                     "your server reports")
    return ModelShape(name, layers, kv_heads, head_dim, dtype, str(path), tuple(notes))


def _read_config_json(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise BudgetError(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise BudgetError(f"{path} is not UTF-8 text; expected a Hugging Face config.json") from None
    try:
        config = loads_bounded(text, MAX_CONFIG_JSON_BYTES)
    except json.JSONDecodeError as error:
        raise BudgetError(f"{path} is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})") from None
    except ValueError as error:  # too large or too deeply nested
        raise BudgetError(f"{path}: {error}; expected a Hugging Face config.json") from None
    if not isinstance(config, dict):
        raise BudgetError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


def _refuse_unsized_attention(config: dict, path: Path) -> None:
    for key, why in UNSIZED_ATTENTION_FIELDS.items():
        if config.get(key) is not None:
            raise BudgetError(f"{path}: sets {key}: {why}; `budget` sizes standard and MLA attention only, so it "
                              "gives no figure rather than a wrong one")
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        other = sorted({str(kind) for kind in layer_types} - PER_TOKEN_LAYER_TYPES)
        if other:
            counts = ", ".join(f"{layer_types.count(kind)} {kind}" for kind in sorted(set(map(str, layer_types))))
            raise BudgetError(f"{path}: layer_types has {counts}: layers of type {', '.join(other)} keep no KV per "
                              "token (a fixed-size state, or a kind this calculator does not know); `budget` sizes "
                              "standard and MLA attention only, so it gives no figure rather than a wrong one")


def _window_notes(config: dict, layers: int) -> list[str]:
    """Sliding-window attention keeps at most `window` tokens of KV: the figures are an upper bound."""
    window = config.get("sliding_window")
    if not (isinstance(window, int) and window > 0) or config.get("use_sliding_window", True) is False:
        return []
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        windowed = layer_types.count("sliding_attention")
        if not windowed:
            return []
        return [f"config.json gives {windowed} of {layers} layers a {window:,}-token sliding window: a server that "
                f"honours it keeps at most {window:,} tokens of KV per sequence in those, so figures past that "
                "are an upper bound"]
    return [f"config.json declares a {window:,}-token sliding window: a server that honours it keeps "
            f"at most {window:,} tokens of KV per sequence, so figures past that are an upper bound"]


def _positive_int(config: dict, key: str, path: Path, why: str = "") -> int:
    if key not in config or config[key] is None:
        raise BudgetError(f"{path}: missing {key}{why}")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BudgetError(f"{path}: {key} must be a positive integer, found {value!r}")
    return value


_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str, what: str = "size") -> int:
    """Bytes from '8GiB', '6GB', '512MiB', '6e9' or '1073741824' (GB decimal, GiB binary)."""
    return round(_parse_quantity(text, what, per_second=False))


def parse_bandwidth(text: str) -> float:
    """Bytes per second from '24GB/s', '24 GB/s', '22.4GiB/s', '24e9' (GB decimal, GiB binary)."""
    value = _parse_quantity(text, "bandwidth", per_second=True)
    if value == 0:
        raise BudgetError("bandwidth must be positive")
    return value


def _parse_quantity(text: str, what: str, per_second: bool) -> float:
    original = text
    text = str(text).strip()
    if per_second:
        text = re.sub(r"\s*/\s*s(ec)?$", "", text, flags=re.IGNORECASE)
    match = _QUANTITY.match(text)
    if not match:
        example = "'24GB/s' or '24e9'" if per_second else "'8GiB', '6GB' or '6e9'"
        raise BudgetError(f"cannot read {what} {original!r}; write e.g. {example}")
    number, unit = float(match.group(1)), match.group(2)
    if unit.endswith("b"):
        raise BudgetError(f"{what} {original!r} looks like bits (lowercase b); write bytes, e.g. "
                          f"{'24GB/s' if per_second else '8GiB'}")
    prefix = unit[:-1] if unit.endswith("B") else unit
    scale = _BINARY.get(prefix.lower()) or _DECIMAL.get(prefix.lower())
    if scale is None:
        raise BudgetError(f"unknown unit {unit!r} in {what} {original!r}; use B, kB, MB, GB, TB or KiB, MiB, GiB, TiB")
    value = number * scale
    if not math.isfinite(value):
        raise BudgetError(f"{what} {original!r} is not a finite number")
    return value


def measured_bandwidth(state_dir: str | os.PathLike[str]) -> tuple[float, str] | None:
    """(bytes/s, where it comes from) for reloading KV: the pinned host-to-device capacity of this
    host's latest `hybridmon bench` runs, the slowest GPU's when there are several (a context may
    land on any of them). None when nothing was measured. A stored result that cannot be read is
    a BudgetError naming its file: the slowest GPU may be the one whose result is corrupt, and
    "nothing measured" would send the operator to re-measure a host that was measured."""
    from hybridmon.exporters.bench_runs import load_latest, measured_capacity  # keeps `budget` light

    runs, problems = load_latest(state_dir)
    if problems:
        raise StoredResultError(
            "stored benchmark result corrupt or unreadable: " + "; ".join(problems)
            + ". Remove it and run `hybridmon bench` again, or pass --bandwidth (e.g. 24GB/s)")
    slowest = None
    for run in runs:
        if run.contended:
            continue
        measured = measured_capacity(run).get("host_to_device")
        if measured is not None and (slowest is None or measured[0] < slowest[0]):
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(run.finished_at))
            slowest = (measured[0], f"measured on GPU {run.gpu_index} ({run.pci_bus_id}), {when}")
    return slowest


@dataclass(frozen=True)
class Budget:
    """What a context costs. Bytes, tokens and seconds; None where an input was not given."""

    model: ModelShape
    dtype: str
    bytes_per_token: int
    context_tokens: int
    context_bytes: int
    vram_free_bytes: int | None
    tokens_fit: int | None
    offloaded_tokens: int | None
    offloaded_bytes: int | None
    bandwidth_bytes_per_second: float | None
    bandwidth_source: str | None  # "--bandwidth", or which `hybridmon bench` run measured it
    offloaded_reload_seconds: float | None
    context_reload_seconds: float | None
    reload_tokens_per_second: float | None  # ceiling: bandwidth / bytes per token
    notes: tuple[str, ...]

    def as_dict(self) -> dict:
        return {
            "model": {
                "name": self.model.name, "layers": self.model.layers, "kv_heads": self.model.kv_heads,
                "head_dim": self.model.head_dim, "source": self.model.source,
                "attention": "mla" if self.model.is_mla else "standard",
                "kv_lora_rank": self.model.kv_lora_rank or None,
                "qk_rope_head_dim": self.model.qk_rope_head_dim or None,
            },
            "dtype": self.dtype,
            "bytes_per_element": DTYPE_BITS[self.dtype] / 8,
            "bytes_per_token": self.bytes_per_token,
            "context_tokens": self.context_tokens,
            "context_bytes": self.context_bytes,
            "vram_free_bytes": self.vram_free_bytes,
            "tokens_fit": self.tokens_fit,
            "offloaded_tokens": self.offloaded_tokens,
            "offloaded_bytes": self.offloaded_bytes,
            "bandwidth_bytes_per_second": self.bandwidth_bytes_per_second,
            "bandwidth_source": self.bandwidth_source,
            "offloaded_reload_seconds": self.offloaded_reload_seconds,
            "context_reload_seconds": self.context_reload_seconds,
            "reload_tokens_per_second": self.reload_tokens_per_second,
            "notes": list(self.notes),
        }


def compute(
    model: ModelShape,
    context_tokens: int,
    dtype: str | None = None,
    vram_free_bytes: int | None = None,
    bandwidth_bytes_per_second: float | None = None,
    bandwidth_source: str | None = None,
) -> Budget:
    """The budget of `context_tokens` tokens of `model`'s KV cache in `dtype` (default: the model's)."""
    if dtype is not None and dtype not in DTYPE_BITS:
        raise BudgetError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BITS)}")
    dtype = dtype or model.dtype
    if dtype not in DTYPE_BITS:
        raise BudgetError(f"{model.source or model.name}: torch_dtype {dtype.removeprefix('unknown:')!r} is not "
                          f"one this tool knows; pass --dtype ({', '.join(DTYPE_BITS)})")
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens <= 0:
        raise BudgetError(f"context must be a positive number of tokens, got {context_tokens!r}")
    if vram_free_bytes is not None and vram_free_bytes < 0:
        raise BudgetError(f"free VRAM cannot be negative, got {vram_free_bytes}")
    if bandwidth_bytes_per_second is not None and not (bandwidth_bytes_per_second > 0 and math.isfinite(bandwidth_bytes_per_second)):
        raise BudgetError(f"bandwidth must be a positive number of bytes per second, got {bandwidth_bytes_per_second!r}")

    per_token = model.kv_bytes_per_token(dtype)
    context_bytes = per_token * context_tokens
    tokens_fit = offloaded_tokens = offloaded_bytes = None
    if vram_free_bytes is not None:
        tokens_fit = vram_free_bytes // per_token
        offloaded_tokens = max(0, context_tokens - tokens_fit)
        offloaded_bytes = offloaded_tokens * per_token
    offloaded_reload = context_reload = ceiling = None
    if bandwidth_bytes_per_second is not None:
        context_reload = context_bytes / bandwidth_bytes_per_second
        ceiling = bandwidth_bytes_per_second / per_token
        if offloaded_bytes is not None:
            offloaded_reload = offloaded_bytes / bandwidth_bytes_per_second
    notes = list(model.notes)
    if dtype in QUANTIZED_DTYPES:
        notes.append(QUANTIZED_CAVEAT.format(dtype=dtype))
    return Budget(
        model=model, dtype=dtype, bytes_per_token=per_token, context_tokens=context_tokens,
        context_bytes=context_bytes, vram_free_bytes=vram_free_bytes, tokens_fit=tokens_fit,
        offloaded_tokens=offloaded_tokens, offloaded_bytes=offloaded_bytes,
        bandwidth_bytes_per_second=bandwidth_bytes_per_second,
        bandwidth_source=bandwidth_source if bandwidth_bytes_per_second is not None else None,
        offloaded_reload_seconds=offloaded_reload, context_reload_seconds=context_reload,
        reload_tokens_per_second=ceiling, notes=tuple(notes),
    )


NO_BANDWIDTH = "reload figures need a bandwidth: run `hybridmon bench` or pass --bandwidth (e.g. 24GB/s)"
NO_VRAM = "pass --vram-free (e.g. 6GiB) to see how much of the context fits and what is offloaded"


def render(budget: Budget) -> str:
    """The readable summary `hybridmon budget` prints."""
    m = budget.model
    element = DTYPE_BITS[budget.dtype] / 8
    if m.is_mla:
        formula = (f"{m.layers} layers x ({m.kv_lora_rank} kv_lora_rank + {m.qk_rope_head_dim} qk_rope_head_dim) "
                   f"x {element:g} B (MLA: one latent per layer, shared by every head, instead of K and V)")
    else:
        formula = f"2 (K,V) x {m.layers} layers x {m.kv_heads} KV heads x {m.head_dim} head_dim x {element:g} B"
    lines = [
        f"KV cache budget for {m.name} ({budget.dtype}, {element:g} bytes per element)",
        f"  per token        {budget.bytes_per_token:,} B ({_binary(budget.bytes_per_token)}) = {formula}",
        f"  context          {budget.context_tokens:,} tokens = {budget.context_bytes:,} B ({_binary(budget.context_bytes)})",
    ]
    if budget.vram_free_bytes is None:
        lines.append(f"  free VRAM        not given: {NO_VRAM}")
    else:
        lines.append(f"  free VRAM        {budget.vram_free_bytes:,} B ({_binary(budget.vram_free_bytes)}) "
                     f"holds {budget.tokens_fit:,} tokens")
        if budget.offloaded_tokens:
            lines.append(f"  offloaded        {budget.offloaded_tokens:,} tokens = {budget.offloaded_bytes:,} B "
                         f"({_binary(budget.offloaded_bytes)}) beyond what fits")
        else:
            lines.append("  offloaded        nothing: the whole context fits")
    if budget.bandwidth_bytes_per_second is None:
        lines.append(f"  bandwidth        not known: {NO_BANDWIDTH}")
    else:
        lines.append(f"  bandwidth        {budget.bandwidth_bytes_per_second / 1e9:,.2f} GB/s ({budget.bandwidth_source})")
        if budget.offloaded_reload_seconds is not None:
            lines.append(f"  reload offloaded {_duration(budget.offloaded_reload_seconds)}")
        lines.append(f"  reload context   {_duration(budget.context_reload_seconds)} (all {budget.context_tokens:,} tokens)")
        lines.append(f"  reload ceiling   {budget.reload_tokens_per_second:,.0f} tokens of KV per second "
                     "(bandwidth / bytes per token)")
    lines += [f"  note: {note}" for note in budget.notes]
    return "\n".join(lines)


def _binary(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:,.2f} s"
    return f"{seconds * 1e3:.2f} ms"
