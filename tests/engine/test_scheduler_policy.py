"""Scheduler policy, step by step, without a model (tests/engine/sched_driver.py).

Each test pins down which chunks a step schedules (request, first position, tokens)
and checks the generated tokens against the fake model's reference, so a policy
change shows up both as a different schedule and, where KV went missing, as
different tokens.
"""
from __future__ import annotations

from kvrelay.disagg.params import KVTransferParams
from kvrelay.engine.request import Status
from kvrelay.engine.scheduler import KVLoad
from tests.engine.sched_driver import (
    BLOCK,
    FakeForward,
    chunks_of,
    make_scheduler,
    reference,
    request,
    run_to_completion,
    step,
)

A_PROMPT = list(range(1, 11))          # 10 tokens
B_PROMPT = list(range(20, 30))         # 10 tokens, no block in common with A


def _add(scheduler, *requests):
    for r in requests:
        scheduler.add(r)
    return requests


def _assert_reference(*requests):
    for r in requests:
        want = reference(r.prompt_token_ids, r.params.max_tokens)
        assert r.output_token_ids == want, r.request_id


# -- token budget and chunked prefill ----------------------------------------------------

def test_token_budget_chunks_prefills_and_running_requests_go_first():
    s = make_scheduler(32, budget=8)
    fwd = FakeForward(s)
    a, b = _add(s, request("A", A_PROMPT, max_tokens=3), request("B", B_PROMPT, max_tokens=3))
    steps = [chunks_of(step(s, fwd)[0]) for _ in range(5)]
    assert steps == [
        [("A", 0, 8)],                      # the budget ends A's first chunk; B waits
        [("A", 8, 2), ("B", 0, 6)],         # A (running) first, B gets the rest of the budget
        [("A", 10, 1), ("B", 6, 4)],        # decodes lead the step
        [("A", 11, 1), ("B", 10, 1)],
        [("B", 11, 1)],                     # A finished at 3 tokens
    ]
    assert not s.has_unfinished
    _assert_reference(a, b)
    s.kv.assert_no_leaks()


def test_one_token_chunks_lead_the_step_whatever_the_queue_order():
    # the runner attends the leading one-token chunks as one decode batch
    s = make_scheduler(32, budget=8)
    fwd = FakeForward(s)
    a, c = _add(s, request("A", A_PROMPT, max_tokens=2), request("C", [42], max_tokens=2))
    assert chunks_of(step(s, fwd)[0]) == [("A", 0, 8)]
    assert chunks_of(step(s, fwd)[0]) == [("C", 0, 1), ("A", 8, 2)]
    run_to_completion(s, fwd)
    _assert_reference(a, c)
    s.kv.assert_no_leaks()


def test_a_long_prompt_is_computed_in_budget_sized_chunks():
    s = make_scheduler(32, budget=8)
    fwd = FakeForward(s)
    (a,) = _add(s, request("A", list(range(3, 24)), max_tokens=2))     # 21 tokens
    outs = run_to_completion(s, fwd)
    assert [chunks_of(o) for o in outs] == [[("A", 0, 8)], [("A", 8, 8)], [("A", 16, 5)],
                                            [("A", 21, 1)]]
    _assert_reference(a)
    s.kv.assert_no_leaks()


def test_chunks_that_continue_a_prefix_go_before_prompts_from_zero():
    # attention computes the fresh chunks that close a step over their own keys
    s = make_scheduler(32, budget=8)
    fwd = FakeForward(s)
    a, b, c = _add(s, request("A", [1, 2], max_tokens=3), request("B", A_PROMPT, max_tokens=2),
                   request("C", [40, 41, 42], max_tokens=2))
    assert chunks_of(step(s, fwd)[0]) == [("A", 0, 2), ("B", 0, 6)]
    assert chunks_of(step(s, fwd)[0]) == [("A", 2, 1), ("B", 6, 4), ("C", 0, 3)]
    run_to_completion(s, fwd)
    _assert_reference(a, b, c)
    s.kv.assert_no_leaks()


def test_a_prefix_hit_orders_as_a_continued_chunk():
    s = make_scheduler(32, budget=64)
    fwd = FakeForward(s)
    (first,) = _add(s, request("A", A_PROMPT, max_tokens=1))
    run_to_completion(s, fwd)
    d, e = _add(s, request("D", [70, 71, 72], max_tokens=1),
                request("E", A_PROMPT + [5], max_tokens=1))
    assert chunks_of(step(s, fwd)[0]) == [("E", 8, 3), ("D", 0, 3)]   # E from A's two blocks
    _assert_reference(first, d, e)
    s.kv.assert_no_leaks()


# -- without chunked prefill (the offline LLM's default) ------------------------------------

