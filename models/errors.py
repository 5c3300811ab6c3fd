"""Errors raised while reading or building a model; each message names the file and field."""


class CheckpointError(ValueError):
    """A checkpoint folder, file or tensor is missing, malformed or of the wrong shape."""


class UnknownArchError(CheckpointError):
    """config.json names an architecture the built-in engine does not implement."""
