"""Fill-in-the-middle prompts from the model's own FIM tokens, laid out as llama.cpp's
server lays them out (the vocabulary alone: no weights are loaded)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest

from tokenbelt import InvalidArgument
from tokenbelt.engines import Infill
from tokenbelt.engines.llama import Prompts, load_vocab
from tokenbelt.models import default_model_path


class Vocab(Prompts):
    """A model file's prompts over its vocabulary alone (as a worker's parent has them)."""

    def __init__(self, path: Path, name: str) -> None:
        self.vocab_model = load_vocab(path)
        super().__init__(
            llama_cpp, self.vocab_model, name=name, context_length=256, reasoning=False
        )

    def close(self) -> None:
        self.vocab_model.close()


@pytest.fixture(scope="module")
def fim(fim_gguf: Path) -> Iterator[Vocab]:
    prompts = Vocab(fim_gguf, "smollm2-fim")
    yield prompts
    prompts.close()


def text(prompts: Vocab, tokens: tuple[int, ...]) -> str:
    said: bytes = prompts.vocab_model.detokenize(list(tokens), special=True)
    return said.decode()


def test_the_vocabulary_names_its_fim_tokens(fim: Vocab) -> None:
    assert fim.fim_tokens == {"pre": 8, "suf": 9, "mid": 10, "rep": 3, "sep": 5}


def test_prefix_suffix_middle_with_the_repository_layout(fim: Vocab) -> None:
    infill = Infill(
        "def add(a, b):\n",
        "\nprint(add(1, 2))\n",
        extra=(("util.py", "X = 1\n"), {"filename": "b.py", "text": "Y = 2\n"}),  # type: ignore[arg-type]
        middle="    ret",
    )
    prompt = fim.infill(infill, max_tokens=16)
    assert not prompt.truncated
    assert text(fim, prompt.tokens) == (
        "<repo_name>myproject\n<file_sep>util.py\nX = 1\n<file_sep>b.py\nY = 2\n"
        "<file_sep>filename\n<issue_start>def add(a, b):\n    ret"
        "<issue_comment>\nprint(add(1, 2))\n<issue_closed>"
    )


def test_suffix_prefix_middle(fim: Vocab) -> None:
    prompt = fim.infill(Infill("a = ", "\nb = 2", order="spm"), max_tokens=16)
    said = text(fim, prompt.tokens)
    assert said.endswith("<issue_comment>\nb = 2<issue_start>a = <issue_closed>")


def test_a_long_file_keeps_the_prefix_end_and_the_suffix_start(fim: Vocab) -> None:
    lines = [f"line_{i} = {i}\n" for i in range(200)]
    infill = Infill("".join(lines), "".join(lines), extra=(("x.py", "".join(lines)),))
    prompt = fim.infill(infill, max_tokens=32)
    assert prompt.truncated
    assert len(prompt.tokens) + 32 <= 256
    said = text(fim, prompt.tokens)
    assert "line_199 = 199\n<issue_comment>line_0 = 0\n" in said
    assert said.endswith("<issue_closed>")


def test_a_model_without_fim_tokens_is_refused_naming_what_it_lacks() -> None:
    plain = Vocab(Path(default_model_path()), "smollm2")
    try:
        assert "pre" not in plain.fim_tokens
        with pytest.raises(InvalidArgument) as caught:
            plain.infill(Infill("a", "b"), max_tokens=8)
    finally:
        plain.close()
    assert caught.value.param == "suffix"
    assert "smollm2 cannot fill in the middle" in str(caught.value)
    assert "no FIM prefix, suffix, middle tokens" in str(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prefix": 3}, "prefix"),
        ({"order": "mps"}, "order"),
        ({"extra": [("a.py",)]}, "extra"),
        ({"extra": "a.py"}, "extra"),
    ],
)
def test_bad_infills_name_their_parameter(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        Infill(**kwargs)  # type: ignore[arg-type]
    assert caught.value.param == param
