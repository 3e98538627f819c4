"""The peers of bench/bench_peers.py: how each supervisor is started on the same job, one module each."""
