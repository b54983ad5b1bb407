"""The ``kairos`` command line on top of everything: ``kairos up``, replay, local and vLLM clusters.

Nothing below imports it.
"""
