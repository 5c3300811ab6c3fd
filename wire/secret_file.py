"""A secret in a file, made 0600 on first start if missing: the admin API's bearer token, and the node
secret every request to an engine under a supervisor must carry (wire/node_secret.py)."""
from __future__ import annotations

import os
import secrets
from pathlib import Path


class TokenError(ValueError):
    pass


def ensure_token(path: Path, what: str = "admin token") -> str:
    """Read the secret at ``path``, creating it (0600, parent 0700) if missing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError as e:
        raise TokenError(f"{path}: cannot create {what}: {e.filename} is not a folder") from None
    except OSError as e:
        raise TokenError(f"{path}: cannot create {what}: {e}") from None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token(path, what)
    except OSError as e:
        raise TokenError(f"{path}: cannot create {what}: {e}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return read_token(path, what)


def read_token(path: Path, what: str = "admin token") -> str:
    """The token text; TokenError if unreadable, empty, or readable by others."""
    try:
        st = path.stat()
        text = path.read_text().strip()
    except OSError as e:
        raise TokenError(f"{path}: cannot read {what}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise TokenError(f"{path}: {what} is not text (expected printable ASCII, no spaces)") from None
    if st.st_mode & 0o077:
        raise TokenError(f"{path}: {what} must not be readable by group/others "
                         f"(mode {st.st_mode & 0o777:o}; run chmod 600 {path})")
    if not text:
        raise TokenError(f"{path}: {what} file is empty")
    if not (text.isascii() and text.isprintable()) or any(c.isspace() for c in text):
        raise TokenError(f"{path}: {what} must be printable ASCII without spaces or line breaks "
                         "(it goes in an HTTP header)")
    return text
