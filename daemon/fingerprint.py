"""CacheConfig: the fingerprint a client's weights must match to use a daemon's arena.

`content_digest` hashes the checkpoint files' bytes; each file's hash is cached on disk by
(path, device, inode, size, mtime_ns), so weights replaced at the same path are a miss.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from models import CheckpointError

from .quant import quant_of

LAYOUT_VERSION = 1
_HASH_CHUNK = 8 << 20


class CacheConfig(BaseModel):
    """Everything that decides whether an arena holds exactly the tensors a client would load."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str
    arch: str
    content_digest: str
    tp_size: int
    tp_rank: int
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    ep_size: int = 1
    quant_method: str | None
    quant_config_hash: str
    quant_processing: str = ""  # the version of the daemon's post-load processing (FP8's scales)
    dtype: str
    device_capability: str  # "cpu" or "sm_90"
    device_uuid: str  # "cpu" or the GPU's UUID: an arena lives on one physical GPU
    torch_version: str
    layout_version: int

    def differing_fields(self, other: "CacheConfig") -> list[str]:
        """Names of the fields whose values differ, in declaration order."""
        a, b = self.model_dump(), other.model_dump()
        return [k for k in a if a[k] != b[k]]


def default_cache_dir() -> Path:
    """`$UNDERSTUDY_CACHE_DIR`, else `$XDG_CACHE_HOME/understudy`, else `~/.cache/understudy`."""
    if os.environ.get("UNDERSTUDY_CACHE_DIR"):
        return Path(os.environ["UNDERSTUDY_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "understudy"


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The files whose bytes define the weights: config.json, *.safetensors and their index."""
    if not model_dir.is_dir():
        raise CheckpointError(f"model folder {model_dir} does not exist")
    files = [p for p in sorted(model_dir.iterdir())
             if p.name == "config.json" or p.name.endswith(".safetensors")
             or p.name.endswith(".safetensors.index.json")]
    if not any(p.name.endswith(".safetensors") for p in files):
        raise CheckpointError(f"model folder {model_dir} has no *.safetensors file")
    return files


def content_digest(model_dir: str | os.PathLike, cache_dir: Path | None = None) -> str:
    """sha256 over (name, file digest) of every checkpoint file; file digests cached on disk."""
    model_dir = Path(model_dir).resolve()
    cache = (cache_dir or default_cache_dir()) / "digests"
    files = checkpoint_files(model_dir)
    with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
        digests = list(pool.map(lambda p: _file_digest(p, cache), files))
    total = hashlib.sha256()
    for path, digest in zip(files, digests):
        total.update(f"{path.name}\0{digest}\n".encode())
    return total.hexdigest()


def _file_digest(path: Path, cache: Path) -> str:
    st = os.stat(path)
    key = f"{path}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"
    entry = cache / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")
    try:
        saved = json.loads(entry.read_text())
        if saved.get("key") == key:
            return saved["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".tmp{os.getpid()}.{id(h)}")
        tmp.write_text(json.dumps({"key": key, "sha256": digest}))
        os.replace(tmp, entry)
    except OSError:
        pass  # a read-only cache dir costs a re-hash next time, nothing more
    return digest


def device_identity(device: str) -> tuple[str, str]:
    """(device_capability, device_uuid) of 'cpu' or 'cuda[:N]'."""
    if device == "cpu":
        return "cpu", "cpu"
    import torch

    index = torch.device(device).index or 0
    major, minor = torch.cuda.get_device_capability(index)
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", f"index-{index}"))
    return f"sm_{major}{minor}", uuid


def make_cache_config(model_path: str | os.PathLike, *, tp_rank: int = 0, tp_size: int = 1,
                      dtype: str = "float32", device: str = "cpu", pp_size: int = 1, pp_rank: int = 0,
                      dp_size: int = 1, ep_size: int = 1, cache_dir: Path | None = None) -> CacheConfig:
    """The fingerprint of loading `model_path` for this rank, dtype and device ('cpu', 'cuda:N')."""
    import torch

    model_dir = Path(model_path).resolve()
    if not model_dir.is_dir():
        raise CheckpointError(f"model folder {model_dir} does not exist")
    config_file = model_dir / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{config_file} does not exist") from None
    except ValueError as e:
        raise CheckpointError(f"{config_file} is not valid JSON: {e}") from None
    archs = config.get("architectures") or [None]
    try:
        quant_method, quant_hash, processing = quant_of(config)
    except ValueError as e:
        raise CheckpointError(f"{config_file}: {e}") from None
    capability, uuid = device_identity(device)
    return CacheConfig(
        model_path=str(model_dir), arch=str(archs[0]), content_digest=content_digest(model_dir, cache_dir),
        tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank, dp_size=dp_size,
        ep_size=ep_size, quant_method=quant_method, quant_config_hash=quant_hash, quant_processing=processing, dtype=dtype,
        device_capability=capability, device_uuid=uuid, torch_version=torch.__version__,
        layout_version=LAYOUT_VERSION)
