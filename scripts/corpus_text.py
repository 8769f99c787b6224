"""Plain text out of documentation formats, for the prose pack (scripts/corpus_prose.py).

HTML: the stdlib html.parser, keeping the page's own text and dropping what every page of a
manual repeats (navigation bars, sidebars, tables of contents, scripts, headers and footers).
Man pages: rendered by groff to UTF-8 text without overstrike, then unjustified.
dictd dictionaries: the decompressed body cut into parts at entry boundaries.
"""

from __future__ import annotations

import gzip
import re
import subprocess
from html.parser import HTMLParser

SKIP_TAGS = {"script", "style", "head", "nav", "header", "footer", "noscript", "svg", "button", "form"}
# class or id tokens (exact) of page furniture in the manuals taken (sphinx, DocBook, mdbook, publican)
SKIP_MARKS = {"sphinxsidebar", "sidebar", "navheader", "navfooter", "related", "breadcrumb", "breadcrumbs",
              "headerlink", "menu-bar", "nav-wrapper", "toc", "searchbox", "footer", "nav",
              "global-nav", "hd", "ft", "docnav", "banner", "navigation", "skip-link", "pagination",
              "menu-bar-hover-placeholder", "sidetoc", "mobile-nav-chapters"}
BLOCK_TAGS = {"p", "div", "section", "article", "main", "table", "tr", "ul", "ol", "dl", "dt", "dd",
              "blockquote", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "li", "br", "hr", "figure", "caption"}
PARAGRAPH_TAGS = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "table", "blockquote"}
VOID_TAGS = {"br", "hr", "img", "meta", "link", "input", "wbr", "col", "area", "base", "source"}


class _TextParser(HTMLParser):
    """Collects text; a skipped element is left at its matching end tag (same-name depth count)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_tag: str | None = None
        self.skip_depth = 0
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        if self.skip_tag is not None:
            if tag == self.skip_tag and tag not in VOID_TAGS:
                self.skip_depth += 1
            return
        attr = dict(attrs)
        # lowercased: old DocBook stylesheets write CLASS="NAVHEADER"
        marks = set(f"{attr.get('class') or ''} {attr.get('id') or ''}".lower().split())
        if tag in SKIP_TAGS or (tag not in VOID_TAGS and marks & SKIP_MARKS):
            if tag not in VOID_TAGS:
                self.skip_tag, self.skip_depth = tag, 1
            return
        if tag == "pre":
            self.pre += 1
        if tag in BLOCK_TAGS:
            self._breaks(2 if tag in PARAGRAPH_TAGS else 1)
        if tag == "li":
            self.parts.append("- ")

    def handle_endtag(self, tag):
        if self.skip_tag is not None:
            if tag == self.skip_tag:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_tag = None
            return
        if tag == "pre" and self.pre:
            self.pre -= 1
        if tag in BLOCK_TAGS:
            self._breaks(2 if tag in PARAGRAPH_TAGS else 1)
        elif tag in {"td", "th"}:
            self.parts.append("  ")

    def _breaks(self, n: int) -> None:
        """End the current line with at least n newlines in all (none at the very start)."""
        if not self.parts or self.parts[-1] == "- ":  # a list item's own paragraph starts on its marker line
            return
        tail = "".join(self.parts[-3:])
        have = len(tail) - len(tail.rstrip("\n"))
        if have < n:
            self.parts.append("\n" * (n - have))

    def handle_data(self, data):
        if self.skip_tag is not None:
            return
        if not self.pre:
            data = re.sub(r"\s+", " ", data)
            if not self.parts or self.parts[-1].endswith(("\n", "- ")):
                data = data.lstrip()
        if data:
            self.parts.append(data)


def html_to_text(html: str) -> str:
    """The readable text of one HTML page."""
    parser = _TextParser()
    parser.feed(html)
    parser.close()
    text = "".join(parser.parts).replace("\u00b6", "")
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(line if line.strip() else "" for line in lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


def render_man(data: bytes) -> str:
    """A man page (roff source) as plain UTF-8 text; '' when groff cannot render it."""
    cmd = ["groff", "-t", "-man", "-Tutf8", "-rHY=0", "-rLL=90n", "-P-c", "-P-b", "-P-u", "-P-o"]
    result = subprocess.run(cmd, input=data, capture_output=True, timeout=60)
    if result.returncode != 0:
        return ""
    text = result.stdout.decode("utf-8", errors="replace")
    lines = [re.sub(r"(?<=\S) {2,}(?=\S)", " ", line.rstrip()) for line in text.split("\n")]
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


def maybe_gunzip(name: str, data: bytes) -> tuple[str, bytes]:
    """(name without .gz, bytes) decompressed when the name ends in .gz or .dz."""
    if name.endswith((".gz", ".dz")):
        return name[:-3], gzip.decompress(data)
    return name, data


def split_dictionary(text: str, part_chars: int) -> list[str]:
    """A dictd body cut into parts of about part_chars at entry starts (a line at column 0 after a
    blank line), dropping the 00-database-* header entries."""
    entries = re.split(r"\n\n(?=\S)", text)
    entries = [e for e in entries if not e.startswith("00-database") and not e.startswith("00database")]
    parts, current, size = [], [], 0
    for entry in entries:
        current.append(entry)
        size += len(entry) + 2
        if size >= part_chars:
            parts.append("\n\n".join(current))
            current, size = [], 0
    if current:
        parts.append("\n\n".join(current))
    return parts
