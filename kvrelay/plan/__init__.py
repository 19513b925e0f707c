"""`kvrelay plan`: how many prefill and decode servers (xPyD) a workload needs, and their
`--max-num-seqs`, from measured throughputs (`kvrelay.plan.capacity`)."""
