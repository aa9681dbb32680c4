"""Built-in residual policies: immutable values that decide how each residual is stored."""

from .remat import Remat as Remat
