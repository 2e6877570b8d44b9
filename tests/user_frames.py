"""What a traceback of an error raised in the user's function shows: the user's frames only, under
both of JAX's filtering modes (the ``traceback_filtering`` fixture, tests/conftest.py)."""
import os
import traceback

import jax

import jamp
import tracing

LIBRARY_DIRS = tuple(os.path.dirname(module.__file__) + os.sep for module in (jamp, tracing, jax))


def assert_only_user_frames(error: BaseException, filtering: str, innermost: list) -> None:
    """No frame of jamp, tracing or JAX in ``error``'s traceback, which ends with ``innermost``
    ((file name, function) pairs); with frames removed, the whole stack is kept beside it, as
    JAX keeps it."""
    frames = traceback.extract_tb(error.__traceback__)
    shown = [(os.path.basename(f.filename), f.name) for f in frames]
    assert [f for f in frames if f.filename.startswith(LIBRARY_DIRS)] == [], shown
    assert shown[-len(innermost):] == innermost, shown
    if filtering == "remove_frames":
        assert type(error.__cause__).__name__ == "UnfilteredStackTrace"
