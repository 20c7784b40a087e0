"""Typed errors a user can cause; each carries where it happened (file:line, host, package).

The CLI edge turns them into one line and an exit code; anything else reaching it is a bug. Standard library
only: the engine's EngineError (engine/errors.py, an InputError) travels to hosts with this module.
"""
from __future__ import annotations

import errno


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


class ResolveError(ProvisionError):
    """Resolution that cannot be carried out (resolver conflict, no resolver, bad index)."""


class ProbeError(ProvisionError):
    """A probe run that could not be carried out (not a probe that failed)."""


class ProbesFailed(ProvisionError):
    """Required probes failed inside the new generation; it was not switched to."""


class SwitchUnknown(HostError):
    """The connection was lost while `current` was being switched: the next run settles which it is."""


class StepStalled(HostError):
    """A host command showed no progress for the target's deadline and was stopped (its host work ended)."""


class ConnectionLost(HostError):
    """The connection to the host went while a host command ran (its keepalives unanswered): the step's outcome
    on the host is not known here; what was before the switch left `current` as it was."""


class Cancelled(HostError):
    """The run was cancelled (Ctrl-C) while a host command ran; the command was stopped (its host work ended)."""


class Halted(ProvisionError):
    """A host stopped before its commit point because its batch had already failed beyond the tolerance."""


class Staged(Halted):
    """A host stopped at its commit point as the play asks: built, sealed and probed, its switch the play's next
    task once every host of its batch has passed its probes. A type, so no caller matches its message."""

    SAID = "staged: the play switches it once every host of its batch has passed its probes"

    def __init__(self, message: str = SAID, where: str | None = None):
        super().__init__(message, where=where)


class DriftError(HostError):
    """Installed files no longer match their RECORD: packing them would not reproduce what was installed."""


class ControllerError(ProvisionError):
    """The controller cannot write what its run needs (its disk full, a file unwritable): where = the path."""


def controller_failure(e: OSError, path) -> ControllerError:
    """A write on the controller that failed, as one line naming the file (the OSError's, else `path`) and why: a
    full disk says so, with ENOSPC."""
    why = "the controller's disk is full (ENOSPC)" if e.errno == errno.ENOSPC else e.strerror or str(e)
    return ControllerError(why, where=str(e.filename or path))


class Interrupted(ProvisionError):
    """Ctrl-C: the run stopped; the message says where the host is (a switch under way completes first)."""

    exit_code = 130
