"""``LlamaConfig``: one checked record from the command line to the worker, no model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tokenbelt import InvalidArgument, Runtime
from tokenbelt.cli import build_parser
from tokenbelt.cli._serve import _engine
from tokenbelt.engines import LlamaConfig, cache_tokens_for, context_that_fits
from tokenbelt.engines.worker._messages import Load, decode, encode


def test_the_defaults_are_the_engines_own() -> None:
    config = LlamaConfig()
    assert (config.slots, config.n_ctx, config.kv_type, config.flash_attn) == (
        4,
        4096,
        "f16",
        "auto",
    )
    assert config.prefix_cache
    assert not LlamaConfig(cache_entries=0).prefix_cache


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"kv_type": "q4"}, "kv_type"),
        ({"flash_attn": "sometimes"}, "flash_attn"),
        ({"kv_type": "q8_0", "flash_attn": "off"}, "needs flash attention"),
        ({"prefill_gap": -1.0}, "prefill_gap"),
        ({"draft": "medusa"}, "draft"),
        ({"slots": 0}, "slots"),
        ({"prefix_cache_disk": -1}, "prefix_cache_disk"),
        ({"decode_nice": 40}, "decode_nice"),
        ({"pooling": "maximum"}, "pooling"),
    ],
)
def test_a_setting_out_of_its_range_is_refused_when_it_is_made(
    options: dict[str, object], named: str
) -> None:
    with pytest.raises(InvalidArgument, match=named):
        LlamaConfig(**options)  # type: ignore[arg-type]


def test_of_refuses_an_unknown_option_by_name_and_checks_again() -> None:
    with pytest.raises(InvalidArgument, match="unknown engine option kv_cache"):
        LlamaConfig.of(kv_cache="q8_0")
    base = LlamaConfig(kv_type="q8_0")
    assert LlamaConfig.of(base, slots=2) == dataclasses.replace(base, slots=2)
    with pytest.raises(InvalidArgument, match="needs flash attention"):
        LlamaConfig.of(base, flash_attn="off")


def test_it_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        LlamaConfig().slots = 2  # type: ignore[misc]


def test_the_worker_receives_it_whole() -> None:
    config = LlamaConfig(
        slots=2, kv_type="q8_0", draft="lookup", prefix_cache_dir=Path("/tmp/x"), name="m"
    )
    got = decode(encode(Load("/models/m.gguf", config, None)))
    assert isinstance(got, Load)
    assert got.config == config
    assert got.config.name == "m"  # compared apart: a name does not change how it runs


def test_the_runtime_holds_one_from_its_keywords() -> None:
    with Runtime(kv_type="q8_0", prefix_cache=False, draft="lookup") as rt:
        # slots and n_ctx: the runtime's own defaults for each model it loads
        assert rt.engine == LlamaConfig(slots=1, kv_type="q8_0", cache_entries=0, draft="lookup")
    with pytest.raises(InvalidArgument, match="unknown engine option kv_cache"):
        Runtime(kv_cache="q8_0")
    given = LlamaConfig(prefill_chunk=64)
    with Runtime(engine=given, decode_nice=0, slots=2) as rt:
        assert rt.engine == dataclasses.replace(given, decode_nice=0, slots=2)


def test_a_models_own_settings_in_the_engines_configuration_are_refused_not_dropped() -> None:
    # Each load sets slots and n_ctx from Runtime(...) or load(...): a configuration that
    # says otherwise would be overridden in silence.
    with pytest.raises(InvalidArgument, match=r"give Runtime\(slots=\.\.\.\)") as refused:
        Runtime(engine=LlamaConfig(slots=3))
    assert refused.value.param == "slots"
    with pytest.raises(InvalidArgument, match="n_ctx is each model's own"):
        Runtime(engine=LlamaConfig(n_ctx=512))
    with Runtime(slots=3, n_ctx=512, engine=LlamaConfig(slots=3, n_ctx=512)) as rt:
        assert (rt.engine.slots, rt.engine.n_ctx) == (3, 512)


def test_serves_flags_make_the_engines_configuration() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--kv-type",
            "q8_0",
            "--flash-attn",
            "on",
            "--draft",
            "lookup",
            "--threads",
            "1",
            "--prefill-gap",
            "0",
            "--cache-tokens",
            "2048",
            "--cache-reuse",
            "0",
            "--decode-nice",
            "3",
            "--force-n-ctx",
        ]
    )
    config = _engine(args)
    assert (config.kv_type, config.flash_attn, config.draft) == ("q8_0", "on", "lookup")
    assert (config.n_threads, config.prefill_gap, config.cache_tokens) == (1, 0.0, 2048)
    assert (config.decode_nice, config.force_n_ctx, config.cache_reuse) == (3, True, 0)
    # Not given: the engine's own defaults, not a second copy of them in the CLI.
    plain = _engine(build_parser().parse_args(["serve"]))
    assert dataclasses.replace(plain, prefix_cache_dir=None) == LlamaConfig()


def test_a_context_not_given_is_the_trained_one_while_its_kv_cache_fits_a_gibibyte() -> None:
    """The default model (22.5 KiB a token): 4 slots of its 8,192 take 720 MiB, so they
    stay; 8 slots would take 1.4 GiB, so each gets the most whole 256 tokens that fit;
    never less than 4,096 (nor more than the model was trained on)."""
    cell = 30 * 3 * (64 + 64) * 2
    assert context_that_fits(8192, 4, cell) == 8192
    assert context_that_fits(8192, 8, cell) == 5632
    assert 8 * 5632 * cell <= 1 << 30 < 8 * 5888 * cell
    assert context_that_fits(8192, 64, cell) == 4096
    assert context_that_fits(2048, 64, cell) == 2048
    assert context_that_fits(None, 1, cell) == 4096


def test_a_prefix_cache_not_given_holds_a_gibibyte_of_the_models_cells() -> None:
    cell = 30 * 3 * (64 + 64) * 2
    assert cache_tokens_for(None, cell) == (1 << 30) // cell == 46603
    assert cache_tokens_for(None, 1 << 20) == 4096  # a large model's cells: at least 4,096
    assert cache_tokens_for(512, cell) == 512  # given: the user's
