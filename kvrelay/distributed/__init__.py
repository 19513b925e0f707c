"""Multi-process tensor parallelism: worker ranks, collectives, supervision."""
