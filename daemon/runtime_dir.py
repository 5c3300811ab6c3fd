"""The runtime directory: a private (0700, ours) folder for sockets, tokens and state."""
from __future__ import annotations

import os
import stat
from pathlib import Path


class RuntimeDirError(Exception):
    """The runtime dir is missing, not ours, or readable by others; the message says which."""


def default_runtime_dir() -> Path:
    """`$XDG_RUNTIME_DIR/understudy`, else `/tmp/understudy-$UID`."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "understudy"
    return Path(f"/tmp/understudy-{os.getuid()}")


def ensure_private_dir(path: str | os.PathLike) -> Path:
    """Create `path` with mode 0700 if missing; refuse one owned by another uid or open to others."""
    p = Path(path)
    try:
        p.mkdir(mode=0o700, parents=True)
        os.chmod(p, 0o700)  # mkdir's mode is filtered by the umask
    except FileExistsError:
        pass
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"runtime dir {p} is not a directory (a symlink or file is in the way)")
    if st.st_uid != os.getuid():
        raise RuntimeDirError(f"runtime dir {p} is owned by uid {st.st_uid}, not by us (uid {os.getuid()})")
    if st.st_mode & 0o077:
        raise RuntimeDirError(
            f"runtime dir {p} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 (no group/other bits)")
    return p


def daemon_socket_path(runtime_dir: str | os.PathLike, rank: int) -> Path:
    """`{runtime_dir}/daemon-rank{rank}.sock`: where the weight cache daemon of `rank` listens."""
    return Path(runtime_dir) / f"daemon-rank{rank}.sock"
