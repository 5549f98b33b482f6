"""The framework adapters end to end: a LangChain RAG chain and a LlamaIndex query engine,
each with our model and with the same model on plain greedy (``accelerate=False``:
the model's own ``generate(do_sample=False)``), side by side on the same questions.

    python benchmarks/integrations_bench.py --items 20 --max-new-tokens 128 \
        --out benchmarks/results/integrations_cpu_smollm2

Per framework and question, after a warm-up, the two runs alternate in order (A,B then
B,A) so drift hits both alike. Timed: the whole ``invoke``/``query`` (retrieval with E5
over FAISS, prompt, decoding); the retrieval is the same for both, so the ratio
understates the decoding speed-up a little. Reported: geometric-mean speed-up of the
end-to-end call, worst question, tokens per verification step, identical-answer rate.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from langchain_rag_accel import ChatRagAccel, VectorIndexRetriever, rag_chain
from llama_index.llms.rag_accel import RagAccelLLM, e5_embedding, faiss_vector_index

from rag_accel import DEFAULT_MODEL, ReferenceDecoder
from rag_accel.bench.harness import environment
from rag_accel.rag.msmarco import load_msmarco_sample
from rag_accel.rag.retrieval import OFFLINE_E5, Embedder, VectorIndex


def _timed(fn, arg):
    t0 = time.perf_counter()
    out = fn(arg)
    return out, time.perf_counter() - t0


def _summary(rows: list[dict]) -> dict:
    ratios = [r["greedy_s"] / r["ours_s"] for r in rows]
    return {
        "speedup_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
        "speedup_worst": min(ratios),
        "tokens_per_step": sum(r["new_tokens"] for r in rows) / sum(r["steps"] for r in rows),
        "identical_rate": sum(r["identical"] for r in rows) / len(rows),
        "ours_median_s": sorted(r["ours_s"] for r in rows)[len(rows) // 2],
        "greedy_median_s": sorted(r["greedy_s"] for r in rows)[len(rows) // 2],
    }


def run(items, k: int, max_new: int, corpus_items: int) -> dict:
    dec = ReferenceDecoder.from_pretrained(DEFAULT_MODEL, device="cpu", dtype="float32")
    corpus = load_msmarco_sample(limit=corpus_items)
    texts = [p for it in corpus for p in it.passages]
    ids = [f"{it.id}/{j}" for it in corpus for j in range(len(it.passages))]

    # LangChain: our VectorIndex (FAISS + E5) behind a LangChain retriever.
    vindex = VectorIndex(Embedder(OFFLINE_E5))
    vindex.add(texts, ids=ids, show_progress=True)
    retriever = VectorIndexRetriever(index=vindex, k=k)
    lc = {"ours": rag_chain(retriever, ChatRagAccel(decoder=dec, max_tokens=max_new), parser=None),
          "greedy": rag_chain(retriever, ChatRagAccel(decoder=dec, max_tokens=max_new, accelerate=False),
                              parser=None)}

    # LlamaIndex: its own FAISS vector store and HuggingFaceEmbedding (E5 prefixes), unchanged query engine.
    from llama_index.core.schema import TextNode

    li_index = faiss_vector_index([TextNode(text=t, id_=i) for t, i in zip(texts, ids)], e5_embedding())
    li_llm = {"ours": RagAccelLLM(decoder=dec, max_new_tokens=max_new),
              "greedy": RagAccelLLM(decoder=dec, max_new_tokens=max_new, accelerate=False)}
    li = {m: li_index.as_query_engine(llm=llm, similarity_top_k=k) for m, llm in li_llm.items()}

    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent

    last: dict = {}

    class LastChat(BaseEventHandler):
        def handle(self, event, **kw):
            if isinstance(event, LLMChatEndEvent) and event.response is not None:
                last["stats"] = event.response.additional_kwargs["rag_accel"]

    get_dispatcher().add_event_handler(LastChat())

    def lc_call(method):
        def call(q):
            msg = lc[method].invoke(q)
            return msg.content, msg.response_metadata["rag_accel"]
        return call

    def li_call(method):
        def call(q):
            text = str(li[method].query(q))
            return text, last["stats"]
        return call

    frameworks = {"langchain": lc_call, "llamaindex": li_call}
    # warm-up: cost curve, caches, first-call overheads
    for make in frameworks.values():
        for m in ("ours", "greedy"):
            make(m)(items[0].query)
    results: dict = {}
    for name, make in frameworks.items():
        rows = []
        for i, it in enumerate(items):
            order = ("ours", "greedy") if i % 2 == 0 else ("greedy", "ours")
            got = {m: _timed(make(m), it.query) for m in order}
            (ours_text, st), ours_s = got["ours"]
            (greedy_text, _), greedy_s = got["greedy"]
            rows.append({"id": it.id, "ours_s": ours_s, "greedy_s": greedy_s, "new_tokens": st["new_tokens"],
                         "steps": st["steps"], "identical": ours_text == greedy_text,
                         "reference_accepted": st["by_drafter"].get("reference", {}).get("accepted", 0)})
            print(f"{name} {i + 1}/{len(items)} {it.id}: {greedy_s / ours_s:.2f}x, "
                  f"{st['new_tokens'] / st['steps']:.2f} tokens/step", file=sys.stderr)
        results[name] = {"summary": _summary(rows), "per_item": rows}
    return {"environment": environment(dec, DEFAULT_MODEL), "results": results}


def markdown(r: dict) -> str:
    env = r["environment"]
    lines = [f"# Framework adapters end to end ({env['device']}, {env['model']}, {env['dtype']}, {env['date']})", "",
             f"{r['items']} MS-MARCO questions, top-{r['k']} passages from {r['corpus_passages']} indexed, "
             f"{r['max_new_tokens']} new tokens. Baseline: the same chain / engine with `accelerate=False` "
             "(the model's own `generate(do_sample=False)`).", "",
             "| framework | speed-up of the whole call (geo-mean) | worst question | tokens/step | identical answers |",
             "|---|---|---|---|---|"]
    for name, v in r["results"].items():
        s = v["summary"]
        lines.append(f"| {name} | {s['speedup_geomean']:.2f}x | {s['speedup_worst']:.2f}x | "
                     f"{s['tokens_per_step']:.2f} | {s['identical_rate']:.0%} |")
    lines += ["", f"Command: `{r['command']}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--corpus-items", type=int, default=100, help="index the passages of the first N sample items")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/integrations_cpu_smollm2"))
    a = ap.parse_args()
    torch.manual_seed(0)
    items = [it for it in load_msmarco_sample(limit=a.corpus_items) if it.answers][: a.items]  # all indexed
    r = run(items, a.k, a.max_new_tokens, a.corpus_items)
    r.update(items=len(items), k=a.k, max_new_tokens=a.max_new_tokens,
             corpus_passages=sum(len(it.passages) for it in load_msmarco_sample(limit=a.corpus_items)),
             command="python benchmarks/integrations_bench.py " + shlex.join(sys.argv[1:]))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(r, indent=1))
    a.out.with_suffix(".md").write_text(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
