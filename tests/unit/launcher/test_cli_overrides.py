"""`key=value` overrides go anywhere after the file, before or after an option: `tandem run FILE
--resume trainer.total_steps=80` continues a run for longer (argparse alone refuses a positional
after an option). Anything else left over is still an error naming it."""
from __future__ import annotations

import pytest

from tandem.launcher.cli import build_parser, parse


@pytest.mark.parametrize("argv, overrides", [
    (["run", "f.yaml", "--resume", "trainer.total_steps=80"], ["trainer.total_steps=80"]),
    (["run", "f.yaml", "a.b=1", "--resume", "c.d=2"], ["a.b=1", "c.d=2"]),
    (["config", "check", "f.yaml", "--skip-files", "gen.threads=2"], ["gen.threads=2"]),
])
def test_overrides_after_an_option_are_overrides(argv, overrides):
    args = parse(build_parser(), argv)
    assert args.overrides == overrides and args.file == "f.yaml"


@pytest.mark.parametrize("argv, named", [
    (["run", "f.yaml", "--resume", "--bogus"], "--bogus"),
    (["run", "f.yaml", "--resume", "not-an-override"], "not-an-override"),
    (["audit", "--exp", "e", "a.b=1"], "a.b=1"),     # a command without overrides takes none
])
def test_anything_else_left_over_is_refused_by_name(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        parse(build_parser(), argv)
    assert e.value.code == 2 and f"unrecognized arguments: {named}" in capsys.readouterr().err
