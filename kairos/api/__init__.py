"""The OpenAI surface: body parsing and limits, exact prompt token counting, and batch prompts
split into one request each and their answers merged as vLLM merges them.

Shared by the dispatcher (which must count what vLLM will count), the decode sidecar (which fans
a batch out) and the emulated vLLM node (which must answer as vLLM does). Imports only
:mod:`kairos.common`.
"""
