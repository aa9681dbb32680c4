"""The few exception classes a caller may want to catch exactly."""


class HookError(TypeError):
    """A hook broke its contract: `unpack` gave back the wrong shape, dtype or type,
    or `pack` returned something that cannot be carried from forward to backward."""
