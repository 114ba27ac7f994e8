"""The read-only routes: models, health, the request record, the OpenAPI schema."""

from __future__ import annotations

import httpx

from tokenbelt import ScriptedEngine

from .conftest import CHAT, NET, ServeFactory, chat_body, scripted_runtime, words


def test_models_health_and_schema(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(3), delay=0, context_length=512)))
    with httpx.Client(base_url=served.url, timeout=NET) as client:
        models = client.get("/v1/models").json()
        assert models["object"] == "list"
        entry, *catalog = models["data"]
        assert entry["id"] == "scripted"
        # The catalog's aliases are listed too, with whether their file is here.
        assert [(m["id"], m["tokenbelt"]["loaded"], m["tokenbelt"]["state"]) for m in catalog] == [
            ("smollm2-135m", False, "available")
        ]
        assert catalog[0]["tokenbelt"]["cached"] is True
        assert entry["object"] == "model"
        info = entry["tokenbelt"]
        assert info["loaded"] is True
        assert info["state"] == "ready"
        assert info["context_length"] == 512
        assert info["slots"] == 1

        assert client.get("/health").json() == {
            "status": "ok",
            "reason": None,
            "models": {"scripted": "ready"},
            "loads": {},
        }

        paths = client.get("/openapi.json").json()["paths"]
        for path in (
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/models",
            "/v1/requests",
            "/v1/requests/{request_id}",
            "/v1/requests/{request_id}/cancel",
            "/health",
            "/metrics",
        ):
            assert path in paths, path


def test_the_request_record_lists_newest_first(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(3), delay=0)))
    with httpx.Client(base_url=served.url, timeout=NET) as client:
        ids = [client.post(CHAT, json=chat_body()).headers["x-request-id"] for _ in range(3)]
        for request_id in ids:
            served.recorder.wait(served.recorder.by_id(request_id), "released")
        listed = client.get("/v1/requests").json()
        assert listed["object"] == "list"
        assert [t["request_id"] for t in listed["data"]] == ids[::-1]
        assert [t["request_id"] for t in client.get("/v1/requests?limit=1").json()["data"]] == [
            ids[-1]
        ]
        one = client.get(f"/v1/requests/{ids[0]}").json()
        assert one["end_reason"] == "stop"
        assert one["model"] == "scripted"
        assert set(one["timeline_ms"]) == {
            "enqueued",
            "admitted",
            "first_token",
            "last_token",
            "cancel_requested",
            "released",
        }
