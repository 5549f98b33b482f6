"""LangChain's standard integration suite for ChatRagAccel in remote mode: the same suite as test_standard.py,
against a real `rag-accel serve` server (started with the Python named by RAG_ACCEL_VLLM_PYTHON; skipped, saying
so, when unset): invoke, stream, batch, async, usage metadata, stop sequences, message histories over HTTP."""

from __future__ import annotations

import pytest
from langchain_rag_accel import ChatRagAccel
from langchain_tests.integration_tests import ChatModelIntegrationTests

from rag_accel import DEFAULT_MODEL

pytestmark = pytest.mark.xdist_group("rag-accel-serve")  # one test process runs the shared server's modules


class TestChatRagAccelRemoteStandard(ChatModelIntegrationTests):
    base_url: str | None = None

    @pytest.fixture(autouse=True)
    def _server(self, remote_server):  # before the suite's model fixture: the URL is only known now
        type(self).base_url = remote_server.base_url

    @property
    def chat_model_class(self):
        return ChatRagAccel

    @property
    def chat_model_params(self):
        # max_tokens keeps the suite's ~40 generations short on a CPU
        return {"model": DEFAULT_MODEL, "base_url": self.base_url, "max_tokens": 24}

    # What the model does not do, declared (a text model, no tools).
    has_tool_calling = False
    has_tool_choice = False
    has_structured_output = False
    supports_json_mode = False
    supports_image_inputs = False
    supports_model_override = False  # one instance runs one model; model=<other> is an error
    returns_usage_metadata = True