def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_for_the_next_step():
    s = make_scheduler(32, budget=16, chunked_prefill=False)
    fwd = FakeForward(s)
    a, b, c = _add(s, request("A", A_PROMPT, max_tokens=2), request("B", B_PROMPT, max_tokens=2),
                   request("C", [60, 61, 62], max_tokens=2))
    outs = run_to_completion(s, fwd)
    assert [chunks_of(o) for o in outs] == [
        [("A", 0, 10)],                     # B (10) does not fit in the 6 left: it and C wait
        [("A", 10, 1), ("B", 0, 10), ("C", 0, 3)],   # whole prompts, from position 0
        [("B", 10, 1), ("C", 3, 1)],
    ]
    _assert_reference(a, b, c)
    s.kv.assert_no_leaks()


def test_without_chunked_prefill_a_prompt_longer_than_any_step_is_still_chunked():
    s = make_scheduler(32, budget=8, chunked_prefill=False)
    fwd = FakeForward(s)
    a, b = _add(s, request("A", [70, 71], max_tokens=4), request("B", A_PROMPT, max_tokens=2))
    outs = run_to_completion(s, fwd)
    # B (10 tokens) can never fit whole in 8: it starts in the budget A leaves
    assert [chunks_of(o) for o in outs][:3] == [[("A", 0, 2), ("B", 0, 6)],
                                                [("A", 2, 1), ("B", 6, 4)],
                                                [("A", 3, 1), ("B", 10, 1)]]
    _assert_reference(a, b)
    s.kv.assert_no_leaks()


def test_without_chunked_prefill_the_running_requests_budget_counts():
    # 7 tokens would fit an empty step of 8, not one where A and B decode: chunked
    s = make_scheduler(32, budget=8, chunked_prefill=False)
    fwd = FakeForward(s)
    a, b, c = _add(s, request("A", [1, 2], max_tokens=5), request("B", [3, 4], max_tokens=5),
                   request("C", list(range(30, 37)), max_tokens=2))
    first, _ = step(s, fwd)
    assert chunks_of(first) == [("A", 0, 2), ("B", 0, 2), ("C", 0, 4)]
    run_to_completion(s, fwd)
    _assert_reference(a, b, c)
    s.kv.assert_no_leaks()


# -- max_num_seqs ----------------------------------------------------------------------

def test_max_num_seqs_bounds_the_running_set():
    s = make_scheduler(32, max_num_seqs=2)
    fwd = FakeForward(s)
    reqs = _add(s, *(request(n, [i + 1, i + 2, i + 3], max_tokens=2)
                     for i, n in enumerate("ABC")))
    outs = run_to_completion(s, fwd)
    assert [chunks_of(o) for o in outs] == [
        [("A", 0, 3), ("B", 0, 3)],         # C waits although budget and blocks are free
        [("A", 3, 1), ("B", 3, 1)],         # A and B finish (2 tokens each)
        [("C", 0, 3)],
        [("C", 3, 1)],
    ]
    _assert_reference(*reqs)
    s.kv.assert_no_leaks()


# -- preemption ------------------------------------------------------------------------

def test_the_newest_running_request_is_preempted_freed_and_resumed_identically():
    # 6 usable blocks; three 8-token prompts fill them; each first decode needs a block
    # (D waits behind max_num_seqs=3)
    s = make_scheduler(7, max_num_seqs=3, prefix_caching=False)
    fwd = FakeForward(s)
    a, b, c, d = _add(s, *(request(n, [10 * i + j for j in range(8)], max_tokens=4)
                           for i, n in enumerate("ABCD", start=1)))
    step(s, fwd)
    assert s.kv.pool.num_free == 0
    first_token = list(c.output_token_ids)
    out, _ = step(s, fwd)
    assert out.preempted == ["C"]                       # the newest, not the one that asked (A)
    assert chunks_of(out) == [("A", 8, 1), ("B", 8, 1)]  # nothing admitted in a preempting step
    assert c.status is Status.WAITING and list(s.waiting) == [c, d]   # ahead of later arrivals
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1 and s.num_preemptions == 1
    assert c.request_id not in s.kv.requests            # all its blocks went back to the pool
    assert s.kv.num_blocks_held("A") == 3 and s.kv.num_blocks_held("B") == 3
    assert c.output_token_ids == first_token            # its sampled token is kept

    outs = run_to_completion(s, fwd)
    resumed = next(chunk for o in outs for chunk in chunks_of(o) if chunk[0] == "C")
    assert resumed == ("C", 0, 9)                       # prompt + its token, recomputed
    _assert_reference(a, b, c, d)
    s.kv.assert_no_leaks()


