"""The read-only routes: models, health, the request record, the OpenAPI schema."""

from __future__ import annotations

import time

import httpx

from tokenbelt import ScriptedEngine

from ..conftest import CHAT, NET, ServeFactory, chat_body, scripted_runtime, words


def test_models_health_and_schema(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(3), delay=0, context_length=512)))
    with httpx.Client(base_url=served.url, timeout=NET) as client:
        models = client.get("/v1/models").json()
        assert models["object"] == "list"
        (entry,) = models["data"]  # only what this server serves
        assert entry["id"] == "scripted"
        # The catalog's aliases are listed apart, with whether their file is here.
        catalog = models["tokenbelt"]["not_served"]
        first = catalog[0]
        assert (first["id"], first["tokenbelt"]["loaded"], first["tokenbelt"]["state"]) == (
            "smollm2-135m",
            False,
            "available",
        )
        assert catalog[0]["tokenbelt"]["cached"] is True
        # the embedding and rerank entries, whose files are not here
        assert [(m["id"], m["tokenbelt"]["cached"]) for m in catalog[1:]] == [
            ("nomic-embed-text-v1.5", False),
            ("bge-reranker-v2-m3", False),
        ]
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
            "responses_store": {"enabled": False, "budget_bytes": 0, "ttl_s": 3600.0},
            "model_status": {
                "scripted": {
                    "name": "scripted",
                    "state": "ready",
                    "unloaded_because": None,
                    "pinned": False,
                    "memory": None,  # a scripted engine: nothing to count
                    "slots": 1,
                    "running": 0,
                    "queued": 0,
                    "keep_alive_s": None,
                    "expires_in_s": None,
                    "loads": 1,
                    "evictions": 0,
                    "completions": {
                        "completions": 0,
                        "superseded": 0,
                        "stale_tokens": 0,
                        "first_token_p50_ms": None,
                        "first_token_p95_ms": None,
                    },
                }
            },
            "memory": {"budget_bytes": None, "used_bytes": 0, "evictions": 0},
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


def test_a_failed_load_is_not_listed_as_served(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(3), delay=0)), load="no-such-model")
    with httpx.Client(base_url=served.url, timeout=NET) as client:
        deadline = time.monotonic() + NET
        while client.get("/health").json()["loads"]["no-such-model"]["state"] != "failed":
            assert time.monotonic() < deadline, "the load did not fail"
            time.sleep(0.01)
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["scripted"]
        failed = [m for m in models["tokenbelt"]["not_served"] if m["id"] == "no-such-model"]
        assert [m["tokenbelt"]["load"]["state"] for m in failed] == ["failed"]
        assert client.get("/v1/models/scripted").json()["id"] == "scripted"
        missing = client.get("/v1/models/no-such-model")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
