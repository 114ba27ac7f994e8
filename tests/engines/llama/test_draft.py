"""The prompt lookup (``_draft.py``): which earlier place a draft is taken from, the
acceptance it is weighed by, and why drafting was on or off. Pure Python, no model."""

from __future__ import annotations

from tokenbelt.engines.llama._draft import BANDS, PRIORS, Lookup, agreement, band_of

#: a passage the reply copies: each word a token; "the" and "river" come back often
PASSAGE = [1, 2, 3, 9, 4, 5, 6, 9, 7, 8, 9, 4, 5, 10, 11, 9, 4, 5, 12, 13]


def test_the_place_that_agrees_furthest_back_is_taken_not_the_latest() -> None:
    # The key (9, 4, 5) occurs three times; the sequence's end "7 8 9 4 5" agrees with the
    # second place for five tokens, with the latest for three.
    tokens = [*PASSAGE, 0, 7, 8, 9, 4, 5]
    lookup = Lookup()
    assert lookup.propose(tokens, 3) == [10, 11, 9]
    assert agreement(tokens, 13, len(tokens)) == 5
    assert lookup.band == band_of(5)


def test_a_longer_key_finds_a_place_that_a_common_pair_lost() -> None:
    # The pair (0, 1) occurs ten times: its latest ends crowd out the first one, which is
    # the only place "5 0 1" occurs.
    tokens = [5, 0, 1, 42, *([7, 0, 1] * 9), 5, 0, 1]
    assert Lookup().propose(tokens, 1) == [42]


def test_two_tokens_find_a_place_when_no_longer_key_does() -> None:
    tokens = [3, 4, 50, 51, 99, 3, 4]
    lookup = Lookup()
    assert lookup.propose(tokens, 2) == [50, 51]
    assert lookup.band == 0


def test_nothing_is_proposed_for_a_sequence_that_never_repeats() -> None:
    lookup = Lookup()
    assert lookup.propose(list(range(40)), 8) == []
    assert lookup.decision() == "nothing_to_copy"


def test_bands_follow_the_agreement() -> None:
    assert [band_of(n) for n in (2, 3, 5, 6, 16)] == [0, 1, 1, 2, 2]
    assert BANDS[0] == 2


def test_each_band_keeps_its_own_acceptance_from_its_prior() -> None:
    lookup = Lookup()
    start = [lookup.rate_of(b) for b in range(len(BANDS))]
    assert start == [a / (a + m) for a, m in PRIORS]
    for _ in range(10):
        lookup.observe(0, True, 0)  # drafts found by two tokens alone always miss
    assert lookup.rate_of(0) < 0.1
    assert [lookup.rate_of(b) for b in (1, 2)] == start[1:]


def test_a_shadow_draft_is_settled_in_the_band_it_was_found_in() -> None:
    lookup = Lookup()
    tokens = [*PASSAGE, 0, 7, 8, 9, 4, 5]
    draft = lookup.propose(tokens, 3)
    band = lookup.band
    lookup.shadow(tokens, draft)
    lookup.band = 0  # a later proposal's band does not take the shadow's count
    before = lookup.rate_of(band)
    lookup.settle([*tokens, 10, 11, 9])  # sampled as drafted: three accepted, no miss
    assert lookup.rate_of(band) > before
    assert lookup.decision() == "no_gain"  # found, turned down by the costs, never verified


def test_a_verified_draft_makes_the_decision_on() -> None:
    lookup = Lookup()
    lookup.drafted, lookup.accepted = 4, 3
    assert lookup.decision() == "on"
