"""A function tool the structured-output tests share (OpenAI's ``tools`` shape)."""

from __future__ import annotations

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 32}},
            "required": ["city"],
        },
    },
}
