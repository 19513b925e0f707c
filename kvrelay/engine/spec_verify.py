"""Verifying draft tokens: the target model's rows of speculative chunks → the tokens each
request keeps.

A chunk [t, d1 … dK] (t: the last known token, d: the drafts) gives K + 1 logits rows;
row j is the target's distribution for the token after d1 … dj. Row j is sampled exactly
as the sampler samples a decode (temperature, top-k/p, min-p, bias, processors, min_tokens
bans), as if d1 … dj were output already (`ahead`); d(j+1) is accepted when the token
drawn from row j equals it. The first row whose token differs ends the chunk with that
token; with all K accepted, row K adds a bonus token. Rows after the first mismatch are
never sampled:

    row      0    1    2    3          K = 3, drafts d1 d2 d3
    drawn    d1   d2   x    ·          → tokens d1 d2 x   (x ≠ d3)

Greedy, this is "the longest draft prefix equal to the argmax, then the target's own
token". Sampled, it is speculative (rejection) sampling for a draft that is a point mass
(an n-gram draft proposes d with probability 1): standard rejection sampling accepts d with
probability min(1, p(d) / 1) = p(d) and on rejection draws from max(0, p - δ_d), i.e. p
without d, renormalised. Drawing x ~ p and accepting iff x = d has exactly that law:
P(accept) = p(d), and given x ≠ d, x ~ p without d. The output is therefore distributed as
without speculation, and each output token costs one draw (one noise vector) as it does
without speculation — so a seeded request draws the same noise at every output position
whether its tokens came from drafts or not: reproducible, and the same tokens as the same
seed without speculation up to float differences between the batched and the single-row
forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrelay.engine.request import Logprob, Request
from kvrelay.engine.sampler import Sampler, greedy_tokens


@dataclass
class Verified:
    tokens: list[list[int]]                                  # per request: accepted + one
    logprobs: list[list[dict[int, Logprob] | None]]          # per request, per token
    errors: dict[int, Exception] = field(default_factory=dict)   # request index → its failure


def verify(sampler: Sampler, logits: torch.Tensor, requests: list[Request], rows: list[int],
           drafts: list[list[int]]) -> Verified:
    """Request i's rows are logits[rows[i] : rows[i] + len(drafts[i]) + 1] (no drafts: one
    row, an ordinary decode or a prompt's last chunk)."""
    if all(sampler.plain_greedy(r) for r in requests):
        return _greedy(logits, rows, drafts)
    out = Verified([[] for _ in requests], [[] for _ in requests])
    alive, j = list(range(len(requests))), 0
    while alive:                       # round j: row j of every request still matching
        ahead = [drafts[i][:j] for i in alive] if j else None
        result, errors = sampler.isolated(logits[[rows[i] + j for i in alive]],
                                          [requests[i] for i in alive], ahead)
        still = []
        for k, i in enumerate(alive):
            if k in errors:
                out.errors[i] = errors[k]
                continue
            token = result.token_ids[k]
            out.tokens[i].append(token)
            out.logprobs[i].append(result.logprobs[k])
            if j < len(drafts[i]) and token == drafts[i][j]:
                still.append(i)
        alive, j = still, j + 1
    return out


def _greedy(logits: torch.Tensor, rows: list[int], drafts: list[list[int]]) -> Verified:
    """Every request plain greedy: one argmax over all their rows, then each request's
    accepted prefix."""
    index = [r + j for r, d in zip(rows, drafts) for j in range(len(d) + 1)]
    picked = logits if index == list(range(logits.shape[0])) else logits[index]
    argmax = greedy_tokens(picked)
    out = Verified([], [])
    at = 0
    for d in drafts:
        best = argmax[at:at + len(d) + 1]
        n = 0
        while n < len(d) and best[n] == d[n]:
            n += 1
        out.tokens.append(best[:n + 1])
        out.logprobs.append([None] * (n + 1))
        at += len(d) + 1
    return out
