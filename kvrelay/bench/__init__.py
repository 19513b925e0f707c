"""`kvrelay bench serve`: the serving benchmark (vLLM `bench serve`'s metrics, flags and datasets).

A light client: it imports httpx, tqdm and (optionally) tokenizers and matplotlib, never torch,
so it runs next to a server on a small machine or from another host.
"""