def test_a_request_that_is_itself_the_newest_preempts_only_itself():
    # A and B (7 tokens) decode into their second block; C (8 tokens) needs a third block
    s = make_scheduler(7, prefix_caching=False)
    fwd = FakeForward(s)
    reqs = _add(s, request("A", list(range(1, 8)), max_tokens=3),
                request("B", list(range(11, 18)), max_tokens=3),
                request("C", list(range(21, 29)), max_tokens=3))
    step(s, fwd)
    out, _ = step(s, fwd)
    assert out.preempted == ["C"]
    assert chunks_of(out) == [("A", 7, 1), ("B", 7, 1)]
    assert [r.num_preemptions for r in reqs] == [0, 0, 1]
    run_to_completion(s, fwd)
    _assert_reference(*reqs)
    s.kv.assert_no_leaks()


def test_preempted_request_resumes_from_its_prefix_hit_with_identical_output():
    # with prefix caching a resumed request may start from cached blocks: same tokens
    s = make_scheduler(11)                                  # 10 blocks: C runs out at token 13
    fwd = FakeForward(s)
    reqs = _add(s, *(request(n, [10 * i + j for j in range(8)], max_tokens=6)
                     for i, n in enumerate("ABC", start=1)))
    outs = run_to_completion(s, fwd)
    assert [o.preempted for o in outs if o.preempted] == [["C"]]
    after = outs[next(i for i, o in enumerate(outs) if o.preempted) + 1:]
    resumed = next(chunk for o in after for chunk in chunks_of(o) if chunk[0] == "C")
    assert resumed == ("C", 8, 5)           # its two prompt blocks were still cached
    _assert_reference(*reqs)
    s.kv.assert_no_leaks()


# -- n > 1: siblings wait for the first one's prompt -------------------------------------

def test_sibling_waits_for_the_prompt_then_starts_from_its_cached_blocks():
    s = make_scheduler(32)
    fwd = FakeForward(s)
    first = request("0_X", A_PROMPT, max_tokens=3)
    child = request("1_X", A_PROMPT, max_tokens=3, fork_of=first)
    other = request("D", [50, 51, 52], max_tokens=3)
    _add(s, first, child, other)
    out, _ = step(s, fwd)
    assert chunks_of(out) == [("0_X", 0, 10), ("D", 0, 3)]   # the waiting child blocks no one
    out, _ = step(s, fwd)
    assert ("1_X", 8, 2) in chunks_of(out)                    # two whole blocks from the cache
    assert child.num_cached_tokens == 8
    assert s.kv.block_ids("1_X")[0][:2] == s.kv.block_ids("0_X")[0][:2]
    run_to_completion(s, fwd)
    _assert_reference(first, child, other)
    s.kv.assert_no_leaks()


def test_sibling_of_an_aborted_first_request_is_admitted():
    s = make_scheduler(32, budget=4)
    fwd = FakeForward(s)
    first = request("0_X", A_PROMPT, max_tokens=2)
    child = request("1_X", A_PROMPT, max_tokens=2, fork_of=first)
    _add(s, first, child)
    assert chunks_of(step(s, fwd)[0]) == [("0_X", 0, 4)]
    s.abort("0_X")
    assert chunks_of(step(s, fwd)[0]) == [("1_X", 4, 4)]     # from first's one cached block
    run_to_completion(s, fwd)
    _assert_reference(child)
    s.kv.assert_no_leaks()


# -- remote prefills (decode side) -------------------------------------------------------

def _remote(request_id: str, prompt: list[int], max_tokens: int = 3):
    transfer = KVTransferParams(do_remote_prefill=True, remote_engine_id="p",
                                remote_block_ids=[[1, 2, 3]], remote_host="127.0.0.1",
                                remote_port=1, remote_request_id="r", remote_capability="c")
    return request(request_id, prompt, max_tokens=max_tokens, kv_transfer=transfer)


def _pulled(fwd: FakeForward, req) -> None:
    """What the connector's transfer does: the prompt's KV but the last token lands."""
    for pos in range(req.num_computed_tokens, req.num_prompt_tokens - 1):
        fwd.slots[fwd._slot(req, pos)] = req.prompt_token_ids[pos]


