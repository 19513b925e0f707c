"""Speculative decoding (`--speculative-config`): n-gram drafts verified by the target
model in one forward. config.py (the flag), ngram.py (the proposer), stats.py (the
counters) — all torch-free; the verification (accepting drafts row by row with the
engine's sampler) is the engine's: engine/spec_verify.py. docs/speculative.md."""
