"""Typed errors a user can cause; each carries where it happened (file:line, host, package).

The CLI edge turns them into one line and an exit code; anything else reaching it is a bug.
"""
from __future__ import annotations


class ProvisionError(Exception):
    """Base of every user-facing error: `str()` is the one line shown to the user."""

    exit_code = 1

    def __init__(self, message: str, *, where: str | None = None):
        super().__init__(message)
        self.message = message
        self.where = where

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message


class InputError(ProvisionError):
    """Bad input: an argument, a host spec or a file that does not validate (where = argument or file:line)."""

    exit_code = 2


class LockError(InputError):
    """A lockfile that cannot be read or does not validate (where = file:line)."""


class HostError(ProvisionError):
    """A host that cannot be reached, refuses, or fails a step (where = host)."""


class InventoryError(InputError, HostError):
    """An inventory or --limit pattern that cannot be used as written (where = file: host)."""


class HostKeyError(HostError):
    """An unknown or changed SSH host key (message shows the fingerprint)."""


class HostLockedError(HostError):
    """Another mutating run holds the host's lock."""


class PlanError(ProvisionError):
    """A saved plan that no longer matches the host, or is malformed."""


class PatchError(ProvisionError):
    """A patch series that does not apply, or a version gate that refuses it."""


class SeriesError(InputError, PatchError):
    """A patch series whose files do not validate (where = series.yaml:line or the diff)."""


class EngineError(ProvisionError):
    """The included engine: bad checkpoint, bad config, bad request (all input errors)."""

    exit_code = 2


class ProbeError(ProvisionError):
    """A probe run that could not be carried out (not a probe that failed)."""
