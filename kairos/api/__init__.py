"""The OpenAI request surface: body parsing and limits, and exact prompt token counting.

Shared by the dispatcher (which must count what vLLM will count) and the emulated vLLM node
(which must answer as vLLM does). Imports only :mod:`kairos.common`.
"""