def test_remote_prefill_waits_for_blocks_and_keeps_the_queue_order():
    s = make_scheduler(5)                                  # 4 usable blocks
    fwd = FakeForward(s)
    a = request("A", list(range(1, 9)), max_tokens=2)      # 8 tokens: 2 blocks, then a 3rd
    r = _remote("R", B_PROMPT)                             # needs 3 blocks for its prompt
    local = request("L", [60, 61, 62], max_tokens=2)
    _add(s, a, r, local)
    out, _ = step(s, fwd)
    assert chunks_of(out) == [("A", 0, 8)] and out.loads == []
    assert s.waiting[0] is r and r.status is Status.WAITING
    assert list(s.waiting) == [r, local]                    # L does not overtake R
    assert s.kv.pool.num_free == 2

    while not s.loading:                                    # A finishes, its blocks free up
        out, _ = step(s, fwd)
    assert out.loads == [KVLoad(r, 0)]
    assert r.status is Status.WAITING_FOR_REMOTE_KV and s.loading == {"R": r}
    assert s.kv.num_blocks_held("R") == -(-len(B_PROMPT) // BLOCK)   # the whole prompt
    assert "R" not in [c[0] for c in chunks_of(out)]               # no compute while loading

    _pulled(fwd, r)
    s.finish_load("R", None, recompute=False)
    assert r.status is Status.RUNNING and r.num_computed_tokens == len(B_PROMPT) - 1
    out, _ = step(s, fwd)
    assert ("R", len(B_PROMPT) - 1, 1) in chunks_of(out)            # only the last prompt token
    run_to_completion(s, fwd)
    _assert_reference(a, r, local)
    s.kv.assert_no_leaks()


def test_remote_prefill_pulls_only_past_its_own_prefix_hit():
    s = make_scheduler(32)
    fwd = FakeForward(s)
    (a,) = _add(s, request("A", A_PROMPT, max_tokens=1))
    run_to_completion(s, fwd)
    r = _remote("R", A_PROMPT + [77, 78])                  # 12 tokens, first 8 cached
    s.add(r)
    out, _ = step(s, fwd)
    assert out.loads == [KVLoad(r, 8)]
    assert r.num_computed_tokens == 8 and r.num_cached_tokens == 8
    _pulled(fwd, r)
    s.finish_load("R", None, recompute=False)
    run_to_completion(s, fwd)
    _assert_reference(a, r)
    s.kv.assert_no_leaks()


def test_a_loading_request_counts_toward_max_num_seqs():
    s = make_scheduler(32, max_num_seqs=1)
    fwd = FakeForward(s)
    r, local = _add(s, _remote("R", A_PROMPT), request("L", [60, 61, 62], max_tokens=1))
    out, _ = step(s, fwd)
    assert out.loads == [KVLoad(r, 0)] and out.chunks == []
    out, _ = step(s, fwd)
    assert out.chunks == [] and s.waiting[0] is local
    _pulled(fwd, r)
    s.finish_load("R", None, recompute=False)
    run_to_completion(s, fwd)
    _assert_reference(r, local)
    s.kv.assert_no_leaks()


# -- a failed KV load: the recompute and fail policies -----------------------------------

def _loading(max_num_seqs: int = 1):
    s = make_scheduler(32, max_num_seqs=max_num_seqs)
    fwd = FakeForward(s)
    r, local = _add(s, _remote("R", A_PROMPT), request("L", [60, 61, 62], max_tokens=2))
    out, _ = step(s, fwd)
    assert out.loads == [KVLoad(r, 0)] and s.kv.num_blocks_held("R") == 3
    return s, fwd, r, local


def test_failed_load_with_recompute_computes_the_prompt_locally_first():
    s, fwd, r, local = _loading()
    s.finish_load("R", "connection reset", recompute=True)
    assert r.status is Status.WAITING and list(s.waiting) == [r, local]   # back at the front
    assert r.kv_transfer is None and not r.remote_prefill and r.num_computed_tokens == 0
    assert "R" not in s.kv.requests and s.kv.pool.num_free == s.kv.pool.num_blocks - 1
    assert r.error is None
    out, _ = step(s, fwd)
    assert chunks_of(out) == [("R", 0, len(A_PROMPT))] and out.loads == []
    run_to_completion(s, fwd)
    assert r.status is Status.FINISHED_LENGTH
    _assert_reference(r, local)
    s.kv.assert_no_leaks()


def test_failed_load_with_fail_policy_aborts_only_that_request():
    s, fwd, r, local = _loading(max_num_seqs=2)
    assert s.kv.num_blocks_held("L") == 1
    s.finish_load("R", "connection reset", recompute=False)
    assert r.status is Status.FINISHED_ABORTED
    assert r.error is not None and "connection reset" in r.error
    assert "R" not in s.requests and "R" not in s.loading and "R" not in s.kv.requests
    assert r.output_token_ids == []
    run_to_completion(s, fwd)
    _assert_reference(local)
    s.kv.assert_no_leaks()


def test_load_finishing_after_an_abort_changes_nothing():
    s, fwd, r, local = _loading()
    s.abort("R")
    assert "R" not in s.kv.requests
    s.finish_load("R", None, recompute=False)
    s.finish_load("R", "late error", recompute=True)
    assert r.status is Status.FINISHED_ABORTED and r.error is None and r not in s.waiting
    run_to_completion(s, fwd)
    _assert_reference(local)
    s.kv.assert_no_leaks()
