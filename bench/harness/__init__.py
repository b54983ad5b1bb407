"""What the benchmarks share: writing results (results), the fair harness's priorities and CPU
accounting (priorities), the live benchmarks' local cluster (live_cluster), a dispatcher's
metrics (scrape), request bodies (bodies), waiting for servers (waiting), and two servers other
benchmarks start: a load generator with a fixed-answer upstream (loadgen) and the ext_proc
service with nothing to decide (noop_extproc)."""
