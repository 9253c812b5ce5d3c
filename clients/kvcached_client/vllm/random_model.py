"""A random-weight Llama and an offline tokenizer, to try the connector without downloads.

::

    python -m kvcached_client.vllm.random_model /tmp/tiny-llama            # 2 layers, seconds
    python -m kvcached_client.vllm.random_model /tmp/llama --layers 12 --hidden 1024

The tokenizer is a word-level one over ``w3 .. w{vocab-1}`` (plus ``<unk> <s> </s>``), so
any text made of those words tokenizes to known ids. The weights are random: the model's
output is noise, but deterministic, which is all reuse tests need (identical greedy tokens
with and without the cache).
"""

from __future__ import annotations

import argparse
import os


def build(path: str, *, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2, vocab: int = 1024,
          max_positions: int = 4096, seed: int = 0, intermediate: int | None = None) -> str:
    """Write a LlamaForCausalLM (float32) and its tokenizer to ``path``; returns ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    LlamaForCausalLM(cfg).save_pretrained(path)
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
    a = p.parse_args()
    print(build(a.path, layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, vocab=a.vocab,
                max_positions=a.max_positions))


if __name__ == "__main__":
    main()
