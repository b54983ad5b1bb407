"""The TTFT feedback stream: sidecars XADD one entry per streamed request's first token, every
dispatcher XREADs them into its model-error metrics."""

from __future__ import annotations

# After a streamed request's first token the decode-node sidecar (when given a Redis URL) XADDs one
# entry here, fields in TtftFeedbackField; every dispatcher XREADs it into its live model-error
# metrics. A non-streamed request gets no entry: its one JSON body leaves the node after the last
# token, so no one outside the node sees its first token (kairos.nodeagent.sidecar says more).
REDIS_TTFT_FEEDBACK_STREAM = "kairos:ttft-feedback"
TTFT_FEEDBACK_MAXLEN = 10_000  # XADD MAXLEN ~ this: the stream is a recent window, not a log
# A reader ignores (and counts) entries outside these bounds: TTFTs above 10 minutes, or an
# observed/predicted ratio beyond 1000x either way, are junk, never a measurement.
TTFT_FEEDBACK_MAX_MS = 600_000.0
TTFT_FEEDBACK_MAX_RATIO = 1000.0
TTFT_FEEDBACK_MAX_ID_CHARS = 256  # request_id and node


class TtftFeedbackField:
    """Fields of one :data:`REDIS_TTFT_FEEDBACK_STREAM` entry (all strings on the wire)."""

    REQUEST_ID = "request_id"  # the x-request-id both hops carried
    PATH = "path"  # a Route value (keep, deflect, split): the path the dispatcher chose
    NODE = "node"  # the decode node that served it
    PREDICTED_MS = "predicted_ms"  # the dispatcher's TTFT prediction for that path, ms
    OBSERVED_MS = "observed_ms"  # arrival at the sidecar to the first token relayed, ms
    # What observed_ms timed: always TTFT_FEEDBACK_FIRST_TOKEN. Readers refuse an entry without it:
    # sidecars before it also sent the first body byte of non-streamed responses, which comes
    # after the whole generation, and nothing else in such an entry tells it from a TTFT.
    MEASURED = "measured"

    ALL = (REQUEST_ID, PATH, NODE, PREDICTED_MS, OBSERVED_MS, MEASURED)


TTFT_FEEDBACK_FIRST_TOKEN = "first_token"  # TtftFeedbackField.MEASURED: the first event of a stream
