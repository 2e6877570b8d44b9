"""Source lines in tests: the line of a test file carrying a ``# <marker>`` comment, and the
(file, line) a jamp report names, to compare the two."""
import os
import re


def line_of(path: str, marker: str) -> int:
    """The line of ``path`` carrying ``# <marker>`` at its end."""
    with open(path) as f:
        for number, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# {marker}"):
                return number
    raise AssertionError(f"no line of {path} ends with '# {marker}'")


def file_and_line(source: str) -> tuple[str, int]:
    """``("model.py", 12)`` of a report's ``model.py:12 (fn)`` (or ``model.py:12:8 (fn)``)."""
    match = re.match(r"(.*?):(\d+)(?::\d+)? \(", source)
    assert match, source
    return os.path.basename(match.group(1)), int(match.group(2))


def here(path: str, marker: str) -> tuple[str, int]:
    """``(basename, line)`` of the marked line of ``path``, as ``file_and_line`` gives it."""
    return os.path.basename(path), line_of(path, marker)
