"""The shared ground: contracts, defaults, errors, config loading, Redis helpers, runtime.

Imports nothing else of Kairos, so every part (gateway, node agents, simulator, profiler,
launcher) can depend on it.
"""
