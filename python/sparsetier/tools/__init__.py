"""Tools over the sparsetier library: the `sparsetier` command (demo, bench, soak, plan), the
decode runtime with its tiny sparse-attention model, and the benchmark workloads.

The library (`sparsetier`, `sparsetier.l3`, `sparsetier.vllm`) never imports this package;
an engine embedding sparsetier needs none of it.
"""
