"""Errors the supervisor stops on instead of retrying."""


class BootError(Exception):
    """Something that cannot succeed by retrying: stop instead of looping."""
