"""Open pages of the built documentation in headless Chromium, screenshot them and check them.

Run by ./scripts/docs-check after ./scripts/docs; standard library only. For each page it

* takes a screenshot (``<html dir>/_screenshots/<page>.png``) and checks that the PNG is not one
  flat colour (a blank or unstyled page);
* reads the DOM after the page's scripts ran (``--dump-dom``) and checks that the ``<title>`` starts
  with the first heading of the page's Markdown source, that there is an ``<h1>``, that the text
  holds no error (a docutils system message or unresolved reference, a Python traceback, a
  "page not found"), and that the browser console logged no uncaught JavaScript error.

Usage: python scripts/check_docs_pages.py [--html docs/_build/html] [--browser chromium] [PAGE ...]
PAGE is a path below the HTML directory without ``.html`` (default: the index, the API page and
the Flax training guide).
"""
from __future__ import annotations

import argparse
import html.parser
import pathlib
import re
import struct
import subprocess
import sys
import tempfile
import zlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_PAGES = ("index", "api", "guides/training-with-flax")
WINDOW = "1280,1600"
BROWSER_TIMEOUT_S = 120
# Text a healthy page never shows. docutils renders a failed directive or reference as a
# "System Message" block or a "problematic" span; a failed import in autodoc leaves a traceback.
ERROR_TEXT = re.compile(r"System Message|Traceback \(most recent call last\)|Page not found|"
                        r"ERR_FILE_NOT_FOUND|(ERROR|WARNING|SEVERE)/\d")
ERROR_CLASSES = {"system-message", "problematic"}


class PageText(html.parser.HTMLParser):
    """The title, the first h1, the visible text and any error-marking classes of a DOM dump."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
            "track", "wbr"}  # elements that never close

    def __init__(self) -> None:
        super().__init__()
        self.title, self.h1 = "", ""
        self.text: list[str] = []
        self.error_classes: set[str] = set()
        self._open: list[str] = []
        self._h1s_closed = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = set((dict(attrs).get("class") or "").split())
        self.error_classes |= classes & ERROR_CLASSES
        if tag not in self.VOID:
            self._open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self._open:
            while self._open.pop() != tag:
                pass
            self._h1s_closed += tag == "h1"

    def handle_data(self, data: str) -> None:
        if "title" in self._open:
            self.title += data
        elif not {"script", "style"} & set(self._open):
            self.text.append(data)
            if "h1" in self._open and not self._h1s_closed:
                self.h1 += data


def expected_title(page: str) -> str:
    """The first ``# heading`` of the page's Markdown source, as Sphinx renders it in <title>."""
    source = ROOT / "docs" / f"{page}.md"
    for line in source.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return re.sub(r"[`*]", "", line[2:]).strip()
    raise SystemExit(f"{source}: no '# ' heading to compare the page title with")


def png_colours(path: pathlib.Path, limit: int = 8) -> int:
    """How many distinct byte values the decoded scanlines hold (up to ``limit``): 1-2 means a
    page of one flat colour. Reads 8-bit PNGs, which is what Chromium writes."""
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise SystemExit(f"{path}: not a PNG")
    pos, idat = 8, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    return min(limit, len(set(zlib.decompress(idat)[1:4096 * 16])))


def browse(browser: str, url: str, profile: str, *args: str) -> subprocess.CompletedProcess:
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--window-size={WINDOW}", *args, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)


def check_page(browser: str, html_dir: pathlib.Path, page: str, shots: pathlib.Path) -> list[str]:
    """Problems found on one page (empty: the page is fine)."""
    path = html_dir / f"{page}.html"
    if not path.is_file():
        return [f"{path} was not built"]
    url = path.resolve().as_uri()
    problems = []
    with tempfile.TemporaryDirectory(prefix="docs-check-") as profile:
        shot = shots / f"{page.replace('/', '-')}.png"
        done = browse(browser, url, profile, f"--screenshot={shot}")
        if done.returncode != 0 or not shot.is_file():
            return [f"{page}: no screenshot (exit {done.returncode}): {done.stderr[-500:]}"]
        if png_colours(shot) <= 2:
            problems.append(f"{page}: the screenshot {shot} is one flat colour (blank page)")
        done = browse(browser, url, profile, "--dump-dom", "--enable-logging=stderr", "--v=0")
    if done.returncode != 0:
        return problems + [f"{page}: --dump-dom failed (exit {done.returncode})"]
    parsed = PageText()
    parsed.feed(done.stdout)
    title, want = " ".join(parsed.title.split()), expected_title(page)
    if not title.startswith(want):
        problems.append(f"{page}: <title> is {title!r}, expected it to start with {want!r}")
    if not parsed.h1.strip():
        problems.append(f"{page}: no <h1> heading in the rendered page")
    text = " ".join(" ".join(parsed.text).split())
    for match in ERROR_TEXT.finditer(text):
        context = text[max(0, match.start() - 80):match.end() + 80]
        problems.append(f"{page}: error text {match.group(0)!r} in the page: ...{context}...")
    if parsed.error_classes:
        problems.append(f"{page}: docutils error markup ({sorted(parsed.error_classes)})")
    for line in done.stderr.splitlines():
        if "CONSOLE" in line and "Uncaught" in line:
            problems.append(f"{page}: JavaScript error: {line.strip()}")
    print(f"{page}: title {title!r}, screenshot {shot}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--html", type=pathlib.Path, default=ROOT / "docs" / "_build" / "html")
    parser.add_argument("--browser", default="chromium")
    parser.add_argument("pages", nargs="*", default=list(DEFAULT_PAGES))
    args = parser.parse_args(argv)
    shots = args.html / "_screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    problems = [p for page in args.pages for p in check_page(args.browser, args.html, page, shots)]
    for problem in problems:
        print(f"FAILED {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
