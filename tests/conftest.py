"""Shared fixtures: tiny checkpoints made once per session with `make-model`. The whole session (and
every process it starts) writes caches under a temporary dir, never the user's ~/.cache."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from models.make_model import make_model

_CACHE_VARS = {"UNDERSTUDY_CACHE_DIR": "understudy", "XDG_CACHE_HOME": "xdg", "TRITON_CACHE_DIR": "triton"}
_session_cache: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Before any test module is imported: caches go to a private temporary dir."""
    global _session_cache
    _session_cache = tempfile.mkdtemp(prefix="understudy-test-cache-")
    for var, sub in _CACHE_VARS.items():
        os.environ[var] = os.path.join(_session_cache, sub)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _session_cache is not None:
        shutil.rmtree(_session_cache, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama checkpoint (seed 0), shared read-only by the whole session."""
    return make_model(tmp_path_factory.mktemp("tiny-llama"), "tiny", "llama", seed=0)


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory: pytest.TempPathFactory):
    """Factory for fresh tiny checkpoints: make_tiny(arch="qwen2", seed=3) -> Path."""
    def factory(arch: str = "llama", seed: int = 0, preset: str = "tiny") -> Path:
        return make_model(tmp_path_factory.mktemp(f"{preset}-{arch}-{seed}"), preset, arch, seed)
    return factory
