"""Quickstart: answer MS-MARCO sample questions with the offline default model, copying from the passages.

    python examples/quickstart.py [--queries 3] [--max-new-tokens 96]

For each question: the answer streamed as it is decoded, the tokens per
verification step, and the wall-clock speed-up over plain greedy decoding
(`model.generate(do_sample=False)`) of the same prompt, whose output is
checked to be identical.
"""

from __future__ import annotations

import argparse
import time

import torch

from rag_accel import DEFAULT_MODEL, ReferenceDecoder
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--device", default=None)
    p.add_argument("--queries", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args()

    dec = ReferenceDecoder.from_pretrained(args.model, device=args.device)
    print(f"model {args.model} on {dec.device}, {dec.model.dtype}")
    for item in load_msmarco_sample(with_answers=True, limit=args.queries):
        messages = rag_messages(item.query, item.passages)
        print(f"\nQ: {item.query}\nA: ", end="", flush=True)
        stream = dec.stream(messages, references=item.passages, max_new_tokens=args.max_new_tokens)
        for piece in stream:
            print(piece, end="", flush=True)
        out = stream.output
        ids = torch.tensor([dec.encode_prompt(messages)], device=dec.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            plain = dec.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=args.max_new_tokens)[0, ids.shape[1]:].tolist()
        greedy_s = time.perf_counter() - t0
        s = out.stats
        print(f"\n  [{s.new_tokens} tokens, {s.tokens_per_step:.2f} tokens/step, drafts from {s.by_drafter}; "
              f"{s.time_s:.2f}s vs plain greedy {greedy_s:.2f}s = {greedy_s / s.time_s:.2f}x; "
              f"identical to greedy: {plain == out.token_ids}]")


if __name__ == "__main__":
    main()
