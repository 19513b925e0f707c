"""The sampler's sparse-row path (a grammar row sampled among its allowed ids only) draws
from exactly the distribution of the dense path (the row masked to -inf, then sampled)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvrelay.engine.sampler import Sampler
from kvrelay.sampling_params import SamplingParams
from kvrelay.structured import masks

VOCAB = 5000
ALLOWED = np.array([3, 40, 41, 777, 4095, 4999])


class FakeBackend:
    """Fills every row's bitmask with ALLOWED (llguidance's layout)."""
    vocab_size = VOCAB

    def fill(self, rows, ptr, batch, parallel=True):
        words = (VOCAB + 31) // 32
        row_type = np.ctypeslib.ctypes.c_int32 * (batch * words)
        view = np.ctypeslib.as_array(row_type.from_address(ptr))
        view = view.reshape(batch, words)
        for _, i in rows:
            for t in ALLOWED:
                view[i, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))


def _request(params: SamplingParams, seed: int | None = None):
    grammar = SimpleNamespace(failed=None, backend=FakeBackend(), matcher=None,
                              allows=lambda t: t in ALLOWED)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SimpleNamespace(params=params, grammar=grammar, generator=gen, output_token_ids=[],
                           eos_token_ids=(0,), request_id="r")


def _draws(monkeypatch, sparse_words: int, params: SamplingParams, logits: torch.Tensor,
           n: int, seeded: bool = True) -> list[int]:
    """n rows' draws; seeded rows are sampled one by one, unseeded sparse rows in one batch."""
    monkeypatch.setattr(masks, "SPARSE_WORDS", sparse_words)
    sampler = Sampler()
    reqs = [_request(params, seed=s if seeded else None) for s in range(n)]
    out = sampler(logits.expand(n, -1).clone(), reqs)
    return out.token_ids


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_p=0.8),
                                    SamplingParams(temperature=1.3, top_k=3, min_p=0.05)])
@pytest.mark.parametrize("seeded", [True, False])
def test_sparse_rows_draw_the_masked_distribution(monkeypatch, params, seeded):
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB) * 2
    logits[0, ALLOWED] = torch.tensor([0.5, 1.5, -0.5, 1.0, 0.0, 2.0])
    n = 2000
    dense = _draws(monkeypatch, 0, params, logits, n, seeded)   # 0 words: every row dense
    sparse = _draws(monkeypatch, 256, params, logits, n, seeded)
    assert set(dense) <= set(ALLOWED.tolist()) and set(sparse) <= set(ALLOWED.tolist())
    probs = _exact_probs(logits, params)        # both paths against the masked row's law
    for draws in (dense, sparse):
        freq = np.bincount(draws, minlength=VOCAB)[ALLOWED] / n
        expect = probs[ALLOWED]
        sigma = np.sqrt(expect * (1 - expect) / n)
        assert np.all(np.abs(freq - expect) <= 5 * sigma + 1e-9), (freq, expect)


def _exact_probs(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """The masked row's probabilities, worked out by hand: /T, top-k, softmax, top-p, min-p."""
    z = logits[0, ALLOWED].double().numpy() / params.temperature
    if 0 < params.top_k < len(z):
        z = np.where(z >= np.sort(z)[::-1][params.top_k - 1], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    p[order[before > params.top_p]] = 0
    p[p < params.min_p * p.max()] = 0
    full = np.zeros(VOCAB)
    full[ALLOWED] = p / p.sum()
    return full


def test_sparse_greedy_row_is_the_masked_argmax(monkeypatch):
    logits = torch.randn(2, VOCAB)
    logits[:, 10] = 50.0                       # the unmasked argmax is not allowed
    for words in (0, 256):
        monkeypatch.setattr(masks, "SPARSE_WORDS", words)
        reqs = [_request(SamplingParams(temperature=0.0)) for _ in range(2)]
        out = Sampler()(logits.clone(), reqs)
        assert out.token_ids == [int(ALLOWED[logits[i, ALLOWED].argmax()]) for i in range(2)]


def test_mixed_batch_keeps_free_rows_free(monkeypatch):
    """A row without a grammar beside a sparse grammar row is sampled over the whole vocab."""
    monkeypatch.setattr(masks, "SPARSE_WORDS", 256)
    logits = torch.zeros(2, VOCAB)
    logits[1, 10] = 50.0
    free = SimpleNamespace(params=SamplingParams(temperature=0.0), grammar=None, generator=None,
                           output_token_ids=[], eos_token_ids=(0,), request_id="f")
    out = Sampler()(logits, [_request(SamplingParams(temperature=0.0)), free])
    assert out.token_ids[0] in ALLOWED and out.token_ids[1] == 10


def test_small_batches_fill_inline_large_ones_in_the_worker(monkeypatch):
    """Below OVERLAP_MIN_ROWS grammar rows the mask is filled in `apply` (no thread hop);
    from there on it is filled in the worker during the forward. Both give the same rows.
    Plain greedy rows are never filled ahead: most need no mask (their argmax is allowed)."""
    logits = torch.randn(masks.OVERLAP_MIN_ROWS, VOCAB)
    for n, threaded in [(masks.OVERLAP_MIN_ROWS - 1, False), (masks.OVERLAP_MIN_ROWS, True)]:
        sampler = Sampler()
        reqs = [_request(SamplingParams(temperature=1.0), seed=i) for i in range(n)]
        sampler.prepare(reqs)
        assert (sampler.masks._pending is not None) is threaded
        out = sampler(logits[:n].clone(), reqs)
        assert set(out.token_ids) <= set(ALLOWED.tolist())
        greedy = [_request(SamplingParams(temperature=0.0)) for _ in range(n)]
        sampler.prepare(greedy)
        assert sampler.masks._pending is None
        out = sampler(logits[:n].clone(), greedy)
        assert out.token_ids == [int(ALLOWED[logits[i, ALLOWED].argmax()]) for i in range(n)]
        sampler.masks.close()


def test_dense_greedy_row_keeps_an_allowed_argmax_without_masking(monkeypatch):
    """A dense greedy row whose unmasked argmax is allowed skips the O(V) mask; one whose
    argmax is not allowed is masked (and then gets the masked argmax)."""
    monkeypatch.setattr(masks, "SPARSE_WORDS", 0)               # every grammar row is dense
    monkeypatch.setattr(masks.TokenMasks, "_use_native", lambda self, logits: False)
    logits = torch.randn(2, VOCAB)
    logits[0, 777] = 50.0                                        # allowed
    logits[1, 10] = 50.0                                         # not allowed
    masked_rows: list[list[int]] = []
    real = masks._mask_rows

    def spy(lg, bm, idx, n):
        masked_rows.append(list(idx))
        real(lg, bm, idx, n)

    monkeypatch.setattr(masks, "_mask_rows", spy)
    out = Sampler()(logits.clone(), [_request(SamplingParams(temperature=0.0)) for _ in range(2)])
    assert out.token_ids == [777, int(ALLOWED[logits[1, ALLOWED].argmax()])]
    assert masked_rows == [[1]]
    # with a logit bias the argmax may move after the mask: the row is masked as before
    masked_rows.clear()
    biased = SamplingParams(temperature=0.0, logit_bias={3: 100.0})
    out = Sampler()(logits[:1].clone(), [_request(biased)])
    assert out.token_ids == [3] and masked_rows == [[0]]
