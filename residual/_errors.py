"""The few exception classes a caller may want to catch exactly."""

import os

from . import _jax_private as jp

# Errors raised while JAX traces a hooked function point at the user's code.
jp.hide_from_tracebacks(os.path.dirname(os.path.abspath(__file__)))


class HookError(TypeError):
    """A hook broke its contract: `unpack` gave back the wrong shape, dtype or type,
    or `pack` returned something that cannot be carried from forward to backward."""


HookError.__module__ = "residual"


class TargetUnavailableError(RuntimeError):
    """A `target=` cannot be compiled for here: what it needs is not installed or not
    loaded (libtpu, JAX's CUDA plugin). The message says how to get it."""


TargetUnavailableError.__module__ = "residual"
