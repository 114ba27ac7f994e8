"""A caller's own ``x-request-id`` (a tokenbelt front passes its id to its upstream)."""

from __future__ import annotations

import httpx

from tokenbelt import ScriptedEngine

from .conftest import CHAT, NET, ServeFactory, chat_body, scripted_runtime


def test_a_new_well_formed_id_is_used_once(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine([" a", " b"], delay=0.0)))

    def ask(request_id: str) -> str:
        answer = httpx.post(
            served.url + CHAT, json=chat_body(), headers={"x-request-id": request_id}, timeout=NET
        )
        assert answer.status_code == 200, answer.text
        given: str = answer.headers["x-request-id"]
        assert answer.json()["id"] == given
        return given

    assert ask("req_front_1") == "req_front_1"
    # Taken already, or not an id we would put in a URL: a new one of the server's own.
    again = ask("req_front_1")
    assert again != "req_front_1"
    assert again.startswith("req_")
    odd = ask("../../etc")
    assert odd.startswith("req_")
    found = httpx.get(f"{served.url}/v1/requests/req_front_1", timeout=NET).json()
    assert found["end_reason"] == "stop"
