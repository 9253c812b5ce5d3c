"""Multi-turn chat reuse against a running kvcached daemon.

Each turn's prompt is the whole conversation so far plus a new user message, as a chat
server would send it. With kvcached, every turn after the first finds the previous turns
cached and runs the model only on what is new: watch "cached" grow and TTFT stay flat
while the plain model's prefill grows with the conversation.

    kvcached serve &                                  # or ./scripts/serve
    .venv/bin/python clients/examples/chat_reuse.py [--socket PATH] [--turns 6]

The model is a random-weight Llama built from a config (no download), so the "replies"
are gibberish token ids; the point is the timing and the identical outputs.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvcached_client import Client
from kvcached_client.hf import generate, layout_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=None, help="daemon socket (default $KVCACHED_SOCKET)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-tokens", type=int, default=300, help="tokens per user message")
    ap.add_argument("--reply-tokens", type=int, default=16)
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    model = LlamaForCausalLM(cfg).eval()
    layout = layout_for(model, model_id="example/chat-llama@random0", chunk_tokens=128)
    g = torch.Generator().manual_seed(42)
    system = torch.randint(0, cfg.vocab_size, (400,), generator=g)  # a long system prompt
    conversation = system
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT kvcached':>14} {'TTFT plain':>11} {'same reply':>10}")
    with Client(args.socket) as c:
        for turn in range(1, args.turns + 1):
            user = torch.randint(0, cfg.vocab_size, (args.user_tokens,), generator=g)
            conversation = torch.cat([conversation, user])
            out = generate(c, model, layout, conversation, max_new_tokens=args.reply_tokens)
            with torch.no_grad():  # the same turn without kvcached, for comparison
                t = time.perf_counter()
                model(input_ids=conversation.unsqueeze(0), use_cache=True)
                plain = time.perf_counter() - t
            from kvcached_client.hf import reference_generate

            same = reference_generate(model, conversation, args.reply_tokens)[0] == out.tokens
            print(f"{turn:>4} {conversation.numel():>7} {out.prefill.cached_tokens:>7} "
                  f"{out.ttft_seconds * 1e3:>11.1f} ms {plain * 1e3:>8.1f} ms {str(same):>10}")
            conversation = torch.cat([conversation, torch.tensor(out.tokens)])


if __name__ == "__main__":
    main()
