"""The error and warning classes of ``tracing`` (torch.jit's names, so users can search them)."""

from __future__ import annotations


class TracingCheckError(Exception):
    """A trace baked in something it should not have, or the function could not be traced."""


class TracerWarning(UserWarning):
    """A trace may not generalise: outputs disagree with Python, or randomness is frozen."""
