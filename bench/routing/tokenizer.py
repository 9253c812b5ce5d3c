"""An offline word-level tokenizer for the routing bench: one token per word, no download.

The simulated hosts (simhost.py), the router and the workload must agree on token ids exactly,
and nothing here may fetch a model. So this module builds, with the ``tokenizers`` library, a
Hugging Face tokenizer directory that ``transformers.AutoTokenizer.from_pretrained(out_dir)``
loads as a ``PreTrainedTokenizerFast``:

- vocabulary: the special tokens below (ids 0..len(SPECIALS)-1), then the words
  ``w0`` .. ``w{V-1}`` (word ``w{i}`` has id ``WORD_ID_OFFSET + i``);
- whitespace split, one token per word (any other word is ``<unk>``);
- no BOS/EOS added and no post-processor, so ``tok(text)`` and
  ``tok(text, add_special_tokens=False)`` give the same ids (a router and a host that differ in
  that flag still agree);
- a Jinja ``chat_template`` that renders each message as ``<|role|> content`` followed by a
  newline, and ``<|assistant|>`` for the generation prompt. The role markers are special tokens
  (one id each); the newline is whitespace and produces no token. So the ids of a rendered chat
  are ``[<|system|>] + system words + [<|user|>] + user words + [<|assistant|>]``.

::

    python bench/routing/tokenizer.py /tmp/routing-tok      # prints the directory
"""

from __future__ import annotations

import json
import os
import sys

#: Special tokens, in id order. The role markers come first after the usual four so that their ids
#: are stable whatever the vocabulary size.
SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
WORD_ID_OFFSET = len(SPECIALS)
DEFAULT_VOCAB = 32000

#: ``<|role|> content`` per message, one per line; then ``<|assistant|>`` when a reply is wanted.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|> {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

#: Written next to the tokenizer files; a directory built with other parameters is rebuilt.
MARKER = "kvcached_routing_tokenizer.json"


def word(i: int) -> str:
    return f"w{i}"


def word_id(i: int) -> int:
    """The token id of word ``w{i}``."""
    return WORD_ID_OFFSET + i


def _spec(vocab_size: int) -> dict:
    return {"kind": "word-level", "vocab_size": vocab_size, "specials": SPECIALS, "chat_template": CHAT_TEMPLATE}


def build_tokenizer(out_dir: str, vocab_size: int = DEFAULT_VOCAB) -> str:
    """Build (or reuse) the tokenizer directory ``out_dir``; returns its absolute path.

    Idempotent: a directory already built with the same parameters is reused untouched; one
    built with others (or half-written) is rebuilt. Works offline (no hub access at all).
    """
    if vocab_size < 1:
        raise ValueError("vocab_size must be positive")
    out_dir = os.path.abspath(out_dir)
    marker = os.path.join(out_dir, MARKER)
    spec = _spec(vocab_size)
    try:
        with open(marker) as f:
            if json.load(f) == spec and all(
                    os.path.exists(os.path.join(out_dir, n)) for n in ("tokenizer.json", "tokenizer_config.json")):
                return out_dir
    except (OSError, ValueError):
        pass

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update((word(i), word_id(i)) for i in range(vocab_size))
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Join words with single spaces when decoding (no decoder would do the same; said explicitly).
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tk.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=SPECIALS[4:], model_max_length=1 << 20, clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    # transformers 5 writes the template to chat_template.jinja; older readers (transformers 4,
    # engines that read tokenizer_config.json themselves) look for it in tokenizer_config.json.
    # Put it in both, with the class name every transformers version knows.
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    tmp = marker + ".tmp"
    with open(tmp, "w") as f:
        json.dump(spec, f)
    os.replace(tmp, marker)  # last: a directory without it is rebuilt next time
    return out_dir


def load_tokenizer(path: str):
    """``AutoTokenizer.from_pretrained(path)``, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: tokenizer.py OUT_DIR [VOCAB_SIZE]")
    print(build_tokenizer(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else DEFAULT_VOCAB))
