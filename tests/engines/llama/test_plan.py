"""The batch engine's step plan, without a model: step costs, prompt chunks beside
decoding streams, belts without room, prompt-lookup drafts, a thinking deadline's end
marker, who waits for a shared prefix and who retires.

Every sequence is a real ``Sequence`` on a real belt; times are given, not measured.
"""

from __future__ import annotations

import pytest

from tokenbelt import GenerationRequest, SamplingParams
from tokenbelt.belt import Belt, EndReason
from tokenbelt.engines.llama._draft import BANDS, Lookup
from tokenbelt.engines.llama._plan import (
    FIRST_SHARED_TOKENS,
    MAX_CREDIT_S,
    PROMPT_TIMED_TOKENS,
    Plan,
    StepCosts,
    StepPlan,
    TimeShare,
    common_prefix,
    follows,
    retiring,
)
from tokenbelt.engines.llama._reasoning import ANSWER, REASONING, ReasoningFormat
from tokenbelt.engines.llama._sequence import Sequence

CONTEXT = 4096
FMT = ReasoningFormat("<think>", "</think>", (7, 8), toggle=False, efforts=False)
#: a prompt whose end (10, 11) and first sampled token (12) repeat its start: a lookup
#: proposes what followed, 13, 14, 15, ...
ECHO = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 50, 10, 11]


def make_seq(
    prompt: int | list[int],
    *,
    capacity: int = 16,
    max_tokens: int = 256,
    seq_id: int = 0,
    cached: int = 0,
) -> Sequence:
    """An admitted sequence on its own belt: ``prompt`` tokens (a count: distinct ids),
    ``cached`` of them already in the KV cache."""
    belt: Belt[str] = Belt(capacity)
    request = GenerationRequest(prompt="p", sampling=SamplingParams(max_tokens=max_tokens))
    seq = Sequence(request, belt.producer, lambda: None)
    tokens = list(range(1000, 1000 + prompt)) if isinstance(prompt, int) else list(prompt)
    seq.set_prompt(tokens, CONTEXT)
    seq.id = seq_id
    seq.n_past = cached
    return seq


def decoding(seq: Sequence, token: int = 1, raw: bytes = b"x") -> Sequence:
    """``seq`` with its prompt computed and a first token sampled (pending decode)."""
    seq.n_past = len(seq.tokens)
    assert seq.accept(token, raw, end=False).end is None
    assert seq.decoding
    return seq


def fill(seq: Sequence) -> None:
    """A reader that has not read: the sequence's belt is full."""
    while seq.producer.has_room():
        seq.producer.put_nowait("t")


def drafting(seq: Sequence) -> Sequence:
    """Prompt-lookup drafting on, with an acceptance rate near 1 in every band."""
    seq.lookup = Lookup()
    for band in range(len(BANDS)):
        for _ in range(20):
            seq.lookup.observe(8, False, band)
        assert seq.lookup.rate_of(band) > 0.99
    return seq


def prompt_costs() -> StepCosts:
    """A prompt token measured at 1/1024 s (exact in binary)."""
    costs = StepCosts()
    costs.record(128, 0.125, prefill=True)
    assert costs.prompt == 1 / 1024
    return costs


def planner(
    costs: StepCosts | None = None,
    *,
    n_batch: int = 512,
    slots: int = 4,
    prefill_chunk: int = 16,
    prefill_gap: float = 0.0625,
    draft_tokens: int = 8,
) -> StepPlan:
    return StepPlan(
        n_batch=n_batch,
        slots=slots,
        prefill_chunk=prefill_chunk,
        prefill_gap=prefill_gap,
        draft_tokens=draft_tokens,
        costs=costs if costs is not None else StepCosts(),
    )


def shape(plan: Plan) -> list[tuple[Sequence, int, list[int]]]:
    return [(r.seq, r.k, r.draft) for r in plan.rows]


# -- StepCosts ------------------------------------------------------------------------------


