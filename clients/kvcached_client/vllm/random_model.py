"""A random-weight model and an offline tokenizer, to try the connector without downloads.

::

    python -m kvcached_client.vllm.random_model /tmp/tiny-llama            # 2 layers, seconds
    python -m kvcached_client.vllm.random_model /tmp/llama --layers 12 --hidden 1024
    python -m kvcached_client.vllm.random_model /tmp/tiny-gemma3 --family gemma3 --window 64

Families: ``llama`` (full attention), ``mistral`` (every layer windowed, ``--window``),
``gemma3`` (windowed and global layers interleaved, ``--window``), ``deepseek_v2`` (MLA, with
the latent width vLLM's CPU MLA kernel supports: kv_lora_rank 512 + rope 64).

The tokenizer is a word-level one over ``w3 .. w{vocab-1}`` (plus ``<unk> <s> </s>``), so
any text made of those words tokenizes to known ids. The weights are random: the model's
output is noise, but deterministic, which is all reuse tests need (identical greedy tokens
with and without the cache).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel


FAMILIES = ("llama", "mistral", "gemma3", "deepseek_v2")


def build(path: str, *, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2, vocab: int = 1024,
          max_positions: int = 4096, seed: int = 0, intermediate: int | None = None, family: str = "llama",
          window: int = 64) -> str:
    """Write a random float32 model of ``family`` and its tokenizer to ``path``; returns ``path``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(path)
    torch.manual_seed(seed)
    # The configs' keyword arguments, each of its own type: the config classes check them.
    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions, bos_token_id=1,
        eos_token_id=2, torch_dtype="float32")
    model: PreTrainedModel
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=window, **common))
    elif family == "gemma3":  # windowed layers first, then global, alternating (Gemma-3 has 5:1)
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            head_dim=hidden // heads, sliding_window=window, layer_types=kinds, **common))
    elif family == "deepseek_v2":
        common["num_key_value_heads"] = heads
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
            moe_intermediate_size=hidden, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=layers, **common))
    else:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
    model.save_pretrained(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--max-positions", type=int, default=4096)
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--window", type=int, default=64, help="sliding window (mistral, gemma3)")
    a = p.parse_args()
    print(build(a.path, layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, vocab=a.vocab,
                max_positions=a.max_positions, family=a.family, window=a.window))


if __name__ == "__main__":
    main()
