"""The docs' command blocks, checked without running them: every one is labelled and its
`doc-test` markers are well formed, every `tandem` command line (skipped and shortened ones
included) parses with the real CLI, every config file it names loads with its overrides, and
every `make` target exists, with the config its recipe runs loading under the doc's shortened
arguments. tests/integration/foundation/test_doc_commands.py runs the commands; this catches a
renamed option or target in seconds, and covers the commands that test cannot run here.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from doc_commands import REPO, command_blocks, fenced_blocks, strip_comment, unlabelled_command_fences

from tandem.launcher.config import load_config

BLOCKS = command_blocks()
COMMANDS = [(b, c) for b in BLOCKS for c in b.commands()]
MAKE_TARGETS = set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))


def _ids(pairs):
    return [f"{b.where} {c.text[:40]}" for b, c in pairs]


def test_the_docs_have_command_blocks_and_none_hides_in_an_unlabelled_fence():
    assert {b.path.name for b in BLOCKS} >= {"README.md", "cluster.md", "generation.md", "running.md"}
    assert unlabelled_command_fences() == [], "label these fences ```bash (commands) or ```console ($ lines)"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_markers_are_well_formed_and_each_matches_a_command(block):
    assert block.errors == []
    commands = block.commands()
    assert commands, f"{block.where}: a command block with no command"
    for rule in block.rules:
        if rule.prefix is not None:
            assert any(rule.matches(c.text) for c in commands), f"{block.where}: marker for `{rule.prefix}` matches nothing"


def test_the_marker_grammar(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("<!-- doc-test: skip `tandem status` needs SLURM -->\n"
                   "<!-- doc-test: quick `make train-math` ARGS=\"a=1\" -->\n"
                   "```console\n$ make train-math   # trains\nout\n$ tandem status --exp r \\\n   --x # c\n"
                   "$ echo '#not a comment'\n```\n<!-- doc-test: quick -->\n```bash\nls\n```\n")
    first, second = fenced_blocks(doc)
    cmds = first.commands()
    assert [c.text for c in cmds] == ["make train-math", "tandem status --exp r --x", "echo '#not a comment'"]
    assert cmds[0].run_form(first.rules) == 'make train-math ARGS="a=1"' and cmds[1].skip == "needs SLURM"
    assert cmds[2].skip is None and cmds[2].run_form(first.rules) == cmds[2].text
    assert second.errors and strip_comment("a 'b # c' # d") == "a 'b # c'"


def _tandem_argv(text: str) -> list[str] | None:
    words = shlex.split(text)
    while words and words[0] in ("sudo",):
        words = words[1:]
    if words and Path(words[0]).name == "tandem":
        return words[1:]
    return None


TANDEM = [(b, c) for b, c in COMMANDS if _tandem_argv(c.text) is not None]


@pytest.mark.parametrize(("block", "cmd"), TANDEM, ids=_ids(TANDEM))
def test_every_tandem_command_line_parses_and_its_config_loads(block, cmd, monkeypatch, tmp_path):
    from tandem.launcher.cli import build_parser
    monkeypatch.delenv("TANDEM_MODELS", raising=False)
    monkeypatch.delenv("TANDEM_RUNS", raising=False)
    monkeypatch.chdir(REPO)
    for text in {cmd.text, cmd.run_form(block.rules)}:
        try:
            args = build_parser().parse_args(_tandem_argv(text))
        except SystemExit:
            pytest.fail(f"{block.where}: `{text}` does not parse (see the usage above)")
        file = getattr(args, "file", None)
        if file and Path(file).exists():
            load_config(file, getattr(args, "overrides", None) or [])
        elif file:
            assert cmd.skip or any(r.prefix is None for r in block.rules if r.kind == "skip"), \
                f"{block.where}: `{text}` names {file}, which does not exist, and is run by the doc test"


MAKE = [(b, c) for b, c in COMMANDS if c.text.startswith("make ")]


@pytest.mark.parametrize(("block", "cmd"), MAKE, ids=_ids(MAKE))
def test_every_make_target_exists_and_a_training_target_loads_its_config(block, cmd):
    words = shlex.split(cmd.run_form(block.rules))[1:]
    targets = [w for w in words if "=" not in w and not w.startswith("-")]
    assert targets and set(targets) <= MAKE_TARGETS, f"{block.where}: `{cmd.text}`: no such make target"
    variables = dict(w.split("=", 1) for w in words if "=" in w)
    for target in targets:
        recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
        # `tandem run $(or $(EXP),CONFIG)`, or the Makefile's `$(call rl_run,NAME,CONFIG)`
        config = re.search(r"tandem run \$\(or \$\(EXP\),(\S+)\)|\$\(call rl_run,[^,]+,([^)]+)\)",
                           recipe.group(1)) if recipe else None
        assert config or not target.startswith("train-"), f"{target}: no experiment file found in its recipe"
        if config:
            load_config(REPO / (config.group(1) or config.group(2)), variables.get("ARGS", "").split())
