"""What cached answers and earlier turns add: tokens per verification step with and without them.

    python benchmarks/experiments/cache_multiturn.py --items 12 --out benchmarks/results/cache_multiturn_cpu

Built from the bundled MS-MARCO sample, with the offline models:

* cache-assisted: each question is answered once (its answer goes into a
  ResponseCache), then asked again reworded ("Could you tell me: <q>?"); the
  second answer is decoded with the retrieved passages as references, without
  the cache's answers, with them added to the references, and with them as
  ``answers=`` (drafted as the memory of answers drafts).
* multi-turn: a Conversation answers the question, then a follow-up ("Say that
  again in one short paragraph."); the follow-up is decoded with the passages
  only, with the earlier turns added as references (what ``Conversation`` does),
  and with the earlier answers as ``answers=`` (the questions stay references).

Every output is the model's own greedy output (checked against generate()).
Tokens/step is reported for the plain drafter chain (whole drafts of up to 10
tokens: it shows how good the drafts are) and for the default adaptive decoder.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

import torch

from rag_accel import DEFAULT_MODEL, ReferenceDecoder
from rag_accel.bench.harness import environment
from rag_accel.rag.cache import ResponseCache
from rag_accel.rag.conversation import Conversation
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
from rag_accel.rag.retrieval import OFFLINE_E5, Embedder, VectorIndex

CONFIGS = {"chain k=10": {"adaptive": False, "max_draft_tokens": 10}, "adaptive": {}}
FOLLOW_UP = "Say that again in one short paragraph."


def greedy(dec, ids, n):
    x = torch.tensor([ids], device=dec.device)
    with torch.inference_mode():
        return dec.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)[0, len(ids):].tolist()


SOURCES = ("passages only", "with extra references", "with extra answers=")


def measure(dec, msgs, n, acc, scenario, base_refs, more_refs, answers) -> int:
    """Decode ``msgs`` with each config and each of :data:`SOURCES` (``base_refs``; ``more_refs``;
    ``base_refs`` and ``answers``); add tokens/steps to ``acc``; return how many outputs equal plain greedy."""
    want = greedy(dec, dec.encode_prompt(msgs), n)
    same = 0
    for cfg_name, cfg in CONFIGS.items():
        for name, refs, given in zip(SOURCES, (base_refs, more_refs, base_refs), (None, None, answers)):
            out = dec.generate(msgs, references=refs, answers=given, max_new_tokens=n, config=cfg)
            a = acc[f"{scenario} / {cfg_name} / {name}"]
            a[0] += out.stats.new_tokens
            a[1] += out.stats.steps
            same += out.token_ids == want
    return same


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dec = ReferenceDecoder.from_pretrained(DEFAULT_MODEL)
    emb = Embedder(OFFLINE_E5)
    items = load_msmarco_sample(with_answers=True, limit=args.items)
    index = VectorIndex(emb)
    index.add([p for it in items for p in it.passages])
    n = args.max_new_tokens
    acc = {f"{scen} / {cfg} / {refs}": [0, 0] for scen in ("cache", "multi-turn") for cfg in CONFIGS
           for refs in SOURCES}
    identical = total = 0
    for it in items:
        # cache-assisted
        cache = ResponseCache(emb, min_score=0.8)
        passages = [h.text for h in index.search(it.query, 3)]
        first = dec.generate(rag_messages(it.query, passages), references=passages, max_new_tokens=n)
        cache.put(it.query, first.text)
        again = f"Could you tell me: {it.query}?"
        passages2 = [h.text for h in index.search(again, 3)]
        msgs = rag_messages(again, passages2)
        cached = cache.references(again)
        identical += measure(dec, msgs, n, acc, "cache", passages2, passages2 + cached, cached)
        total += len(SOURCES) * len(CONFIGS)
        # multi-turn
        conv = Conversation(dec, index=index, k=3)
        conv.ask(it.query, max_new_tokens=n)
        passages3 = [h.text for h in index.search(FOLLOW_UP, 3)]
        msgs = conv.messages(FOLLOW_UP, passages3)
        earlier = [t.answer for t in conv.turns]
        identical += measure(dec, msgs, n, acc, "multi-turn", passages3, conv.references(FOLLOW_UP, passages3),
                             earlier)
        total += len(SOURCES) * len(CONFIGS)
    rows = {k: v[0] / v[1] for k, v in acc.items()}
    lines = ["| scenario / decoder / references | tokens per step |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in rows.items()]
    table = "\n".join(lines)
    print(table)
    print(f"identical to greedy: {identical}/{total}")
    if args.out:
        env = environment(dec)
        cmd = f"python benchmarks/experiments/cache_multiturn.py --items {args.items} --max-new-tokens {n} --out {args.out}"
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps({"environment": env, "command": cmd, "items": len(items),
                                                        "tokens_per_step": rows, "identical": [identical, total]},
                                                       indent=1))
        out.with_suffix(".md").write_text(
            f"# Cache-assisted and multi-turn references\n\n- {env['model']} on {env['device']}, {env['dtype']}, "
            f"{datetime.now(timezone.utc).strftime('%Y-%m-%d')}\n- {len(items)} MS-MARCO sample items, {n} new tokens; "
            f"outputs identical to greedy: {identical}/{total}\n- command: `{cmd}`\n\n{table}\n")


if __name__ == "__main__":
    main()
