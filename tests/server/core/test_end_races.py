"""Over HTTP with the real model: a cancel call racing a dropped connection, many times.

Four clients at a time (the model batches four sequences) each start a stream, read a
random number of chunks, then close the socket and call the cancel endpoint at the same
moment from two threads. Whichever lands first names the request's end; every observer
must agree on it: the trace, the server's request record, the metrics and the log line.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

import plainhttp
from tokenbelt import EndReason

from ..conftest import CHAT, NET, RawClient, ServeFactory, chat_body, real_runtime

pytestmark = pytest.mark.model

REQUESTS = int(os.environ.get("TOKENBELT_HTTP_RACES", "200"))
ENDS = {"user_cancel", "client_disconnect", "stop", "length"}


def one(url: str, rng: random.Random) -> str:
    """One request whose stop races its own disconnect; returns its request id."""
    body = chat_body("Tell me about the sea.", stream=True, max_tokens=12, temperature=0)
    client = RawClient(url)
    client.send(CHAT, body)
    _, headers = client.read_head()
    request_id = headers["x-request-id"]
    for _ in range(rng.randrange(0, 4)):
        client.read_until(b"\n\n")
        client.buffer.clear()
    go = threading.Barrier(2)

    def cancel() -> None:
        go.wait()
        plainhttp.post(f"{url}/v1/requests/{request_id}/cancel", timeout=NET)

    canceller = threading.Thread(target=cancel, name="race-cancel-call")
    canceller.start()
    go.wait()
    client.close()
    canceller.join(NET)
    return request_id


@pytest.mark.timeout(600)
def test_cancel_call_racing_a_dropped_connection(
    serve: ServeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    served = serve(real_runtime(slots=4, n_ctx=1024))
    rng = random.Random(17)
    seeds = [rng.randrange(1 << 30) for _ in range(REQUESTS)]
    with caplog.at_level(logging.INFO, logger="tokenbelt.requests"):
        with ThreadPoolExecutor(4) as pool:
            ids = list(pool.map(lambda s: one(served.url, random.Random(s)), seeds))
        reasons: Counter[str] = Counter()
        for request_id in ids:
            trace = served.recorder.by_id(request_id)
            served.recorder.wait(trace, "released")
            assert trace.end_reason is not None
            reason = trace.end_reason.value
            assert reason in ENDS
            reasons[reason] += 1
            record = plainhttp.get(f"{served.url}/v1/requests/{request_id}", timeout=NET).json()
            assert record["end_reason"] == reason
            assert record["timeline_ms"]["released"] is not None
    logged = Counter(
        json.loads(r.getMessage())["end_reason"]
        for r in caplog.records
        if r.name == "tokenbelt.requests"
    )
    assert logged == reasons
    metrics = plainhttp.get(f"{served.url}/metrics", timeout=NET).text
    for reason, n in reasons.items():
        line = f'tokenbelt_requests_total{{api="openai",end_reason="{reason}",model='
        counted = [ln for ln in metrics.splitlines() if ln.startswith(line)]
        assert counted, reason
        assert float(counted[0].rsplit(" ", 1)[1]) == n, (reason, counted)
    # Both causes won some races (and nothing else ever named an end).
    assert reasons[EndReason.USER_CANCEL.value] + reasons["client_disconnect"] > 0