def test_costs_keep_a_moving_average_per_small_size_and_time_prompts_in_big_prefills() -> None:
    costs = StepCosts()
    assert costs.step(1) is None  # nothing timed yet
    costs.record(1, 0.010, prefill=False)
    costs.record(1, 0.020, prefill=False)
    assert costs.steps[1] == pytest.approx(0.8 * 0.010 + 0.2 * 0.020)
    # A small prefill is no prompt rate (mostly fixed costs), nor a step size: its rows
    # have no logits but the last, a draft's all do.
    costs.record(PROMPT_TIMED_TOKENS - 1, 0.063, prefill=True)
    assert costs.prompt is None
    assert PROMPT_TIMED_TOKENS - 1 not in costs.steps
    costs.record(PROMPT_TIMED_TOKENS - 1, 0.090, prefill=False)
    assert costs.steps[PROMPT_TIMED_TOKENS - 1] == pytest.approx(0.090)
    # A big step that read no prompt (drafts, many streams) is no prompt rate either.
    costs.record(128, 1.0, prefill=False)
    assert costs.prompt is None
    assert 128 not in costs.steps  # too big to be timed per size
    costs.record(128, 0.256, prefill=True)
    assert costs.prompt == pytest.approx(0.002)
    costs.record(256, 0.256, prefill=True)
    assert costs.prompt == pytest.approx(0.8 * 0.002 + 0.2 * 0.001)


def test_costs_interpolate_between_timed_sizes_and_extend_past_them() -> None:
    costs = StepCosts()
    costs.record(1, 0.010, prefill=False)
    costs.record(5, 0.030, prefill=False)
    costs.record(9, 0.034, prefill=False)
    assert costs.step(5) == pytest.approx(0.030)  # as timed
    assert costs.step(3) == pytest.approx(0.020)  # between 1 and 5
    assert costs.step(7) == pytest.approx(0.032)  # between 5 and 9
    assert costs.step(13) == pytest.approx(0.038)  # past 9: the line through 5 and 9
    # Below the smallest size timed: the line through the two smallest.
    small = StepCosts()
    small.record(4, 0.020, prefill=False)
    small.record(8, 0.028, prefill=False)
    assert small.step(2) == pytest.approx(0.016)
    # A bigger step that was timed faster never makes a step cheaper than a smaller one.
    odd = StepCosts()
    odd.record(2, 0.020, prefill=False)
    odd.record(4, 0.010, prefill=False)
    assert odd.step(3) == pytest.approx(0.020)


def test_costs_with_a_single_size_timed_charge_half_a_step_per_extra_token() -> None:
    costs = StepCosts()
    costs.record(1, 0.010, prefill=False)
    assert costs.step(1) == pytest.approx(0.010)
    assert costs.step(3) == pytest.approx(0.020)
    assert costs.step(9) == pytest.approx(0.050)
    other = StepCosts()
    other.record(3, 0.040, prefill=False)
    assert other.step(7) == pytest.approx(0.080)


def test_costs_cap_a_step_at_its_tokens_one_at_a_time() -> None:
    """A size timed while the machine stalled must not keep drafts of it off for good."""
    costs = StepCosts()
    costs.record(1, 0.010, prefill=False)
    costs.record(4, 0.200, prefill=False)  # a stall
    assert costs.step(4) == pytest.approx(0.040)  # capped, though timed
    assert costs.step(3) == pytest.approx(0.030)  # interpolated, then capped
    assert costs.step(8) == pytest.approx(0.080)
    costs.record(2, 0.012, prefill=False)
    assert costs.step(2) == pytest.approx(0.012)  # under the cap: as timed


# -- prompt chunks ----------------------------------------------------------------------------


def test_prompt_chunk_is_what_the_measured_rate_fits_in_the_gap() -> None:
    assert planner().prompt_chunk() == 16  # nothing measured: prefill_chunk
    assert planner(prompt_costs()).prompt_chunk() == 64  # 0.0625 s at 1/1024 s a token
    # A slow prompt rate never gives less than prefill_chunk.
    assert planner(prompt_costs(), prefill_chunk=100).prompt_chunk() == 100
    # A gap of 0 turns the measured rate off.
    assert planner(prompt_costs(), prefill_gap=0.0).prompt_chunk() == 16
    # At most a batch with a row for every slot.
    assert planner(prompt_costs(), prefill_gap=10.0, n_batch=512, slots=4).prompt_chunk() == 508


