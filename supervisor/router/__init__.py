"""The data plane: OpenAI endpoints proxied to the primary (supervisor/router/app.py)."""
from supervisor.router.app import build_router

__all__ = ["build_router"]
