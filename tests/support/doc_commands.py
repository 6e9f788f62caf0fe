"""The shell commands of README.md and docs/*.md, read from their fenced blocks, with the
`doc-test` markers that say how a test runs them (tests/integration/foundation/test_doc_commands.py
runs them; tests/unit/foundation/test_doc_command_blocks.py checks the markers and labels).

A command block is a fence labelled `bash`, `sh`, `shell` (every non-comment line is a command;
a trailing `\\` continues it) or `console` (lines starting with `$ ` are commands, the rest is
output). Markers are HTML comments (invisible when rendered) on the lines right above the fence:

    <!-- doc-test: skip REASON -->                   the whole block is not run, because REASON
    <!-- doc-test: skip `PREFIX` REASON -->          nor are its commands starting with PREFIX
    <!-- doc-test: quick `PREFIX` ARGS -->           those commands run with ARGS appended
                                                     (a long run, shortened: same command line)
    <!-- doc-test: background `PREFIX` READY -->     those commands run in the background until
                                                     the block ends; the next command waits for
                                                     READY in their output (a server)

PREFIX matches a command equal to it or starting with it and a space; a command takes the rules
of every marker that matches it. Commands run as written otherwise, in document order, README.md
first, every file in one scratch copy of the checkout (so a later block may use what an earlier
one made: the tiny model of `make train-math`, the run of `tandem run`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(.*?)\s*-->\s*$")
RULE = re.compile(r"^(skip|quick|background)(?:\s+`([^`]+)`)?(?:\s+(.*))?$")
# A fence with no label whose lines read as commands must say what it is.
COMMANDISH = re.compile(r"^\s*(\$ |tandem |make |python |\.venv/bin/|sbatch |sudo |curl )")


@dataclass
class Rule:
    kind: str            # skip | quick | background
    prefix: str | None   # None: the whole block (skip only)
    arg: str             # the reason, the appended arguments, or the ready text

    def matches(self, command: str) -> bool:
        return self.prefix is None or command == self.prefix or command.startswith(self.prefix + " ")


@dataclass
class Command:
    text: str            # as written, comments and prompt removed
    skip: str | None = None
    background: str | None = None

    def run_form(self, rules: list[Rule]) -> str:
        extra = " ".join(r.arg for r in rules if r.kind == "quick" and r.matches(self.text))
        return f"{self.text} {extra}" if extra else self.text


@dataclass
class Block:
    path: Path
    line: int            # of the opening fence, 1-based
    lang: str
    body: list[str]
    rules: list[Rule] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    def commands(self) -> list[Command]:
        out = []
        for text in _command_lines(self.body, self.lang):
            cmd = Command(text)
            for r in self.rules:
                if r.matches(text) and r.kind == "skip":
                    cmd.skip = r.arg
                elif r.matches(text) and r.kind == "background":
                    cmd.background = r.arg
            out.append(cmd)
        return out


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file (any label), with the markers above it parsed."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[start + 1:j]]
        block = Block(path, start + 1, lang, body)
        k = start - 1
        while k >= 0 and MARKER.match(lines[k]):
            _parse_rule(block, MARKER.match(lines[k]).group(1))
            k -= 1
        blocks.append(block)
        i = j + 1
    return blocks


DOC_FILE = re.compile(r"^\s*<!--\s*doc-file:\s*(\S+)\s*-->\s*$")


def page_files(path: Path) -> dict[str, str]:
    """The files a page shows whole, to be saved as they are: each fence right below a
    `<!-- doc-file: PATH -->` line, by PATH (a test writes them out and runs what the page says)."""
    lines = path.read_text().splitlines()
    out = {}
    for block in fenced_blocks(path):
        above = lines[block.line - 2] if block.line >= 2 else ""
        m = DOC_FILE.match(above)
        if m:
            out[m.group(1)] = "\n".join(block.body) + "\n"
    return out


def command_blocks() -> list[Block]:
    return [b for p in doc_files() for b in fenced_blocks(p) if b.lang in SHELL_LANGS]


def _parse_rule(block: Block, text: str) -> None:
    m = RULE.match(text)
    if not m:
        block.errors.append(f"unreadable marker {text!r} (skip|quick|background, see tests/support/doc_commands.py)")
        return
    kind, prefix, arg = m.group(1), m.group(2), (m.group(3) or "").strip()
    if not arg:
        block.errors.append(f"marker {text!r} needs {'a reason' if kind == 'skip' else 'an argument'}")
    if kind != "skip" and prefix is None:
        block.errors.append(f"marker {text!r}: {kind} needs a `command prefix`")
    block.rules.insert(0, Rule(kind, prefix, arg))


def strip_comment(line: str) -> str:
    """The line without a trailing shell comment (a `#` after whitespace, outside quotes)."""
    quote, prev = None, " "
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "#" and prev.isspace():
            return line[:i].rstrip()
        prev = c
    return line.rstrip()


def _command_lines(body: list[str], lang: str) -> list[str]:
    if lang == "console":   # `$ ` lines and their `\` continuations; the rest is output
        kept, going_on = [], False
        for ln in body:
            if ln.startswith("$ ") or going_on:
                kept.append(ln[2:] if ln.startswith("$ ") and not going_on else ln)
                going_on = strip_comment(ln).endswith("\\")
        body = kept
    out, pending = [], ""
    for raw in body:
        line = strip_comment(raw) if not raw.lstrip().startswith("#") else ""
        if pending:
            line = pending + " " + line.strip()
            pending = ""
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        if line.strip():
            out.append(line.strip())
    if pending:
        out.append(pending.strip())
    return out


def unlabelled_command_fences() -> list[str]:
    """Fences with no label that hold a command: they would escape the test."""
    return [b.where for p in doc_files() for b in fenced_blocks(p)
            if not b.lang and any(COMMANDISH.match(ln) for ln in b.body)]