def test_a_prompt_beside_decoding_streams_gets_the_chunk_less_their_rows() -> None:
    a, b = decoding(make_seq(5, seq_id=0)), decoding(make_seq(5, seq_id=1))
    new = make_seq(500, seq_id=2)
    later = make_seq(500, seq_id=3)
    plan = planner(prompt_costs()).rows([a, b, new, later], 100.0)
    assert shape(plan) == [(a, 1, []), (b, 1, []), (new, 62, [])]
    assert plan.n_tokens == 64
    assert plan.waiting == []
    assert [r.samples for r in plan.rows] == [True, True, False]


def test_prompt_chunks_beside_decoding_follow_admission_order_and_share_the_chunk() -> None:
    a = decoding(make_seq(5, seq_id=0))
    short = make_seq(20, seq_id=1, cached=10)  # 10 tokens left: its last chunk
    long = make_seq(500, seq_id=2)
    plan = planner(prompt_costs()).rows([a, short, long], 100.0)
    assert shape(plan) == [(a, 1, []), (short, 10, []), (long, 53, [])]
    assert [r.samples for r in plan.rows] == [True, True, False]


def test_nothing_decoding_gives_the_prompts_up_to_n_batch() -> None:
    first = make_seq(300, seq_id=0, cached=100)
    second = make_seq(400, seq_id=1)
    plan = planner(prompt_costs(), n_batch=512).rows([first, second], 100.0)
    assert shape(plan) == [(first, 200, []), (second, 312, [])]
    assert plan.n_tokens == 512
    assert [r.samples for r in plan.rows] == [True, False]


def test_a_full_belt_leaves_its_sequence_out_and_lists_it_as_waiting() -> None:
    slow = decoding(make_seq(5, seq_id=0, capacity=2))
    fast = decoding(make_seq(5, seq_id=1))
    fill(slow)
    plan = planner().rows([slow, fast], 100.0)
    assert shape(plan) == [(fast, 1, [])]
    assert plan.waiting == [slow]


def test_a_prompt_whose_last_chunk_would_sample_waits_for_room() -> None:
    ending = make_seq(30, seq_id=0, capacity=1)
    going = make_seq(600, seq_id=1, capacity=1)
    fill(ending)
    fill(going)
    plan = planner(n_batch=512).rows([ending, going], 100.0)
    # The chunk that does not reach its prompt's end puts nothing: it is computed.
    assert shape(plan) == [(going, 512, [])]
    assert plan.waiting == [ending]


def test_unadmitted_and_cancelled_sequences_get_no_row() -> None:
    queued = make_seq(50, seq_id=-1)
    stopped = decoding(make_seq(5, seq_id=1))
    stopped.cancelled = True
    running = decoding(make_seq(5, seq_id=2))
    plan = planner().rows([queued, stopped, running], 100.0)
    assert shape(plan) == [(running, 1, [])]
    assert plan.waiting == []
    assert planner().rows([queued, stopped], 100.0).rows == []


# -- drafts -------------------------------------------------------------------------------------


def cheap_drafts(costs: StepCosts | None = None) -> StepCosts:
    """Steps that cost about the same whatever their size (a GPU's small batches)."""
    costs = costs if costs is not None else StepCosts()
    costs.record(1, 0.010, prefill=False)
    costs.record(16, 0.012, prefill=False)
    return costs


def test_a_draft_goes_in_when_it_pays() -> None:
    seq = drafting(decoding(make_seq(ECHO), token=12))
    plan = planner(cheap_drafts(), draft_tokens=8).rows([seq], 100.0)
    assert shape(plan) == [(seq, 1, [13, 14, 15, 16, 17, 18, 19, 50])]
    assert seq.draft == [13, 14, 15, 16, 17, 18, 19, 50]
    assert plan.n_tokens == 9
    assert plan.rows[0].samples


