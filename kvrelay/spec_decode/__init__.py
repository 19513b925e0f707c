"""Speculative decoding (`--speculative-config`): n-gram or draft-model drafts verified by
the target model in one forward. config.py (the flag), ngram.py (the n-gram proposer),
stats.py (the counters) — all torch-free; the draft model's proposer (it runs a model) and
the verification (accepting drafts row by row with the engine's sampler) are the engine's:
engine/draft_proposer.py, engine/spec_verify.py. docs/speculative.md."""
