"""What ``Running`` records without a model: a step's peers in each trace."""

from __future__ import annotations

from tokenbelt.belt import Belt, Trace
from tokenbelt.engines import GenerationRequest
from tokenbelt.engines.llama._running import note_peers
from tokenbelt.engines.llama._sequence import Sequence


def _sequences(n: int) -> list[Sequence]:
    seqs = []
    for i in range(n):
        belt: Belt[str] = Belt(4, trace=Trace(request_id=f"r{i}"))
        seqs.append(Sequence(GenerationRequest(prompt="x"), belt.producer, lambda: None))
    return seqs


def test_each_trace_names_the_other_requests_of_its_step() -> None:
    a, b, c = _sequences(3)
    note_peers([a, b, c])
    assert a.producer.trace.batched_with == {"r1", "r2"}
    assert c.producer.trace.batched_with == {"r0", "r1"}


def test_a_trace_names_at_most_so_many_peers() -> None:
    seqs = _sequences(5)
    note_peers(seqs, most=2)
    assert all(len(s.producer.trace.batched_with) == 2 for s in seqs)
    assert "r0" not in seqs[0].producer.trace.batched_with
    note_peers(list(reversed(seqs)), most=2)  # a later step adds nothing past the bound
    assert all(len(s.producer.trace.batched_with) == 2 for s in seqs)
