"""`hybridmon budget`: KV cache arithmetic against hand-computed values, config.json parsing, the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridmon.agent.commands import budget
from hybridmon.agent.commands.budget import BudgetError
from hybridmon.agent.cli import EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30


# 2 × layers × kv_heads × head_dim × bytes, worked by hand.
@pytest.mark.parametrize(
    "name, expected",
    [
        ("Llama-3-8B", 131_072),  # 2·32·8·128·2
        ("Mistral-7B", 131_072),  # 2·32·8·128·2
        ("Llama-3-70B", 327_680),  # 2·80·8·128·2
        ("Qwen2.5-7B", 57_344),  # 2·28·4·128·2
        ("Qwen2.5-72B", 327_680),  # 2·80·8·128·2
        ("Llama-2-7B", 524_288),  # 2·32·32·128·2
    ],
)
def test_fp16_bytes_per_token_of_presets(name, expected):
    assert budget.compute(budget.preset(name), 1, "fp16").bytes_per_token == expected


@pytest.mark.parametrize("dtype, expected", [("fp32", 262_144), ("bf16", 131_072), ("fp8", 65_536), ("q8", 65_536), ("q4", 32_768)])
def test_element_size_scales_bytes_per_token(dtype, expected):
    assert budget.compute(budget.preset("llama-3-8b"), 1, dtype).bytes_per_token == expected


def test_llama_3_8b_context_of_12000_tokens_is_the_issue_example():
    result = budget.compute(budget.preset("llama-3-8b"), 12_000, "fp16")
    assert result.context_bytes == 1_572_864_000


def test_preset_names_are_case_insensitive():
    assert budget.preset("LLAMA-3-8B") is budget.preset("llama_3_8b")


def test_one_gib_free_holds_8192_tokens_and_offloads_the_rest():
    result = budget.compute(budget.preset("llama-3-8b"), 12_000, "fp16", vram_free_bytes=GiB)
    assert result.tokens_fit == 8_192
    assert result.offloaded_tokens == 3_808
    assert result.offloaded_bytes == 3_808 * 131_072


def test_reload_time_and_ceiling_at_24_gb_per_second():
    result = budget.compute(budget.preset("llama-3-8b"), 12_000, "fp16", vram_free_bytes=GiB,
                            bandwidth_bytes_per_second=24e9, bandwidth_source="--bandwidth")
    assert result.offloaded_reload_seconds == 3808 * 131072 / 24e9
    assert result.context_reload_seconds == 1_572_864_000 / 24e9
    assert result.reload_tokens_per_second == 24e9 / 131072


def test_context_that_fits_offloads_nothing():
    result = budget.compute(budget.preset("llama-3-8b"), 4_000, vram_free_bytes=GiB, bandwidth_bytes_per_second=24e9)
    assert result.offloaded_tokens == 0
    assert result.offloaded_reload_seconds == 0.0


def test_without_bandwidth_or_vram_only_sizes_are_given():
    result = budget.compute(budget.preset("llama-3-8b"), 12_000)
    assert result.context_bytes == 1_572_864_000
    assert result.tokens_fit is None and result.offloaded_reload_seconds is None
    assert result.reload_tokens_per_second is None and result.bandwidth_source is None
    text = budget.render(result)
    assert "run `hybridmon bench` or pass --bandwidth" in text
    assert "1,572,864,000 B" in text


def test_quantized_kv_carries_the_accuracy_caveat():
    assert any("accuracy" in note for note in budget.compute(budget.preset("llama-3-8b"), 10, "q4").notes)
    assert not any("accuracy" in note for note in budget.compute(budget.preset("llama-3-8b"), 10, "fp16").notes)


def test_nothing_measured_means_no_bandwidth(tmp_path):
    assert budget.measured_bandwidth(tmp_path / "no-state") is None


@pytest.mark.parametrize(
    "text, expected",
    [("24GB/s", 24e9), ("24 GB/s", 24e9), ("24e9", 24e9), ("24000000000", 24e9), ("1GiB/s", 2**30), ("52G", 52e9)],
)
def test_parse_bandwidth(text, expected):
    assert budget.parse_bandwidth(text) == expected


@pytest.mark.parametrize("text, expected", [("8GiB", 8 * GiB), ("6e9", 6_000_000_000), ("512MiB", 512 * 2**20), ("1073741824", GiB), ("0", 0)])
def test_parse_bytes(text, expected):
    assert budget.parse_bytes(text) == expected


@pytest.mark.parametrize("text, message", [("fast", "cannot read bandwidth"), ("24Gb/s", "looks like bits"),
                                            ("24XB/s", "unknown unit"), ("0", "must be positive"), ("-5GB/s", "cannot read")])
def test_unparseable_bandwidth_is_a_clear_error(text, message):
    with pytest.raises(BudgetError, match=message):
        budget.parse_bandwidth(text)


def test_unknown_model_lists_the_presets():
    with pytest.raises(BudgetError) as error:
        budget.preset("gpt-5")
    for name in ("Mistral-7B", "Llama-3-8B", "Llama-3-70B", "Qwen2.5-7B", "Qwen2.5-72B", "Llama-2-7B", "DeepSeek-V2-Lite", "DeepSeek-V3"):
        assert name in str(error.value)


@pytest.mark.parametrize("context", [0, -12_000])
def test_context_must_be_positive(context):
    with pytest.raises(BudgetError, match="positive number of tokens"):
        budget.compute(budget.preset("llama-3-8b"), context)


def test_unknown_dtype_is_refused():
    with pytest.raises(BudgetError, match="unknown dtype 'int3'"):
        budget.compute(budget.preset("llama-3-8b"), 10, "int3")


def _write(tmp_path: Path, config) -> Path:
    path = tmp_path / "config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


LLAMA_3_8B_CONFIG = {
    "_name_or_path": "meta-llama/Meta-Llama-3-8B", "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "torch_dtype": "bfloat16",
}


def test_config_json_with_key_value_heads(tmp_path):
    shape = budget.load_config_json(_write(tmp_path, LLAMA_3_8B_CONFIG))
    assert (shape.name, shape.layers, shape.kv_heads, shape.head_dim, shape.dtype) == ("meta-llama/Meta-Llama-3-8B", 32, 8, 128, "bf16")
    assert budget.compute(shape, 12_000).context_bytes == 1_572_864_000


def test_config_json_without_key_value_heads_means_one_per_attention_head(tmp_path):
    config = {k: v for k, v in LLAMA_3_8B_CONFIG.items() if k != "num_key_value_heads"} | {"torch_dtype": "float16"}
    shape = budget.load_config_json(_write(tmp_path, config))
    assert (shape.kv_heads, shape.dtype) == (32, "fp16")
    assert budget.compute(shape, 1).bytes_per_token == 524_288  # Llama-2-7B's shape


def test_config_json_explicit_head_dim_wins_over_hidden_size(tmp_path):
    # Shaped like Gemma-2-9B: head_dim 256 although hidden_size / heads is 224.
    config = {"num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
              "hidden_size": 3584, "head_dim": 256, "torch_dtype": "float32"}
    shape = budget.load_config_json(_write(tmp_path, config))
    assert shape.head_dim == 256
    assert budget.compute(shape, 1).bytes_per_token == 2 * 42 * 8 * 256 * 4


def test_config_json_without_dtype_assumes_fp16_and_says_so(tmp_path):
    config = {k: v for k, v in LLAMA_3_8B_CONFIG.items() if k != "torch_dtype"}
    shape = budget.load_config_json(_write(tmp_path, config))
    assert shape.dtype == "fp16"
    assert any("assumed fp16" in note for note in shape.notes)


def test_config_json_nested_text_config(tmp_path):
    shape = budget.load_config_json(_write(tmp_path, {"model_type": "vlm", "text_config": LLAMA_3_8B_CONFIG}))
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (32, 8, 128)


def test_config_json_sliding_window_is_noted_unless_disabled(tmp_path):
    windowed = budget.load_config_json(_write(tmp_path, LLAMA_3_8B_CONFIG | {"sliding_window": 4096}))
    assert any("4,096-token sliding window" in note for note in windowed.notes)
    disabled = budget.load_config_json(_write(tmp_path, LLAMA_3_8B_CONFIG | {"sliding_window": 4096, "use_sliding_window": False}))
    assert not disabled.notes


def test_config_json_unknown_dtype_needs_dtype_flag(tmp_path):
    shape = budget.load_config_json(_write(tmp_path, LLAMA_3_8B_CONFIG | {"torch_dtype": "int4"}))
    with pytest.raises(BudgetError, match="torch_dtype 'int4'.*pass --dtype"):
        budget.compute(shape, 10)
    assert budget.compute(shape, 10, "fp8").bytes_per_token == 65_536


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"num_attention_heads": 32, "hidden_size": 4096}), "missing num_hidden_layers"),
        (json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32}), "missing hidden_size"),
        (json.dumps({"num_hidden_layers": "32", "num_attention_heads": 32, "hidden_size": 4096}), "num_hidden_layers must be a positive integer"),
        (json.dumps({"num_hidden_layers": 32, "num_attention_heads": 3, "hidden_size": 4096}), "not a multiple"),
    ],
)
def test_malformed_config_json_is_a_clear_error(tmp_path, content, message):
    with pytest.raises(BudgetError, match=message):
        budget.load_config_json(_write(tmp_path, content))


# Multi-head latent attention: layers × (kv_lora_rank + qk_rope_head_dim) × bytes, one latent per layer.
DEEPSEEK_V2_LITE = REPO / "tests" / "fixtures" / "budget" / "DeepSeek-V2-Lite" / "config.json"
DEEPSEEK_V2_LITE_CONFIG = json.loads(DEEPSEEK_V2_LITE.read_text())


def test_deepseek_v2_lite_config_json_is_31104_bytes_per_token():
    shape = budget.load_config_json(DEEPSEEK_V2_LITE)
    assert shape.is_mla and (shape.layers, shape.kv_lora_rank, shape.qk_rope_head_dim, shape.dtype) == (27, 512, 64, "bf16")
    assert budget.compute(shape, 1).bytes_per_token == 31_104  # 27 × (512 + 64) × 2
    assert not shape.notes  # a checked model_type, no window, nothing left out


def test_mla_ignores_the_head_fields_that_would_give_seven_times_the_bytes(tmp_path):
    # The transformers 5 dump of the same model: `dtype` for torch_dtype and head_dim 64 added.
    # 2 × 27 × 16 KV heads × 128 (hidden_size / heads) × 2 = 221,184 B would be the standard formula.
    config = {k: v for k, v in DEEPSEEK_V2_LITE_CONFIG.items() if k != "torch_dtype"} | {"dtype": "bfloat16", "head_dim": 64}
    assert budget.compute(budget.load_config_json(_write(tmp_path, config)), 1).bytes_per_token == 31_104


@pytest.mark.parametrize("name, expected", [("DeepSeek-V2-Lite", 31_104), ("DeepSeek-V2", 69_120), ("DeepSeek-V3", 70_272)])
def test_mla_presets(name, expected):
    assert budget.compute(budget.preset(name), 1).bytes_per_token == expected  # layers × 576 × 2


def test_mla_scales_with_the_kv_cache_dtype():
    assert budget.compute(budget.preset("deepseek-v2-lite"), 1, "fp8").bytes_per_token == 15_552


def test_mla_summary_shows_the_latent_formula_and_json_says_mla():
    result = budget.compute(budget.load_config_json(DEEPSEEK_V2_LITE), 12_000)
    assert "31,104 B (30.38 KiB) = 27 layers x (512 kv_lora_rank + 64 qk_rope_head_dim) x 2 B" in budget.render(result)
    model = result.as_dict()["model"]
    assert (model["attention"], model["kv_lora_rank"], model["qk_rope_head_dim"], model["kv_heads"], model["head_dim"]) == ("mla", 512, 64, 1, 576)
    assert result.context_bytes == 373_248_000
    assert budget.compute(budget.preset("llama-3-8b"), 1).as_dict()["model"]["attention"] == "standard"


def test_mla_under_an_unchecked_model_type_is_sized_with_a_note(tmp_path):
    shape = budget.load_config_json(_write(tmp_path, DEEPSEEK_V2_LITE_CONFIG | {"model_type": "my_mla"}))
    assert budget.compute(shape, 1).bytes_per_token == 31_104
    assert any("'my_mla' is not one this calculator was checked against" in note for note in shape.notes)


def test_deepseek_v32_indexer_and_mtp_layers_are_noted_as_left_out(tmp_path):
    config = DEEPSEEK_V2_LITE_CONFIG | {"model_type": "deepseek_v3", "index_head_dim": 128, "index_topk": 2048, "num_nextn_predict_layers": 1}
    notes = budget.load_config_json(_write(tmp_path, config)).notes
    assert any("indexer key of index_head_dim 128" in note and "lower bound" in note for note in notes)
    assert any("1 multi-token-prediction layer(s), not counted" in note for note in notes)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"qk_rope_head_dim": None}, "missing qk_rope_head_dim"),
        ({"kv_lora_rank": 0}, "kv_lora_rank must be a positive integer"),
        ({"kv_lora_rank": "512"}, "kv_lora_rank must be a positive integer"),
        ({"qk_rope_head_dim": -64}, "qk_rope_head_dim must be a positive integer"),
        ({"kv_lora_rank": None}, "sets qk_rope_head_dim, qk_nope_head_dim, v_head_dim but kv_lora_rank is None"),
    ],
)
def test_inconsistent_mla_fields_are_refused(tmp_path, change, message):
    with pytest.raises(BudgetError, match=message):
        budget.load_config_json(_write(tmp_path, DEEPSEEK_V2_LITE_CONFIG | change))


QWEN3_NEXT_SHAPED = {  # Qwen3-Next: 3 of every 4 layers are linear attention (Gated DeltaNet)
    "model_type": "qwen3_next", "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "hidden_size": 2048, "torch_dtype": "bfloat16",
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
}


def test_hybrid_linear_attention_gives_no_figure(tmp_path):
    with pytest.raises(BudgetError, match="layer_types has 2 full_attention, 6 linear_attention: layers of type "
                                          "linear_attention keep no KV per token"):
        budget.load_config_json(_write(tmp_path, QWEN3_NEXT_SHAPED))


@pytest.mark.parametrize("key, value", [("linear_attn_config", {"kda_layers": [1, 2]}), ("attn_layer_period", 8),
                                        ("hybrid_override_pattern", "M-M*"), ("attn_type_list", [0, 1]),
                                        ("block_types", ["recurrent", "attention"]), ("compress_ratios", [1, 4])])
def test_fields_of_other_cache_shapes_give_no_figure(tmp_path, key, value):
    with pytest.raises(BudgetError, match=f"sets {key}: .*gives no figure rather than a wrong one"):
        budget.load_config_json(_write(tmp_path, LLAMA_3_8B_CONFIG | {key: value}))


def test_per_layer_sliding_windows_are_counted_in_the_note(tmp_path):
    # gpt-oss: alternating 128-token sliding-window and full-attention layers.
    config = LLAMA_3_8B_CONFIG | {"model_type": "gpt_oss", "sliding_window": 128,
                                  "layer_types": ["sliding_attention", "full_attention"] * 16}
    notes = budget.load_config_json(_write(tmp_path, config)).notes
    assert any("16 of 32 layers a 128-token sliding window" in note for note in notes)
    assert any("'gpt_oss' is not one this calculator was checked against" in note for note in notes)
    all_full = LLAMA_3_8B_CONFIG | {"sliding_window": 4096, "layer_types": ["full_attention"] * 32}
    assert not budget.load_config_json(_write(tmp_path, all_full)).notes


def test_missing_config_json_is_a_clear_error(tmp_path):
    with pytest.raises(BudgetError, match="cannot read .*nope.json"):
        budget.load_config_json(tmp_path / "nope.json")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env = {k: v for k, v in env.items() if not k.startswith("HYBRIDMON_")}
    return subprocess.run([sys.executable, "-m", "hybridmon.agent.cli", "budget", *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.slow
def test_cli_text_summary():
    result = _cli("--model", "llama-3-8b", "--context", "12000", "--dtype", "fp16", "--bandwidth", "24GB/s", "--vram-free", "1GiB")
    assert result.returncode == 0, result.stderr
    for expected in ("131,072 B", "1,572,864,000 B", "holds 8,192 tokens", "3,808 tokens", "20.80 ms", "183,105 tokens of KV per second"):
        assert expected in result.stdout


@pytest.mark.slow
def test_cli_json():
    result = _cli("--model", "llama-3-8b", "--context", "12000", "--bandwidth", "24e9", "--vram-free", "1073741824", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["bytes_per_token"] == 131_072
    assert data["context_bytes"] == 1_572_864_000
    assert data["tokens_fit"] == 8_192
    assert data["offloaded_tokens"] == 3_808
    assert data["offloaded_reload_seconds"] == 3808 * 131072 / 24e9
    assert data["reload_tokens_per_second"] == 24e9 / 131072
    assert data["bandwidth_source"] == "--bandwidth"


@pytest.mark.slow
def test_cli_without_bandwidth_still_prints_sizes():
    result = _cli("--model", "qwen2.5-7b", "--context", "12000", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["bytes_per_token"] == 57_344 and data["reload_tokens_per_second"] is None
    text = _cli("--model", "qwen2.5-7b", "--context", "12000")
    assert "run `hybridmon bench` or pass --bandwidth" in text.stdout


@pytest.mark.slow
def test_cli_config_json(tmp_path):
    result = _cli("--config-json", str(_write(tmp_path, LLAMA_3_8B_CONFIG)), "--context", "12000", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["context_bytes"] == 1_572_864_000


@pytest.mark.slow
def test_cli_deepseek_v2_lite_config_json():
    result = _cli("--config-json", str(DEEPSEEK_V2_LITE), "--context", "12000")
    assert result.returncode == 0, result.stderr
    assert "31,104 B" in result.stdout and "MLA: one latent per layer" in result.stdout


@pytest.mark.slow
def test_cli_hybrid_config_json_is_refused_with_the_reason(tmp_path):
    result = _cli("--config-json", str(_write(tmp_path, QWEN3_NEXT_SHAPED)), "--context", "12000")
    assert result.returncode == EXIT_USAGE and result.stdout == ""
    assert "gives no figure rather than a wrong one" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (("--model", "gpt-5", "--context", "10"), "presets: Mistral-7B"),
        (("--model", "llama-3-8b", "--config-json", "x.json", "--context", "10"), "not allowed with"),
        (("--context", "10"), "one of the arguments --model --config-json is required"),
        (("--model", "llama-3-8b", "--context", "-1"), "positive number of tokens"),
        (("--model", "llama-3-8b", "--context", "10", "--bandwidth", "quick"), "cannot read bandwidth"),
        (("--model", "llama-3-8b", "--context", "10", "--vram-free", "lots"), "cannot read free VRAM"),
        (("--model", "llama-3-8b", "--context", "10", "--dtype", "int3"), "unknown dtype"),
        (("--config-json", "/nonexistent/config.json", "--context", "10"), "cannot read /nonexistent/config.json"),
    ],
)
def test_cli_bad_input_exits_with_the_usage_code_and_a_message(args, message):
    result = _cli(*args)
    assert result.returncode == EXIT_USAGE
    assert message in result.stderr
    assert result.stdout == ""
