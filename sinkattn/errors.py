"""Exceptions raised for user mistakes and unservable requests.

Every error sinkattn raises for bad input is a SinkattnError, and also a subclass of the builtin
that fits (ValueError, TypeError, RuntimeError), so callers can catch either. Warnings that say once per process
why a call took a slower path go through `warn_once`.
"""
import warnings


class SinkattnError(Exception):
    """Base of every sinkattn error."""


class SinkattnValueError(SinkattnError, ValueError):
    """An argument has the right type but a value sinkattn cannot accept."""


class SinkattnTypeError(SinkattnError, TypeError):
    """An argument has a type or dtype sinkattn cannot accept."""


class SinkattnRuntimeError(SinkattnError, RuntimeError):
    """A request cannot be served by this build or this device (for example a forced backend)."""


def warn_once(seen: set, message: str, category: type[Warning], stacklevel: int = 2) -> None:
    """Warn `message` the first time it is seen in `seen` (the caller's set, so a test can clear it); stacklevel
    counts from the caller of warn_once."""
    if message in seen:
        return
    seen.add(message)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
