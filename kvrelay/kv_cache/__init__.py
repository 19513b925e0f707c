"""KV-cache bookkeeping: block pool, prefix hashing, the hybrid manager. Torch-free."""
