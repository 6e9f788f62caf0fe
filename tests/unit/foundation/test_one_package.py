"""One import name (setup.cfg): the product's folders install as `tandem.launcher`,
`tandem.trainer`, ...; nothing in the project imports them by their folder names, which a user's
own `reward.py` or `trainer.py` would shadow (or be shadowed by). Read from the files, importing
nothing; tests/integration/foundation/test_one_package_installed.py installs the wheel."""
from __future__ import annotations

import ast
import configparser
import os
import re
from pathlib import Path

from test_import_cycles import UNDER_TANDEM

REPO = Path(__file__).resolve().parents[3]
# A line that may import a folder by its own name (code or a string of code): such files are parsed.
OLD_IMPORT = re.compile(rf"\b(?:import|from)\s+(?:{'|'.join(UNDER_TANDEM)})\b")


def _options() -> configparser.SectionProxy:
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    return parser["options"]


def _listed(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip()]


def test_every_package_folder_installs_under_tandem():
    options = _options()
    package_dir = dict(line.replace(" ", "").split("=") for line in _listed(options["package_dir"]))
    assert package_dir == {"tandem": "tandem", **{f"tandem.{f}": f for f in UNDER_TANDEM}}
    folders = sorted(p.parent.relative_to(REPO).as_posix() for folder in ("tandem", *UNDER_TANDEM)
                     for p in (REPO / folder).rglob("__init__.py"))
    expected = sorted(f if f == "tandem" else "tandem." + f.replace("/", ".") for f in folders)
    assert sorted(_listed(options["packages"])) == expected, "setup.cfg [options] packages must list every package"


def _project_files():
    """Every .py file of the checkout but those of tools' and runs' folders (.venv, build, runs)."""
    for top, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "runs", "__pycache__")]
        yield from (Path(top) / f for f in files if f.endswith(".py"))


def test_no_module_imports_the_folders_by_their_own_names():
    found = []
    for path in _project_files():
        name = path.relative_to(REPO).as_posix()
        text = path.read_text()
        if not OLD_IMPORT.search(text):   # most files: no such line, nothing to parse
            continue
        tree = ast.parse(text, name)
        found += [f"{name}:{line}: {m}" for line, m in _old_imports(tree)]
        # Code in strings too (`python -c` probes, scripts a test writes): run from the checkout,
        # an old name would still import, from the working directory, and hide the mistake.
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
                try:
                    inner = ast.parse(node.value)
                except (SyntaxError, ValueError):
                    continue   # prose
                found += [f"{name}:{node.lineno} (in a string): {m}" for _, m in _old_imports(inner)]
    assert not found, "import these as tandem.<name>:\n" + "\n".join(found)


def _old_imports(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        out += [(node.lineno, m) for m in modules if m.split(".")[0] in UNDER_TANDEM]
    return out


def test_the_console_script_and_role_commands_name_the_package():
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    assert _listed(parser["options.entry_points"]["console_scripts"]) == ["tandem = tandem.launcher.cli:entry"]
    from tandem.launcher.roles import tandem_argv

    assert tandem_argv("controller")[1:3] == ["-m", "tandem.launcher.cli"]
