"""The cost of one part (a decision, a prefix lookup, the gateway's hops, a sidecar change); each
runs as ``python -m bench.micro.<name>``."""
