"""Speculative decoding (`--speculative-config`): n-gram drafts verified by the target
model in one forward. config.py (the flag, torch-free), ngram.py (the proposer, torch-free),
verify.py (accepting drafts row by row with the engine's sampler). docs/speculative.md."""
