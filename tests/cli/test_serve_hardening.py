"""``tokenbelt serve`` as a real process: its flags reach the HTTP edges they harden."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from urllib.parse import urlsplit

import plainhttp
from serving import serve_default_model

NET = 30.0
CHAT = "/v1/chat/completions"


def read_to_close(sock: socket.socket) -> bytes:
    sock.settimeout(NET)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_serve_hardens_the_http_edges(tmp_path: Path) -> None:
    flags = ("--api-key", "alice-key", "--api-key", "bob-key", "--admin-key", "root-key")
    flags += ("--read-timeout", "1", "--allowed-host", "llm.lan")
    with serve_default_model(tmp_path, extra=flags) as url:
        address = (urlsplit(url).hostname or "", urlsplit(url).port or 0)
        alice = {"Authorization": "bearer alice-key"}  # the scheme in lower case
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        reply = plainhttp.post(url + CHAT, json=body, headers=alice, timeout=NET)
        assert reply.status_code == 200, reply.text
        request_id = reply.headers["x-request-id"]

        # Only its own key (and the admin's) sees the request.
        record = f"{url}/v1/requests/{request_id}"
        for key, status in (("bob-key", 404), ("alice-key", 200), ("root-key", 200)):
            seen = plainhttp.get(record, headers={"Authorization": f"Bearer {key}"}, timeout=NET)
            assert seen.status_code == status, key

        # Host names: loopback and --allowed-host, nothing else.
        for host, status in (("evil.example", 421), ("llm.lan:8080", 200), ("localhost", 200)):
            answer = plainhttp.get(f"{url}/v1/models", headers={**alice, "Host": host}, timeout=NET)
            assert answer.status_code == status, host

        # Half a request: a 408 and a closed connection after --read-timeout.
        with socket.create_connection(address) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            assert read_to_close(sock).startswith(b"HTTP/1.1 408 ")

        # A client that half-closes once its request is sent is answered.
        payload = json.dumps({**body, "stream": True}).encode()
        with socket.create_connection(address) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Authorization: Bearer alice-key\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            sock.shutdown(socket.SHUT_WR)
            answer = read_to_close(sock)
        assert b"HTTP/1.1 200 OK" in answer
        assert answer.rstrip().endswith(b"0")  # the chunked body's end, after [DONE]
        assert b"data: [DONE]" in answer
