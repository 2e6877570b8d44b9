"""The error and warning classes of ``tracing`` (torch.jit's names, so users can search them),
and where its warnings point: at the user's call."""

from __future__ import annotations

import os
import sys
import types

import jax

import jamp


class TracingCheckError(Exception):
    """A trace baked in something it should not have, or the function could not be traced."""


class TracerWarning(UserWarning):
    """A trace may not generalise: outputs disagree with Python, or randomness is frozen."""


_LIBRARIES = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (jax.__file__, jamp.__file__, __file__)
)


def caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside tracing, jamp and JAX (the user's call),
    for a ``warnings.warn`` in the function calling this: the entry points are API boundaries
    (a frame of JAX's), so a count of frames would point into JAX."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    return level
