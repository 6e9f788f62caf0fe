"""The docs point only into the repository: every relative link of README.md and docs/*.md, and
every path written in code that climbs out of its folder (`../...`), resolves to a file of the
checkout. A reader of a fresh clone has nothing beside it (docs/architecture.md once cited a
design file next to the checkout)."""
from __future__ import annotations

import re

import pytest
from doc_commands import REPO, doc_files

LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`(\.\./[^`\s]+)`")


def _targets(path):
    text = path.read_text()
    for m in LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if target and not re.match(r"^[a-z]+:", target):
            yield target
    yield from (m.group(1) for m in CODE_PATH.finditer(text))


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_every_relative_path_stays_in_the_checkout_and_exists(doc):
    bad = []
    for target in _targets(doc):
        resolved = (doc.parent / target).resolve()
        if not resolved.is_relative_to(REPO.resolve()) or not resolved.exists():
            bad.append(target)
    assert bad == [], f"{doc.relative_to(REPO)} points outside the checkout or at nothing: {bad}"
