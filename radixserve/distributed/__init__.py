"""Tensor parallelism: the process groups of the TP ranks (parallel_state) and the scheduler's
rank-0 broadcast of requests and per-step schedule digest (tp_sync)."""
