"""Structured outputs: constraints on what a request may generate (params.py, torch-free)."""
