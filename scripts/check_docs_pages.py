"""Open pages of the built documentation in headless Chromium, screenshot them and check them.

Run by ./scripts/docs-check after ./scripts/docs; standard library only. For each page it

* takes a screenshot (``<html dir>/_screenshots/<page>.png``) and checks that the PNG is not one
  flat colour (a blank or unstyled page);
* reads the DOM after the page's scripts ran (``--dump-dom``) and checks that the ``<title>`` starts
  with the first heading of the page's Markdown source, that there is an ``<h1>``, that the text
  holds no error (a docutils system message or unresolved reference, a Python traceback, a
  "page not found"), and that the browser console logged no uncaught JavaScript error.

Then it lays out every page of the site (or the PAGEs given) at each ``--widths`` width (default
1280 and 1920 px; one browser start, a frame of that width per page) and fails when a table or
code block is wider than the article's column: a table wider than its (scrolling) container, a
``pre`` or ``div.highlight`` whose ``scrollWidth`` exceeds its ``clientWidth`` (the reader would
have to scroll it), or any of them reaching past the column's right edge. Each failure names the
page, the width and the element (its number on the page and its header row or longest line).

Usage: python scripts/check_docs_pages.py [--html docs/_build/html] [--browser chromium]
       [--widths 1280,1920] [PAGE ...]
PAGE is a path below the HTML directory without ``.html`` (default: the index, the API page, the
Flax training guide, the migration pages and the Performance page for the screenshot checks;
every page for the overflow check).
"""
from __future__ import annotations

import argparse
import html
import html.parser
import json
import pathlib
import re
import struct
import subprocess
import sys
import tempfile
import zlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_PAGES = ("index", "api", "guides/training-with-flax", "migration/from-torch",
                 "migration/from-jmp", "migration/from-flax", "performance")
WINDOW = "1280,1600"
OVERFLOW_WIDTHS = (1280, 1920)  # the widths the layout is held to (docs/_static/jamp.css)
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


def browse(browser: str, url: str, profile: str, *args: str,
           timeout: int = BROWSER_TIMEOUT_S) -> subprocess.CompletedProcess:
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--window-size={WINDOW}", *args, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


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


# A page of iframes, one per page and width, read back with --dump-dom: after every frame loaded
# (its styles and scripts included), it measures each table and code block of each frame's
# article and leaves the findings as JSON in a <script> element. One browser start for the site.
OVERFLOW_PROBE = """<!DOCTYPE html>
<html><body>%(frames)s<script>
function measure(win) {
  var doc = win.document;
  var article = doc.querySelector("article.bd-article, div.body, main") || doc.body;
  var right = article.getBoundingClientRect().right
              - parseFloat(win.getComputedStyle(article).paddingRight);
  var found = [], seen = {table: 0, code: 0};
  function check(kind, el, wide, label) {
    seen[kind] += 1;
    var overhang = el.getBoundingClientRect().right - right;
    if (wide || overhang > 1) {
      found.push({kind: kind, index: seen[kind], overhang: Math.round(overhang),
                  label: label});
    }
  }
  article.querySelectorAll("table, pre, div.highlight").forEach(function (el) {
    if (el.tagName === "TABLE") {
      var head = el.querySelector("tr");
      var label = head ? Array.from(head.children).map(function (cell) {
        return cell.textContent.trim(); }).join(" | ") : "";
      // A table never scrolls itself: its (scrolling) container is the room it has.
      var room = el.parentElement.clientWidth;
      check("table", el, el.scrollWidth > room + 1, label + " (" + el.scrollWidth + " px in "
            + room + " px)");
    } else if (el.tagName === "PRE" && el.parentElement.closest("div.highlight")) {
      return;  // measured with its div.highlight
    } else {
      var pre = el.tagName === "PRE" ? el : (el.querySelector("pre") || el);
      var lines = pre.textContent.split("\\n").map(function (line) { return line.trimEnd(); });
      var longest = lines.reduce(function (a, b) { return b.length > a.length ? b : a; }, "");
      var wide = [el, pre].some(function (e) { return e.scrollWidth > e.clientWidth + 1; });
      check("code", el, wide, longest.trim() + " (" + pre.scrollWidth + " px in "
            + pre.clientWidth + " px)");
    }
  });
  return found;
}
window.addEventListener("load", function () {
  var results = Array.from(document.querySelectorAll("iframe")).map(function (frame) {
    var result = {page: frame.dataset.page, width: frame.dataset.width};
    try {
      result.found = measure(frame.contentWindow);
    } catch (error) {
      result.error = String(error);
    }
    return result;
  });
  var out = document.createElement("script");
  out.type = "application/json";
  out.id = "docs-check-overflow";
  out.textContent = JSON.stringify(results).replace(/</g, "\\u003c");
  document.body.appendChild(out);
});
</script></body></html>
"""
OVERFLOW_RESULT = re.compile(r'<script type="application/json" id="docs-check-overflow">(.*?)'
                             r"</script>", re.DOTALL)
