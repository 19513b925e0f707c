"""The native grammar-row kernel (`kvrelay_kernels::grammar_rows`, csrc/bitmask_op.cpp)
against its PyTorch reference (`masks._torch_rows`): the same sparse ids, picked tokens,
masked rows and empty rows, on every ISA build this CPU runs, for random and edge-case
bitmasks at vocabulary sizes that are not multiples of 32; and the fallback without it."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvrelay.engine.sampler import Sampler
from kvrelay.model import kernels
from kvrelay.model.kernels import isa as isa_table
from kvrelay.sampling_params import SamplingParams
from kvrelay.structured import masks
from kvrelay.structured.masks import MASK_ONLY, PLAIN_GREEDY, SAMPLED
from tests.kernel_isas import isa_params


@pytest.fixture(scope="module")
def isas() -> list[str]:
    if kernels.compiler() is None:
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    status = kernels.status()
    assert status.available, f"native kernels failed to build: {status.reason}"
    return list(isa_table.variants("bitmask"))     # the table's choice (the op must take each)


@pytest.mark.parametrize("variant", isa_params("bitmask"))
def test_every_variant_of_the_table_runs_or_says_what_the_cpu_lacks(variant, isas):
    """The loops below cover the variants this CPU runs; this names the others' skips."""
    rng = np.random.default_rng(7)
    bitmask = _bitmask(rng, ["few", "dense", "one"], 1000)
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(7))
    _compare(logits, bitmask, [SAMPLED, PLAIN_GREEDY, MASK_ONLY], variant)


