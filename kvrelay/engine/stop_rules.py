"""When a request stops, and how far it may still go: the length and stop-token rules the
scheduler applies to each new token (`Scheduler.update`) and when it plans ahead
(async scheduling, speculative drafts). They read the request and mutate nothing but
its `stop_reason`."""
from __future__ import annotations

from kvrelay.engine.request import Request, Status


def check_stop(req: Request, token: int, max_model_len: int) -> Status | None:
    """The status `token` (just appended) stops `req` with, if any: a stop token id or EOS
    (once min_tokens are out), a complete or failed grammar, max_tokens, max_model_len."""
    p = req.params
    num_out = len(req.output_token_ids)
    if num_out >= p.min_tokens:
        if token in (p.stop_token_ids or ()):
            req.stop_reason = token
            return Status.FINISHED_STOPPED
        if not p.ignore_eos and token in req.eos_token_ids:
            return Status.FINISHED_STOPPED
    if req.grammar is not None and (req.grammar.terminated or req.grammar.failed):
        return Status.FINISHED_STOPPED               # the grammar is complete (or broken)
    if (p.max_tokens is not None and num_out >= p.max_tokens) \
            or req.num_tokens >= max_model_len:
        return Status.FINISHED_LENGTH
    return None


def ends_with_next_token(req: Request, max_model_len: int) -> bool:
    """Whether the token being sampled for `req` finishes it by length."""
    p = req.params
    return ((p.max_tokens is not None and len(req.output_token_ids) + 1 >= p.max_tokens)
            or req.num_tokens + 1 >= max_model_len)


def draft_room(req: Request, max_model_len: int) -> int:
    """Drafts worth verifying: all accepted plus the target's own token must fit in
    max_tokens and max_model_len (a longer draft computes rows that cannot be kept)."""
    p = req.params
    room = max_model_len - req.num_tokens - 1
    if p.max_tokens is not None:
        room = min(room, p.max_tokens - len(req.output_token_ids) - 1)
    return room
