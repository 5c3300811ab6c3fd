"""Histogram buckets (seconds) of the time-to-first-output parts: the engine's
(engines/frontend/first_output.py) and the router's (supervisor/metrics.py), one set so that a
comparison of the two compares like with like."""

FIRST_OUTPUT_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                        5.0, 10.0)
