"""What both hops time of a stream, set once so the engine's front end and the router measure it
alike.

The time to a first output: the histogram buckets (seconds) of its parts, the engine's
(engines/frontend/first_output.py) and the router's (supervisor/metrics.py), one set so that a
comparison of the two compares like with like.

A stream that stalls is never silent: each hop that relays a stream's chunks (the engine's front end
for the core's outputs, the router for the engine's bytes and its client's reads) logs a wait between
two chunks of STALL_LOG_S or more, as the wait ends (a stream cut later, by a kill, keeps its line).
Runs of `bench failover` on GPUs showed one or two single streams a run waiting 1-2.7 s mid-stream;
the front end's line, which says how many tokens the output that ended the wait brought (99-188), found
them: a looping test model's tokens with no text, not streamed then (every token is a chunk now:
bench/RESULTS.md, twenty-fifth session). The wait for a first chunk (the time to a first token) is not
a stall."""
from __future__ import annotations

FIRST_OUTPUT_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                        5.0, 10.0)
STALL_LOG_S = 0.5