def _bitmask(rng: np.random.Generator, kinds: list[str], vocab: int) -> np.ndarray:
    """One int32 row per kind (llguidance's layout; bits past `vocab` set too, as junk
    the kernel must ignore)."""
    words = (vocab + 31) // 32
    bits = np.zeros((len(kinds), words * 32), dtype=bool)
    for r, kind in enumerate(kinds):
        if kind == "all":
            bits[r, :vocab] = True
        elif kind == "one":
            bits[r, rng.integers(vocab)] = True
        elif kind == "last":                          # only the last token (a partial word)
            bits[r, vocab - 1] = True
        elif kind == "few":                           # a handful of words: a sparse row
            bits[r, rng.choice(vocab, min(40, vocab // 2), replace=False)] = True
        elif kind == "dense":                         # most tokens (free text in a string)
            bits[r, :vocab] = rng.random(vocab) < 0.7
        elif kind == "half":
            bits[r, :vocab] = rng.random(vocab) < 0.5
        bits[r, vocab:] = kind != "empty"             # junk past the vocabulary
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def _compare(logits: torch.Tensor, bitmask: np.ndarray, modes: list[int], isa: str) -> None:
    index = list(range(len(modes)))
    want_logits = logits.clone()
    want = masks._torch_rows(want_logits, bitmask, index, modes)
    got_logits = logits.clone()
    tokens, offsets, ids = torch.ops.kvrelay_kernels.grammar_rows(
        got_logits, torch.from_numpy(bitmask), torch.tensor(index), torch.tensor(modes),
        masks.SPARSE_WORDS, isa)
    off = offsets.tolist()
    got = ({i: ids[off[i]:off[i + 1]] for i, t in enumerate(tokens.tolist()) if t == -1},
           {i: t for i, t in enumerate(tokens.tolist()) if t >= 0},
           [i for i, t in enumerate(tokens.tolist()) if t == -3])
    assert got[1] == want[1] and got[2] == want[2]
    assert got[0].keys() == want[0].keys()
    for i in want[0]:
        assert torch.equal(got[0][i], want[0][i])
    # masked rows equal; rows the kernel answered without a mask are untouched by it
    masked = [i for i in index if i not in got[1] and i not in got[0] and i not in got[2]]
    assert torch.equal(got_logits[masked], want_logits[masked])
    untouched = [i for i in index if i not in masked]
    assert torch.equal(got_logits[untouched], logits[untouched])


KINDS = ["all", "one", "last", "few", "dense", "half", "empty"]


@pytest.mark.parametrize("vocab", [33, 1000, 4099, 201_088])
@pytest.mark.parametrize("sparse_words", [2, 256])
def test_native_rows_equal_the_reference(isas, monkeypatch, vocab, sparse_words):
    monkeypatch.setattr(masks, "SPARSE_WORDS", sparse_words)    # read by both paths
    rng = np.random.default_rng(vocab)
    kinds = KINDS * 3
    modes = [SAMPLED] * 7 + [PLAIN_GREEDY] * 7 + [MASK_ONLY] * 7
    bitmask = _bitmask(rng, kinds, vocab)
    for isa in isas:
        logits = torch.randn(len(kinds), vocab)
        _compare(logits, bitmask, modes, isa)
        ties = torch.randint(0, 3, (len(kinds), vocab)).float()     # many equal maxima
        _compare(ties, bitmask, modes, isa)


def test_native_rows_on_a_subset_of_the_batch(isas, monkeypatch):
    """Grammar rows are some of the step's rows, in any order; the others stay as they were."""
    monkeypatch.setattr(masks, "SPARSE_WORDS", 8)           # row 0 (dense) is masked
    rng = np.random.default_rng(0)
    vocab = 5001
    bitmask = _bitmask(rng, ["dense", "all", "few", "half", "one"], vocab)
    bitmask[1] = 0                                              # row 1 has no grammar
    logits = torch.randn(5, vocab)
    for isa in isas:
        got = logits.clone()
        tokens, _, _ = torch.ops.kvrelay_kernels.grammar_rows(
            got, torch.from_numpy(bitmask), torch.tensor([4, 0, 3]),
            torch.tensor([PLAIN_GREEDY, SAMPLED, MASK_ONLY]), masks.SPARSE_WORDS, isa)
        want = logits.clone()
        ref = masks._torch_rows(want, bitmask, [4, 0, 3], [PLAIN_GREEDY, SAMPLED, MASK_ONLY])
        assert tokens.tolist() == [ref[1][4], -2, -2] and torch.equal(got, want)
        assert torch.equal(got[[1, 2]], logits[[1, 2]])


ALLOWED = np.array([3, 40, 41, 777, 4095, 4999])
VOCAB = 5003


class FakeBackend:
    vocab_size = VOCAB

    def fill(self, rows, ptr, batch, parallel=True):
        words = (VOCAB + 31) // 32
        view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int32 * (batch * words))
                                     .from_address(ptr)).reshape(batch, words)
        for _, i in rows:
            bits = np.zeros(words * 32, dtype=bool)
            bits[_allowed_at(i)] = True                             # odd rows sparse
            view[i] = np.packbits(bits, bitorder="little").view(np.int32)


def _allowed_at(row: int) -> np.ndarray:
    return ALLOWED if row % 2 else np.arange(0, VOCAB, 3)


def _request(params: SamplingParams, row: int = 0):
    grammar = SimpleNamespace(failed=None, backend=FakeBackend(), matcher=None,
                              allows=lambda t: t in _allowed_at(row))
    return SimpleNamespace(params=params, grammar=grammar, generator=None, output_token_ids=[],
                           eos_token_ids=(0,), request_id="r")


def test_sampler_greedy_tokens_equal_with_and_without_the_kernel(isas, monkeypatch):
    logits = torch.randn(8, VOCAB)
    logits[:, 10] = 50.0                                       # never allowed
    greedy = SamplingParams(temperature=0.0)
    biased = SamplingParams(temperature=0.0, logit_bias={4999: 1.0})
    reqs = [_request(greedy if i < 6 else biased, i) for i in range(8)]
    native = Sampler()(logits.clone(), reqs).token_ids
    reference = Sampler()
    reference.masks.native = False
    assert reference(logits.clone(), reqs).token_ids == native
    for i, t in enumerate(native):
        allowed = ALLOWED if i % 2 else np.arange(0, VOCAB, 3)
        row = logits[i].clone()
        if i >= 6:
            row[4999] += 1.0
        assert t == int(allowed[row[allowed].argmax()])


def test_without_the_extension_the_reference_path_runs(monkeypatch, caplog):
    """The build fails: one warning (kernels.status), and the masks use the reference."""
    def fail(directory):
        raise RuntimeError("Error building extension 'kvrelay_kernels'\nno compiler")
    kernels.status.cache_clear()
    monkeypatch.setattr(kernels, "_build", fail)
    calls: list[int] = []
    real = masks._torch_rows
    monkeypatch.setattr(masks, "_torch_rows", lambda *a: calls.append(1) or real(*a))
    try:
        logits = torch.randn(4, VOCAB)
        logits[:, 10] = 50.0                  # never allowed: every row needs its mask
        reqs = [_request(SamplingParams(temperature=0.0), i) for i in range(4)]
        with caplog.at_level(logging.WARNING, logger="kvrelay.model.kernels"):
            out = [Sampler()(logits.clone(), reqs).token_ids for _ in range(2)]
    finally:
        kernels.status.cache_clear()
    warnings = [r for r in caplog.records if "native CPU kernels unavailable" in r.message]
    assert len(warnings) == 1 and calls == [1, 1]
    assert out[0] == out[1] == [int(a[logits[i, a].argmax()]) for i, a in
                                enumerate([np.arange(0, VOCAB, 3), ALLOWED] * 2)]


def test_batched_sparse_rows_of_different_widths_keep_their_own_law():
    """Unseeded sparse rows are sampled in one batch, padded to the widest: a narrow row
    (6 ids) beside a wide one (1,668 ids) still draws from its own masked softmax."""
    logits = torch.zeros(1, VOCAB)
    logits[0, ALLOWED] = torch.tensor([0.5, 1.5, -0.5, 1.0, 0.0, 2.0])
    n = 2000
    reqs = [_request(SamplingParams(temperature=1.0), i) for i in range(n)]
    tokens = np.array(Sampler()(logits.expand(n, -1).clone(), reqs).token_ids)
    narrow, wide = tokens[1::2], tokens[0::2]
    assert set(wide.tolist()) <= set(range(0, VOCAB, 3)) and len(set(wide.tolist())) > 500
    expect = torch.softmax(logits[0, ALLOWED].double(), 0).numpy()
    freq = np.array([(narrow == t).mean() for t in ALLOWED])
    assert np.isin(narrow, ALLOWED).all()
    assert np.all(np.abs(freq - expect) <= 5 * np.sqrt(expect * (1 - expect) / len(narrow)))


def test_inline_fill_equals_the_executor_fill():
    """A few rows are filled on the calling thread, many through llguidance's executor:
    the same bitmasks, at several positions of a JSON output."""
    from kvrelay.model.embedded import embedded_model_dir
    from kvrelay.structured.backend import GrammarBackend
    from kvrelay.structured.params import StructuredOutputsParams
    tokenizer_json = (embedded_model_dir() / "tokenizer.json").read_text()
    backend = GrammarBackend(tokenizer_json, 49152, (2,))
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    text = backend.tokenizer.tokenize_str('{"name":"Ada Lovelace"}')
    matchers = [backend.matcher(StructuredOutputsParams(json=schema), 0) for _ in range(3)]
    for m, n in zip(matchers, (0, 3, len(text) - 1)):   # start, inside the string, before }
        for t in text[:n]:
            m.accept(t)
    words = (49152 + 31) // 32
    out = {}
    for parallel in (True, False):
        bitmask = np.zeros((4, words), dtype=np.int32)
        backend.fill([(m, i + 1) for i, m in enumerate(matchers)], bitmask.ctypes.data, 4,
                     parallel)
        out[parallel] = bitmask
    assert np.array_equal(out[True], out[False]) and not out[True][0].any()
    assert all(out[True][i].any() for i in (1, 2, 3))
    # `allows` (the speculative check of greedy rows) agrees with the mask bit
    bits = np.unpackbits(out[True].view(np.uint8), axis=1, bitorder="little")
    rng = np.random.default_rng(0)
    for r, m in enumerate(matchers, start=1):
        probe = np.concatenate([rng.integers(0, 49152, 300), np.flatnonzero(bits[r])[:300], [2]])
        assert [m.allows(int(t)) for t in probe] == [bool(bits[r, t]) for t in probe]


def test_greedy_rows_whose_best_allowed_token_is_near_the_top_need_no_mask(isas, monkeypatch):
    """Plain greedy rows walk their best tokens against the grammar first: the first allowed
    one is the token (no mask filled); the others are filled and take the masked argmax."""
    filled: list[list[int]] = []
    real = masks._fill
    monkeypatch.setattr(masks, "_fill", lambda rows, *a: filled.append([i for i, _ in rows])
                        or real(rows, *a))
    logits = torch.randn(5, VOCAB)
    logits[:, 10] = 50.0                                        # never allowed
    logits[0, 777] = logits[1, 4999] = logits[2, 9] = 60.0      # allowed top-1 at rows 0-2
    logits[4, 11] = 55.0                                        # row 4: 11 is not allowed,
    logits[4, 12] = 54.0                                        # 12 is (3rd best)
    reqs = [_request(SamplingParams(temperature=0.0), i) for i in range(5)]
    sampler = Sampler()
    sampler.prepare(reqs)
    out = sampler(logits.clone(), reqs).token_ids
    assert out[:3] == [777, 4999, 9] and out[4] == 12 and filled == [[3]]
    assert out[3] == int(ALLOWED[logits[3, ALLOWED].argmax()])
    sampler.masks.speculate = False
    filled.clear()
    assert sampler(logits.clone(), reqs).token_ids == out and filled == [[0, 1, 2, 3, 4]]
    sampler.masks.speculate, sampler.masks.native = True, False   # reference: the argmax only
    filled.clear()
    assert sampler(logits.clone(), reqs).token_ids == out and filled == [[3, 4]]


@pytest.mark.parametrize("vocab", [1, 8, 33, 4099])
def test_native_topk_rows_best_first_ties_by_lower_id(isas, vocab):
    logits = torch.randint(0, 5, (5, vocab)).float()
    logits[4] = torch.randn(vocab)
    logits[3, vocab // 2] = float("nan")                       # NaN is never a candidate
    k = min(8, vocab)
    rows = torch.tensor([4, 0, 3])
    for isa in isas:
        values, ids = torch.ops.kvrelay_kernels.topk_rows(logits, rows, k, isa)
        for j, r in enumerate(rows.tolist()):
            row = logits[r]
            order = sorted((t for t in range(vocab) if not row[t].isnan()),
                           key=lambda t: (-float(row[t]), t))[:k]
            assert ids[j].tolist()[:len(order)] == order
            assert torch.equal(values[j][:len(order)], row[order])