def test_no_draft_when_each_token_costs_a_whole_step() -> None:
    costs = StepCosts()
    costs.record(1, 0.010, prefill=False)
    costs.record(16, 0.160, prefill=False)  # a CPU: a step's cost grows with its tokens
    seq = drafting(decoding(make_seq(ECHO), token=12))
    seq.draft = [99]  # a stale draft is replaced
    plan = planner(costs).rows([seq], 100.0)
    assert shape(plan) == [(seq, 1, [])]
    assert seq.draft == []
    assert plan.n_tokens == 1


def test_a_later_draft_is_weighed_against_the_step_with_the_earlier_drafts() -> None:
    # Steps cost about the same up to 10 tokens and much more past them: one sequence's
    # draft of 8 pays beside another's plain row, a second draft in the same step does not.
    costs = StepCosts()
    costs.record(2, 0.010, prefill=False)
    costs.record(10, 0.011, prefill=False)
    costs.record(11, 0.030, prefill=False)
    first = drafting(decoding(make_seq(ECHO, seq_id=0), token=12))
    second = drafting(decoding(make_seq(ECHO, seq_id=1), token=12))
    plan = planner(costs, slots=2).rows([first, second], 100.0)
    assert shape(plan) == [(first, 1, [13, 14, 15, 16, 17, 18, 19, 50]), (second, 1, [])]
    assert plan.n_tokens == 10


def test_where_rows_are_dear_a_sequence_drafts_alone_but_not_beside_others() -> None:
    # The default model on 2 cores: 2 rows 1.74 times one, 4 rows 2.71, 8 rows 4.5.
    costs = StepCosts()
    for n, ms in ((1, 10.0), (2, 17.4), (4, 27.1), (8, 45.0)):
        costs.record(n, ms / 1000, prefill=False)
    alone = drafting(decoding(make_seq(ECHO, seq_id=0), token=12))
    assert planner(costs).rows([alone], 100.0).rows[0].draft
    first = drafting(decoding(make_seq(ECHO, seq_id=0), token=12))
    second = drafting(decoding(make_seq(ECHO, seq_id=1), token=12))
    plan = planner(costs, slots=2).rows([first, second], 100.0)
    assert shape(plan) == [(first, 1, []), (second, 1, [])]


def test_a_draft_fits_the_belt_room_and_the_reply_length() -> None:
    roomy = drafting(decoding(make_seq(ECHO, capacity=4), token=12))
    # Every accepted token and the correction go on the belt in the same step.
    assert shape(planner(cheap_drafts()).rows([roomy], 100.0)) == [(roomy, 1, [13, 14, 15])]
    short = drafting(decoding(make_seq(ECHO, max_tokens=4), token=12))
    # One token produced of four: two drafted, then the correction is the fourth.
    assert shape(planner(cheap_drafts()).rows([short], 100.0)) == [(short, 1, [13, 14])]


def test_a_draft_leaves_a_row_for_every_later_sequence() -> None:
    first = drafting(decoding(make_seq(ECHO, seq_id=0), token=12))
    second = drafting(decoding(make_seq(ECHO, seq_id=1), token=12))
    plan = planner(cheap_drafts(), n_batch=6, slots=2).rows([first, second], 100.0)
    assert shape(plan) == [(first, 1, [13, 14, 15, 16]), (second, 1, [])]
    assert plan.n_tokens == 6


def test_drafts_do_not_take_the_prompts_share() -> None:
    seq = drafting(decoding(make_seq(ECHO, seq_id=0), token=12))
    new = make_seq(500, seq_id=1)
    plan = planner(cheap_drafts(prompt_costs())).rows([seq, new], 100.0)
    # The prompt chunk is 64 tokens: 63 beside the one decode row, the draft aside.
    assert shape(plan) == [(seq, 1, [13, 14, 15, 16, 17, 18, 19, 50]), (new, 63, [])]
    assert plan.n_tokens == 72


