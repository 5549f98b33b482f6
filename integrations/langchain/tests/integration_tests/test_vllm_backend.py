"""ChatRagAccel with ``backend="vllm"``: a vLLM engine in this process (rag_accel.vllm.VllmDecoder, shared by the
instances), inside ``rag_chain``. Answers equal the same engine with drafting off, token for token; each call's
documents are its references (the stats, in process, say what they drafted); batch (threads share the engine's
batch), stream, async.

Runs where vLLM is installed (the vLLM virtualenv, with this package: see the README's test commands); skipped
without vLLM, an error when RAG_ACCEL_REQUIRE_VLLM=1."""

from __future__ import annotations

import asyncio
import os

import pytest

from rag_accel.serving.server_process import import_vllm_or_skip

import_vllm_or_skip()  # CI (RAG_ACCEL_REQUIRE_VLLM=1): a missing vLLM fails here instead of skipping

from langchain_core.documents import Document  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_rag_accel import ChatRagAccel, rag_chain  # noqa: E402

import rag_accel  # noqa: E402
from rag_accel import DEFAULT_MODEL  # noqa: E402
from rag_accel.adapters import close_shared_decoders  # noqa: E402
from rag_accel.rag.msmarco import load_msmarco_sample  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1" if (os.cpu_count() or 1) >= 2 else "0")

MAX_NEW = 32


class SampleRetriever(BaseRetriever):
    """Each sample question's own passages (retrieval quality is not what is tested here)."""

    docs: dict[str, list[Document]]

    def _get_relevant_documents(self, query, *, run_manager):
        return list(self.docs[query])


@pytest.fixture(scope="module")
def items():
    return load_msmarco_sample(limit=3)


@pytest.fixture(scope="module")
def retriever(items):
    return SampleRetriever(docs={it.query: [Document(page_content=p) for p in it.passages] for it in items})


@pytest.fixture(scope="module")
def llms():
    # The application configures the process's engine once (eager: on a CPU vLLM's default compiles the model,
    # ~95 s more per start here); the adapters made with backend="vllm" share it.
    engine = rag_accel.load(DEFAULT_MODEL, backend="vllm", max_model_len=2048, enforce_eager=True)
    on = ChatRagAccel(backend="vllm", max_tokens=MAX_NEW)
    off = ChatRagAccel(backend="vllm", max_tokens=MAX_NEW, accelerate=False)
    assert on.engine is off.engine is engine
    yield on, off
    close_shared_decoders()  # the engine's processes and memory, before the next module's engines


def test_one_engine_per_model_in_a_process(llms):
    """A second load naming other engine options is refused (no second engine starts); none named: the same."""
    with pytest.raises(ValueError, match="already runs a vLLM engine"):
        rag_accel.load(DEFAULT_MODEL, backend="vllm", max_model_len=1024)
    assert rag_accel.load(DEFAULT_MODEL, backend="vllm") is llms[0].engine


@pytest.mark.slow
def test_rag_chain_on_vllm_in_process(llms, retriever, items):
    on, off = llms
    assert type(on.engine).__name__ == "VllmDecoder"
    qs = [it.query for it in items]
    greedy = {q: rag_chain(retriever, off, parser=None).invoke(q) for q in qs}
    msg = rag_chain(retriever, on, parser=None).invoke(qs[0])
    assert msg.content == greedy[qs[0]].content and msg.usage_metadata == greedy[qs[0]].usage_metadata
    assert isinstance(msg.response_metadata["rag_accel"]["drafted"], int)  # in process the stats are there
    # The call's documents are its references: the answer itself as the only document is copied. The
    # document is in the prompt too, where the frequency drafter copies it from as well: a model drafting
    # from the references only (decoder_config) shows the documents arrived as references.
    answer = SampleRetriever(docs={qs[0]: [Document(page_content=greedy[qs[0]].content)]})
    refs_only = ChatRagAccel(backend="vllm", max_tokens=MAX_NEW, decoder_config={"drafters": ["reference"]})
    for llm in (on, refs_only):
        copied = rag_chain(answer, llm, parser=None).invoke(qs[0])
        stats = copied.response_metadata["rag_accel"]
        assert stats["accepted"] >= 0.5 * copied.usage_metadata["output_tokens"], stats
        assert copied.content == rag_chain(answer, off, parser=None).invoke(qs[0]).content
    assert set(stats["by_drafter"]) == {"reference"} and stats["by_drafter"]["reference"]["accepted"] > 0, stats
    chain = rag_chain(retriever, on)
    assert chain.batch(qs, config={"max_concurrency": 3}) == [greedy[q].content for q in qs]
    assert "".join(chain.stream(qs[1])) == greedy[qs[1]].content
    assert asyncio.run(chain.ainvoke(qs[2])) == greedy[qs[2]].content
