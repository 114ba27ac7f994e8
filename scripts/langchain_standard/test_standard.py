"""langchain-tests' standard ``ChatModelIntegrationTests`` for ``ChatOpenAI`` against
tokenbelt (issue 24). Too slow for the suite (some tests ask for long replies): run it
on its own, with langchain-tests and its pytest plugins where Python finds them:

    TOKENBELT_URL=http://127.0.0.1:8765/v1 python -m pytest -c /dev/null -p no:cacheprovider \\
        -q scripts/langchain_standard/test_standard.py

against a running ``tokenbelt serve --port 8765`` (``run.sh`` here does both). The
tool-calling tests that the schema refusal failed before (``magic_function`` takes
``Field(gt=-1000, lt=1000)``) are in the suite too: tests/server/openai/test_langchain.py.
"""

from __future__ import annotations

import os

from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests


class TestTokenbeltChatOpenAI(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict[str, object]:
        return {
            "model": os.environ.get("TOKENBELT_MODEL", "smollm2-135m"),
            "base_url": os.environ.get("TOKENBELT_URL", "http://127.0.0.1:8765/v1"),
            "api_key": "x",
            "temperature": 0,
            "max_tokens": 256,
            "timeout": 120,
            "stream_usage": True,
        }

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True