def test_drafts_and_prompts_stay_within_the_batch() -> None:
    seq = drafting(decoding(make_seq(ECHO, seq_id=0), token=12))
    new = make_seq(500, seq_id=1)
    plan = planner(cheap_drafts(prompt_costs()), n_batch=40, slots=2).rows([seq, new], 100.0)
    # The chunk is capped at 38; the draft's 8 rows leave 31 of the batch's 40.
    assert shape(plan) == [(seq, 1, [13, 14, 15, 16, 17, 18, 19, 50]), (new, 31, [])]
    assert plan.n_tokens == 40


# -- a thinking deadline ----------------------------------------------------------------------


def thinking(seq_id: int = 0) -> Sequence:
    """A decoding sequence inside its reasoning (the prompt opened it)."""
    seq = make_seq(5, seq_id=seq_id)
    seq.open_phases(FMT, "<|assistant|><think>\n", {}, CONTEXT, lambda s: None)
    decoding(seq, token=40, raw=b"Hmm")
    assert seq.phases is not None
    assert seq.phases.state == REASONING
    return seq


def one_size_timed() -> StepCosts:
    """step(n) = 0.005 * (n + 1): a marker step of 1 + 2 tokens takes 0.02 s."""
    costs = StepCosts()
    costs.record(1, 0.010, prefill=False)
    return costs


def test_marker_lead_is_a_plain_step_and_the_marker_step_beside_the_others() -> None:
    plan = planner(one_size_timed())
    seq = thinking()
    assert plan.marker_lead(seq, 1) == pytest.approx(0.010 + 0.020)
    assert plan.marker_lead(seq, 2) == pytest.approx(0.015 + 0.025)
    assert plan.marker_lead(decoding(make_seq(5)), 1) == 0.0  # no reasoning format


def test_a_thinking_deadline_within_the_lead_appends_the_end_marker() -> None:
    seq = thinking()
    seq.think_until = 100.025  # the lead is 0.03 s
    pending = seq.tokens[-1]
    plan = planner(one_size_timed()).rows([seq], 100.0)
    assert seq.tokens[-3:] == [pending, 7, 8]
    assert shape(plan) == [(seq, 3, [])]
    assert plan.rows[0].samples
    assert seq.think_until is None
    assert seq.phases is not None
    assert seq.phases.state == ANSWER
    assert seq.producer.trace.reasoning_ended_by == "deadline"


def test_a_thinking_deadline_past_the_lead_waits_for_a_later_step() -> None:
    seq = thinking()
    seq.think_until = 100.035
    plan = planner(one_size_timed()).rows([seq], 100.0)
    assert shape(plan) == [(seq, 1, [])]
    assert seq.tokens[-1] == 40
    assert seq.think_until == 100.035
    assert seq.producer.trace.reasoning_ended_by is None


def test_the_lead_grows_with_the_streams_decoding_beside() -> None:
    seq, other = thinking(0), decoding(make_seq(5, seq_id=1))
    seq.think_until = 100.035  # past one stream's lead (0.03 s), within two's (0.04 s)
    plan = planner(one_size_timed()).rows([seq, other], 100.0)
    assert shape(plan) == [(seq, 3, []), (other, 1, [])]
    assert seq.tokens[-2:] == [7, 8]


# -- follows, retiring ----------------------------------------------------------------------------

SHARED = list(range(1, 11))


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([5], [1]) == 0
    assert common_prefix([], [1]) == 0


def test_follows_waits_for_a_leader_computing_the_shared_prefix() -> None:
    leader = make_seq([*SHARED, 20], seq_id=0)
    seq = make_seq([*SHARED, 30], seq_id=-1)
    assert follows(seq, [leader, seq])
    leader.n_past = 4
    assert follows(seq, [leader, seq])
    leader.n_past = 10  # the shared cells are there to copy
    assert not follows(seq, [leader, seq])


