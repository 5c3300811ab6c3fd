"""The load generator of the harness: clients that send completions to an OpenAI endpoint (the
router) and time every piece of each answer.

- wire.py: the HTTP/1.1 connection (reads whatever the socket holds, each piece timed);
- request.py, result.py: what is sent, and one request as the client saw it (pydantic);
- answer.py: an answer (server-sent events or one JSON body) read into its result;
- client.py: `Client`, sending requests on connections and keeping every result;
- schedules.py: when requests go: `closed_loop` (back to back) or `OpenRate` (one every 1/rate s);
- prompts.py: token-id prompts of exact lengths;
- jobs.py, processes.py, child.py: a closed loop spread over client processes, started together;
- threaded.py: `Load` and `OpenLoad`, the load on a thread of its own for callers that are not async.
"""
from .threaded import Load, OpenLoad

__all__ = ["Load", "OpenLoad"]