ELEMENT_NAMES = {"table": "table", "code": "code block"}


def site_pages(html_dir: pathlib.Path) -> list[str]:
    """Every page Sphinx built from a source document (the copies in ``_sources``)."""
    sources = html_dir / "_sources"
    pages = sorted(re.sub(r"\.(md|rst)(\.txt)?$", "", path.relative_to(sources).as_posix())
                   for path in sources.rglob("*") if path.is_file())
    if not pages:
        raise SystemExit(f"{sources}: no page sources (html_copy_source off?)")
    return pages


def overflow_problems(browser: str, html_dir: pathlib.Path, pages: list[str],
                      widths: list[int]) -> list[str]:
    """Tables and code blocks wider than their page's article column, at each window width."""
    missing = [f"{html_dir / page}.html was not built" for page in pages
               if not (html_dir / f"{page}.html").is_file()]
    if missing:
        return missing
    frames = "".join(f'<iframe src="{html.escape(page)}.html" width="{width}" height="1600" '
                     f'data-page="{html.escape(page)}" data-width="{width}"></iframe>'
                     for page in pages for width in widths)
    # Beside the pages, so the frames' relative URLs resolve; file:// frames may be read by it
    # with --allow-file-access-from-files.
    probe = html_dir / "_docs_check_overflow.html"
    probe.write_text(OVERFLOW_PROBE % {"frames": frames}, encoding="utf-8")
    try:
        with tempfile.TemporaryDirectory(prefix="docs-check-") as profile:
            done = browse(browser, probe.resolve().as_uri(), profile, "--dump-dom",
                          "--allow-file-access-from-files", timeout=BROWSER_TIMEOUT_S * 3)
    finally:
        probe.unlink()
    found = OVERFLOW_RESULT.search(done.stdout)
    if done.returncode != 0 or found is None:
        return [f"the overflow check did not run (browser exit {done.returncode}): "
                f"{done.stderr[-500:]}"]
    problems = []
    for result in json.loads(found.group(1)):
        where = f"{result['page']} at {result['width']} px"
        if "error" in result:
            problems.append(f"{where}: could not be measured: {result['error']}")
        for item in result.get("found", []):
            past = f", {item['overhang']} px past the column" if item["overhang"] > 1 else ""
            problems.append(f"{where}: {ELEMENT_NAMES[item['kind']]} {item['index']} is wider "
                            f"than the column{past}: {item['label'][:160]!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--html", type=pathlib.Path, default=ROOT / "docs" / "_build" / "html")
    parser.add_argument("--browser", default="chromium")
    parser.add_argument("--widths", default=",".join(map(str, OVERFLOW_WIDTHS)),
                        help="window widths in px for the overflow check, comma-separated")
    parser.add_argument("pages", nargs="*")
    args = parser.parse_args(argv)
    shots = args.html / "_screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    pages = args.pages or list(DEFAULT_PAGES)
    problems = [p for page in pages for p in check_page(args.browser, args.html, page, shots)]
    widths = [int(width) for width in args.widths.split(",")]
    overflow_pages = args.pages or site_pages(args.html)
    problems += overflow_problems(args.browser, args.html, overflow_pages, widths)
    print(f"overflow: {len(overflow_pages)} pages measured at {args.widths} px", flush=True)
    for problem in problems:
        print(f"FAILED {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
