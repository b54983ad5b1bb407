"""The benchmarks: a shared harness and the benchmarks grouped by kind; see bench/README.md."""
