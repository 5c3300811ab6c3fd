"""The supervisor's own error types (no imports: every part can raise them)."""


class BootError(Exception):
    """Something that cannot succeed by retrying: stop instead of looping."""


class AdminError(Exception):
    """An admin request that cannot be done; ``status`` is the HTTP code (404, 409, ...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
