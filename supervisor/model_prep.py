"""Resolve the checkpoint to serve: the configured folder (checked), or the built-in preset made on
first run under the cache dir with ``models.make_model``."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from supervisor.config import UnderstudyConfig

log = logging.getLogger("understudy.model")


class ModelError(Exception):
    pass


REQUIRED = ("config.json", "tokenizer.json")


def check_model_dir(path: Path) -> None:
    """ModelError naming what is missing, before any child starts."""
    if not path.exists():
        raise ModelError(f"model.path: {path}: no such folder")
    if not path.is_dir():
        raise ModelError(f"model.path: {path}: expected a checkpoint folder, found a file")
    for name in REQUIRED:
        if not (path / name).is_file():
            raise ModelError(f"model.path: {path}: expected an HF checkpoint folder, {name} is missing")
    if not any(path.glob("*.safetensors")):
        raise ModelError(f"model.path: {path}: expected *.safetensors files, found none")


def existing_model(cfg: UnderstudyConfig) -> Path | None:
    """The configured folder, or the preset's once made (checked: ModelError); None: not made yet."""
    if cfg.model.path:
        path = Path(cfg.model.path).expanduser().resolve()
        check_model_dir(path)
        return path
    path = preset_dir(cfg)
    if (path / "config.json").is_file():
        check_model_dir(path)
        return path
    return None


def preset_dir(cfg: UnderstudyConfig) -> Path:
    return cfg.resolved_cache_dir() / "models" / cfg.model.preset


def resolve_model(cfg: UnderstudyConfig) -> Path:
    """The folder to serve; makes the preset model under cache_dir/models/<preset> if needed."""
    existing = existing_model(cfg)
    return existing if existing is not None else make_preset(cfg)


def make_preset(cfg: UnderstudyConfig) -> Path:
    """Make the built-in preset model under cache_dir/models/<preset> (its folder is returned)."""
    path = preset_dir(cfg)
    from models.make_model import main as make_model  # lazy: imports torch
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    log.info("making the built-in %s model under %s (first run)", cfg.model.preset, path)
    rc = make_model([str(tmp), "--preset", cfg.model.preset])
    if rc not in (0, None):
        raise ModelError(f"make-model {cfg.model.preset} failed with exit code {rc}")
    try:
        os.replace(tmp, path)
    except OSError:  # another supervisor made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    check_model_dir(path)
    return path
