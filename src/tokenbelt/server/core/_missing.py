"""What a route that is not here answers: never a bare ``Not Found``.

A client that calls an OpenAI, Anthropic or Ollama route tokenbelt does not serve is told
which route, that it is known and not implemented (501), and what this server serves
instead; any other unknown path is a 404 that names it. Both come in the error shape
of the API the path belongs to.
"""

from __future__ import annotations

#: routes of the APIs tokenbelt speaks that it does not implement, by path prefix
KNOWN: dict[str, str] = {
    "/v1/audio/speech": "OpenAI text to speech (speech to text is /v1/audio/transcriptions)",
    "/v1/images/": "OpenAI images",
    "/v1/videos": "OpenAI videos",
    "/v1/files": "file uploads",
    "/v1/uploads": "file uploads",
    "/v1/batches": "OpenAI batches",
    "/v1/fine_tuning/": "fine-tuning",
    "/v1/moderations": "OpenAI moderations",
    "/v1/assistants": "OpenAI assistants",
    "/v1/threads": "OpenAI threads",
    "/v1/vector_stores": "OpenAI vector stores",
    "/v1/realtime": "OpenAI realtime",
    "/v1/conversations": "OpenAI conversations (use previous_response_id with the store)",
    "/v1/containers": "OpenAI containers",
    "/v1/evals": "OpenAI evals",
    "/v1/complete": "Anthropic's legacy text completions (use /v1/messages)",
    "/v1/messages/batches": "Anthropic message batches",
    "/v1/skills": "Anthropic skills",
    "/api/create": "Ollama model creation (serve a GGUF file: tokenbelt serve PATH)",
    "/api/copy": "Ollama model copies (a catalog alias names a model)",
    "/api/push": "Ollama model pushes",
    "/api/blobs/": "Ollama blobs",
    "/v2/embed": "Cohere v2 embeddings (the OpenAI shape is /v1/embeddings)",
    "/v2/chat": "Cohere v2 chat (the OpenAI shape is /v1/chat/completions)",
}

SERVED = (
    "it serves /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, "
    "/v1/embeddings, /v1/rerank, /v2/rerank, /v1/audio/transcriptions, /v1/audio/translations, "
    "/v1/messages, /api/chat, /api/generate, /api/embed, "
    "/api/tags, /api/show, /api/ps, /api/pull, /api/delete, /api/version and tokenbelt's "
    "own routes (see /docs)"
)


def missing(method: str, path: str) -> tuple[int, str]:
    """(status, message) for ``method path``, which no route here answers."""
    for prefix, what in KNOWN.items():
        if path == prefix.rstrip("/") or path.startswith(prefix):
            return 501, f"tokenbelt does not implement {method} {path} ({what}); {SERVED}"
    return 404, f"no route {method} {path} on this server; {SERVED}"
