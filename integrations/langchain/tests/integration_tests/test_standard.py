"""LangChain's standard integration suite for ChatRagAccel on the real offline model (SmolLM2-135M-Instruct,
float32 on CPU): invoke, stream, batch, async, usage metadata, stop sequences, message histories."""

from __future__ import annotations

from langchain_rag_accel import ChatRagAccel
from langchain_tests.integration_tests import ChatModelIntegrationTests

from rag_accel import DEFAULT_MODEL


class TestChatRagAccelStandard(ChatModelIntegrationTests):
    @property
    def chat_model_class(self):
        return ChatRagAccel

    @property
    def chat_model_params(self):
        # max_tokens keeps the suite's ~40 generations short on a CPU
        return {"model": DEFAULT_MODEL, "device": "cpu", "dtype": "float32", "max_tokens": 24}

    # What the model does not do, declared (a local text model, no tools).
    has_tool_calling = False
    has_tool_choice = False
    has_structured_output = False
    supports_json_mode = False
    supports_image_inputs = False
    supports_model_override = False  # one instance runs one model; model=<other> is an error
    returns_usage_metadata = True
