#!/usr/bin/env python3
"""Fails when a relative link in the docs points at nothing.

Usage: check-links.py [FILE.md ...]   (default: README.md and docs/**/*.md)

Every link of a Markdown file — `[text](target)`, `![alt](target)` and reference
definitions `[name]: target` — whose target is not a URL (`http://`, `https://`,
`mailto:`, or any other scheme) must name a file or folder that exists, relative to the
linking file; a `#anchor`, alone or after a Markdown file, must be a heading of that file
(GitHub's slugs: lower case, punctuation dropped, spaces as hyphens, `-1`, `-2`, … for
repeats) or an explicit `<a id="…">`/`<a name="…">`. Links and headings inside code
(fenced blocks and inline spans) are not links. Each broken link is printed as
`file:line: target (why)`; the exit status is 1 if there is any.
"""

import os
import re
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
EXPLICIT_ANCHOR = re.compile(r"<a\s[^>]*\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)
# `](target)` or `](<target>)`, with an optional title after the target.
INLINE = re.compile(r"\]\(\s*(<[^>]*>|[^\s)]*)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def blank_code_spans(line):
    """The line with the inside of each inline code span replaced by spaces."""
    out, i = [], 0
    while i < len(line):
        if line[i] != "`":
            out.append(line[i])
            i += 1
            continue
        run = len(line[i:]) - len(line[i:].lstrip("`"))
        ticks = line[i : i + run]
        end = line.find(ticks, i + run)
        while end != -1 and line[end + run : end + run + 1] == "`":
            end = line.find(ticks, end + run + 1)
        if end == -1:
            out.append(ticks)
            i += run
            continue
        out.append(ticks + " " * (end - i - run) + ticks)
        i = end + run
    return "".join(out)


def prose_lines(text):
    """(line number, line) of every line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if fence is None:
            if opened:
                fence = opened.group(1)
                continue
            yield number, line
        elif opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
            if not line.strip().strip(fence[0]):
                fence = None


def slug(heading):
    """GitHub's anchor for a heading's text (github-slugger, on the rendered text)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


def anchors(path, cache={}):
    """Every anchor a Markdown file defines."""
    if path not in cache:
        found, seen = set(), {}
        previous = None
        for _, line in prose_lines(path.read_text(encoding="utf-8")):
            found.update(a.lower() for a in EXPLICIT_ANCHOR.findall(line))
            heading = HEADING.match(line)
            text = heading.group(2) if heading else None
            if text is None and previous and previous.strip() and SETEXT.match(line):
                text = previous.strip()
            previous = line
            if text is None:
                continue
            base = slug(text)
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        cache[path] = found
    return cache[path]


def links(path):
    """(line number, target) of every link in a Markdown file."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = blank_code_spans(line)
        reference = REFERENCE.match(line)
        if reference:
            yield number, reference.group(1)
            continue
        for match in INLINE.finditer(line):
            yield number, match.group(1)


def broken(path, target):
    """Why `target`, linked from `path`, resolves to nothing; None when it resolves."""
    target = target.strip()
    if target.startswith("<") and target.endswith(">"):
        target = target[1:-1]
    if not target or SCHEME.match(target) or target.startswith("//"):
        return None
    file_part, _, anchor = target.partition("#")
    file_part = unquote(file_part.split("?", 1)[0])
    if file_part.startswith("/"):
        linked = ROOT / file_part.lstrip("/")
    elif file_part:
        linked = path.parent / file_part
    else:
        linked = path
    if not linked.exists():
        return "no such file"
    if anchor and linked.is_file() and linked.suffix.lower() in (".md", ".markdown"):
        if unquote(anchor).lower() not in anchors(linked.resolve()):
            return f"no heading or anchor '#{anchor}' in {shown(linked)}"
    return None


def shown(path):
    """A path as printed: relative to the repository's root."""
    return os.path.relpath(path.resolve(), ROOT)


def main(argv):
    if argv:
        files = [Path(a).resolve() for a in argv]
    else:
        files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    problems = []
    for path in files:
        for number, target in links(path):
            why = broken(path, target)
            if why:
                problems.append(f"{shown(path)}:{number}: {target} ({why})")
    for problem in problems:
        print(problem, flush=True)
    if problems:
        print(f"{len(problems)} broken link(s) in {len(files)} file(s)", file=sys.stderr)
        return 1
    print(f"links: {len(files)} file(s), every relative link resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
