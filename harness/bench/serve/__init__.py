"""`understudy bench serve`: a load generator for any OpenAI endpoint (the router by default), in
the spirit of `vllm bench serve`; see cli.py for the options and report.py for what is measured."""
from __future__ import annotations

from .cli import build_parser, main

__all__ = ["build_parser", "main"]