def test_follows_the_same_prompt_up_to_its_last_token() -> None:
    leader = make_seq([*SHARED, 20], seq_id=0, cached=9)
    seq = make_seq([*SHARED, 20], seq_id=-1)
    assert follows(seq, [leader, seq])
    leader.n_past = 10  # the last token is computed by the sequence itself
    assert not follows(seq, [leader, seq])


def test_follows_does_not_wait_for_a_leader_waiting_for_room() -> None:
    leader = make_seq([*SHARED, 20], seq_id=0, capacity=1)
    seq = make_seq([*SHARED, 30], seq_id=-1)
    fill(leader)
    leader.waiting_room = True
    assert not follows(seq, [leader, seq])


def test_follows_does_not_wait_for_a_stopped_queued_or_decoding_leader() -> None:
    seq = make_seq([*SHARED, 30], seq_id=-1)
    queued = make_seq([*SHARED, 20], seq_id=-1)
    stopped = make_seq([*SHARED, 20], seq_id=0)
    stopped.cancelled = True
    other = make_seq([99, 98, 97], seq_id=1)
    assert not follows(seq, [queued, stopped, other, seq])
    leader = decoding(make_seq([*SHARED, 20], seq_id=2))
    leader.n_past = 3  # a decoding sequence's cells went back (an aborted step)
    assert not follows(seq, [leader, seq])


def test_retiring_caches_a_stopped_or_ended_sequence_but_not_a_failed_one() -> None:
    stopped = make_seq(5, seq_id=0)
    stopped.cancelled = True  # the engine's mark; its belt ends with the stop
    belt_stopped = make_seq(5, seq_id=1)
    assert belt_stopped.producer.cancel(EndReason.USER_CANCEL)
    failed = make_seq(5, seq_id=2)
    assert failed.producer.fail(RuntimeError("decode failed"))
    ended = decoding(make_seq(5, seq_id=3))
    assert ended.producer.finish(EndReason.LENGTH)
    running = decoding(make_seq(5, seq_id=4))
    assert retiring([stopped, belt_stopped, failed, running, ended]) == [
        (stopped, True),
        (belt_stopped, True),
        (failed, False),
        (ended, True),
    ]
    assert retiring([running]) == []


# -- embeddings' time share beside chat ----------------------------------------------------


def test_without_chat_work_embeddings_take_a_whole_ubatch_and_lose_their_credit() -> None:
    share = TimeShare()
    share.budget(0.2, cap=128, whole=512)
    assert share.credit == pytest.approx(0.2)
    assert share.budget(None, cap=128, whole=512) == 512
    assert share.credit == 0.0


def test_the_first_shared_ubatch_is_small_until_a_cost_is_measured() -> None:
    share = TimeShare()
    assert share.budget(0.01, cap=128, whole=512) == FIRST_SHARED_TOKENS
    assert share.budget(0.01, cap=8, whole=512) == 8  # never past the cap


def test_credit_buys_tokens_at_the_measured_cost_within_the_cap() -> None:
    share = TimeShare()
    share.spent(1 / 16, 64)  # 1/1024 s a token (binary fractions: exact sums)
    assert share.per_token == 1 / 1024
    # 1/8 s of chat, less the 1/16 s just spent: 64 tokens' worth
    assert share.budget(1 / 8, cap=128, whole=512) == 64
    assert share.budget(0.5, cap=128, whole=512) == 128
    share.spent(1 / 512, 1)  # a dearer token moves the average by three tenths
    assert share.per_token == pytest.approx(0.7 / 1024 + 0.3 / 512)


def test_credit_is_capped_and_an_overdraw_runs_chat_alone_until_repaid() -> None:
    share = TimeShare()
    for _ in range(100):
        share.budget(0.1, cap=512, whole=512)
    assert share.credit == MAX_CREDIT_S
    share.spent(1.0, 100)  # one long input overdrew the credit
    assert share.budget(0.1, cap=512, whole=512) == 0
    assert share.budget(0.5, cap=512, whole=512) > 0
