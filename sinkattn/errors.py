"""Exceptions raised for user mistakes and unservable requests.

Every error sinkattn raises for bad input is a SinkattnError, and also a subclass of the builtin
that fits (ValueError, TypeError, RuntimeError), so callers can catch either.
"""


class SinkattnError(Exception):
    """Base of every sinkattn error."""


class SinkattnValueError(SinkattnError, ValueError):
    """An argument has the right type but a value sinkattn cannot accept."""


class SinkattnTypeError(SinkattnError, TypeError):
    """An argument has a type or dtype sinkattn cannot accept."""


class SinkattnRuntimeError(SinkattnError, RuntimeError):
    """A request cannot be served by this build or this device (for example a forced backend)."""
