"""Shared fixtures: tiny checkpoints made once per session with `make-model`."""
from __future__ import annotations

from pathlib import Path

import pytest

from engines.make_model import make_model


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
