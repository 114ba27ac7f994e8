"""The OpenAI sampling parameters: checked up front, carried across a process boundary,
honoured by the batch engine (the runtime's) and refused by an engine that cannot."""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator

import pytest

from tokenbelt import (
    GenerationRequest,
    InvalidArgument,
    Runtime,
    SamplingParams,
    TokenLogprob,
)
from tokenbelt.engines import LlamaEngine, Piece, request_body
from tokenbelt.models import default_model_path

USER = [{"role": "user", "content": "Name a colour."}]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"presence_penalty": "high"}, "presence_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {5: "up"}}, "logit_bias"),
        ({"logit_bias": "5:1"}, "logit_bias"),
        ({"logprobs": 1}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ],
)
def test_bad_values_name_their_parameter(params: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        SamplingParams(**params)  # type: ignore[arg-type]
    assert caught.value.param == param


def test_logit_bias_keeps_sorted_hashable_pairs() -> None:
    s = SamplingParams(logit_bias={"7": -100, 3: 5.5})  # type: ignore[arg-type]
    assert s.logit_bias == ((3, 5.5), (7, -100.0))
    assert hash(s) == hash(SamplingParams(logit_bias=((7, -100), (3, 5.5))))


def test_requests_and_pieces_cross_a_process_boundary() -> None:
    sampling = SamplingParams(
        frequency_penalty=0.5, logit_bias=((3, 1.0),), logprobs=True, top_logprobs=2
    )
    request = GenerationRequest.chat(USER, sampling)  # type: ignore[arg-type]
    assert pickle.loads(pickle.dumps(request)) == request
    top = (TokenLogprob("a", -0.1, b"a"), TokenLogprob("b", -2.0, b"b"))
    piece = Piece("a", (TokenLogprob("a", -0.1, b"a", top),))
    again = pickle.loads(pickle.dumps(piece))
    assert type(again) is Piece
    assert again == "a"
    assert again.logprobs == piece.logprobs


def test_the_remote_engine_passes_penalties_and_bias_on() -> None:
    sampling = SamplingParams(frequency_penalty=0.5, presence_penalty=-1, logit_bias=((3, 2.0),))
    body = request_body(GenerationRequest(prompt="hi", sampling=sampling), "upstream")
    assert body["frequency_penalty"] == 0.5
    assert body["presence_penalty"] == -1
    assert body["logit_bias"] == {"3": 2.0}
    plain = request_body(GenerationRequest(prompt="hi"), "upstream")
    assert not {"frequency_penalty", "presence_penalty", "logit_bias"} & set(plain)


# -- the real model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime() -> Iterator[Runtime]:
    with Runtime(keep_alive=None, prefix_cache=False) as rt:
        rt.load(str(default_model_path()))
        yield rt


@pytest.mark.model
def test_the_sdk_returns_logprobs_only_when_asked(runtime: Runtime) -> None:
    model = next(iter(runtime.models.values()))
    with model.stream(USER, temperature=0, max_tokens=6) as plain:
        pieces = list(plain)
    assert all(type(p) is str for p in pieces)  # the plain path: plain strings
    assert plain.logprobs == []

    reply = model.complete(USER, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2)
    assert reply.text == "".join(pieces)
    assert len(reply.logprobs) == reply.usage.completion_tokens == 6
    assert "".join(t.token for t in reply.logprobs) == reply.text
    for t in reply.logprobs:
        assert t.logprob <= 0
        assert t.top[0].token == t.token  # greedy took the likeliest
        assert sum(math.exp(a.logprob) for a in t.top) <= 1 + 1e-6


@pytest.mark.model
def test_the_single_context_engine_refuses_what_it_cannot_do() -> None:
    engine = LlamaEngine(default_model_path(), n_ctx=512)
    try:
        for params, param in (
            ({"logprobs": True}, "logprobs"),
            ({"logit_bias": ((3, 1.0),)}, "logit_bias"),
        ):
            request = GenerationRequest(prompt="hi", sampling=SamplingParams(**params))  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument) as caught:
                engine.count_prompt_tokens(request)
            assert caught.value.param == param
        penalised = GenerationRequest(prompt="hi", sampling=SamplingParams(presence_penalty=1))
        assert engine.count_prompt_tokens(penalised) > 0
    finally:
        engine.close()


@pytest.mark.model
def test_a_reply_cut_inside_a_character_drops_the_unfinished_bytes(runtime: Runtime) -> None:
    """A reply cut at ``max_tokens`` between the tokens of one multi-byte character ends
    with the characters it finished, never with U+FFFD."""
    model = next(iter(runtime.models.values()))
    emoji = [{"role": "user", "content": "Reply with only emoji: 🌍🎉🐉🌊🔥"}]
    full = model.complete(emoji, temperature=0, max_tokens=12, logprobs=True)
    raw = [t.bytes for t in full.logprobs]
    cuts_inside = 0
    for k in range(1, len(raw) + 1):
        made = b"".join(raw[:k])
        finished = made.decode("utf-8", "ignore") if _ends_inside(made) else made.decode()
        cuts_inside += _ends_inside(made)
        reply = model.complete(emoji, temperature=0, max_tokens=k)
        assert "\ufffd" not in reply.text
        assert reply.text == finished
    assert cuts_inside > 0  # the prompt did make the model split a character


def _ends_inside(data: bytes) -> bool:
    """Whether ``data`` ends partway through a UTF-8 character."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.reason == "unexpected end of data"
    return False
