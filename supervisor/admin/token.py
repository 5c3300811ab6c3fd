"""The admin bearer token: a file, made 0600 on first start if missing."""
from __future__ import annotations

import os
import secrets
from pathlib import Path


class TokenError(Exception):
    pass


def ensure_token(path: Path) -> str:
    """Read the token at ``path``, creating it (0600, parent 0700) if missing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError as e:
        raise TokenError(f"{path}: cannot create admin token: {e.filename} is not a folder") from None
    except OSError as e:
        raise TokenError(f"{path}: cannot create admin token: {e}") from None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token(path)
    except OSError as e:
        raise TokenError(f"{path}: cannot create admin token: {e}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return read_token(path)


def read_token(path: Path) -> str:
    """The token text; TokenError if unreadable, empty, or readable by others."""
    try:
        st = path.stat()
        text = path.read_text().strip()
    except OSError as e:
        raise TokenError(f"{path}: cannot read admin token: {e.strerror}") from None
    except UnicodeDecodeError:
        raise TokenError(f"{path}: admin token is not text (expected printable ASCII, no spaces)") from None
    if st.st_mode & 0o077:
        raise TokenError(f"{path}: admin token must not be readable by group/others "
                         f"(mode {st.st_mode & 0o777:o}; run chmod 600 {path})")
    if not text:
        raise TokenError(f"{path}: admin token file is empty")
    if not (text.isascii() and text.isprintable()) or any(c.isspace() for c in text):
        raise TokenError(f"{path}: admin token must be printable ASCII without spaces or line breaks "
                         "(it goes in an HTTP header)")
    return text
