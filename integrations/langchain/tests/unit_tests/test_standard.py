"""LangChain's standard unit suite for ChatRagAccel: construction, parameters, tracing. No model is loaded
(the model loads on the first call)."""

from __future__ import annotations

from langchain_rag_accel import ChatRagAccel
from langchain_tests.unit_tests import ChatModelUnitTests

from rag_accel import DEFAULT_MODEL


class TestChatRagAccelStandard(ChatModelUnitTests):
    @property
    def chat_model_class(self):
        return ChatRagAccel

    @property
    def chat_model_params(self):
        return {"model": DEFAULT_MODEL, "device": "cpu", "dtype": "float32"}

    @property
    def standard_chat_model_params(self):
        params = super().standard_chat_model_params
        del params["api_key"]  # a local model has no API key; passing one is an error (extra="forbid")
        return params

    # What the model does not do, declared (a local text model, no tools).
    has_tool_calling = False
    has_tool_choice = False
    has_structured_output = False
    supports_json_mode = False
    supports_image_inputs = False
    supports_model_override = False  # one instance runs one model; model=<other> is an error
    returns_usage_metadata = True
