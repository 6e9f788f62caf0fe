"""An experiment's sources, read and merged, and where each setting came from, so an error
blames what the user wrote.

A resolved config mixes four sources: dataclass defaults, the YAML file, command-line
overrides and the `trainer.algorithm` preset; some keys are copies of others (`trainer.
max_staleness: ${controller.max_staleness}`). A problem found on the resolved values is
attributed here: a copy's problem goes to the key it copies (and is then said once, not once per
copy), a preset's to `trainer.algorithm`, and the key is located where it was last set — the
command line (`command line: rollout.temperature`) for an override, `file:line` for the file.
Blaming the file's line for an override, or a key the user never wrote, sends them to the wrong
place. `explain` words OmegaConf's own errors (an unknown key with the nearest valid one, a wrong
type, a bad interpolation) the same way.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)


class ConfigError(Exception):
    """A user mistake in an experiment file or override; the message says what and where, and
    `hint` (printed after it) what else the user can do."""
    hint = ""


# A value that is exactly one interpolation of another key: a copy ("${controller.max_staleness}").
_COPY = re.compile(r"^\$\{([A-Za-z_][\w.]*)\}$")
ALGORITHM_KEY = "trainer.algorithm"


def yaml_line(path: Path, dotted: str) -> int | None:
    """Line (1-based) of a dotted key in a YAML file, or of its deepest parent that is there;
    None if not even the first part is."""
    try:
        node = yaml.compose(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    line = None
    for part in dotted.split("."):
        if not isinstance(node, yaml.MappingNode):
            return line
        for k, v in node.value:
            if getattr(k, "value", None) == part:
                line, node = k.start_mark.line + 1, v
                break
        else:
            return line
    return line


def where_in_file(path: Path | None, key: str) -> str:
    """`file:line: key` (or `file: key`, or just `key` without a file)."""
    if path is None:
        return key
    line = yaml_line(path, key) if key else None
    return f"{path}:{line}: {key}" if line else f"{path}: {key}"


def dotted_keys(node, prefix: str = "") -> set[str]:
    """Every key a YAML mapping sets, dotted ("trainer.optim.lr"), parents included."""
    out = set()
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{prefix}{k}"
            out.add(key)
            out |= dotted_keys(v, key + ".")
    return out


def copies_in(node, prefix: str = "") -> dict[str, str]:
    """{key: the key it copies} for every value of an unresolved config that is `${other.key}`."""
    out: dict[str, str] = {}
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                out |= copies_in(v, key + ".")
            elif isinstance(v, str) and (m := _COPY.match(v)):
                out[key] = m.group(1)
    return out


def _covers(keys: set[str], key: str) -> bool:
    """`key` or one of its parents is in `keys` (an override `rollout={...}` sets its children)."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in keys for i in range(1, len(parts) + 1))


@dataclass
class Provenance:
    """What set each key: the file, an override, the preset, or a copy of another key."""
    path: Path | None = None
    file_keys: set[str] = field(default_factory=set)
    override_keys: set[str] = field(default_factory=set)
    preset_keys: set[str] = field(default_factory=set)
    copies: dict[str, str] = field(default_factory=dict)

    def written(self, key: str) -> bool:
        return _covers(self.override_keys, key) or key in self.file_keys

    def user_key(self, key: str) -> str:
        """The key the user wrote that `key`'s value comes from: itself if written, else the
        key it copies (followed through copies of copies), else `trainer.algorithm` for a preset
        value, else `key` (a default)."""
        seen = set()
        while not self.written(key) and key in self.copies and key not in seen:
            seen.add(key)
            key = self.copies[key]
        if not self.written(key) and key in self.preset_keys:
            return ALGORITHM_KEY
        return key

    def where(self, key: str) -> str:
        """`command line: key` when an override set it last, else `file:line: key`."""
        if _covers(self.override_keys, key):
            return f"command line: {key}"
        return where_in_file(self.path, key)

    def lines(self, problems: list[tuple[str, str]]) -> list[str]:
        """One `where: message` line per key the user wrote, in order; a copy's or a preset's
        problem is said under that key (naming the derived key), once."""
        out, said = [], set()
        for key, msg in problems:
            blamed = self.user_key(key)
            if blamed in said:
                continue
            said.add(blamed)
            if blamed != key:
                via = "the preset's value of" if blamed == ALGORITHM_KEY else "as"
                msg = f"{msg} ({via} {key})"
            # "=3 does not divide ...": a message that goes on from its key (launcher/preflight.py)
            out.append(f"{self.where(blamed)}{'' if msg.startswith('=') else ': '}{msg}")
        return out


def _did_you_mean(schema: DictConfig, full_key: str) -> str:
    parent_key, _, leaf = full_key.rpartition(".")
    try:
        parent = OmegaConf.select(schema, parent_key) if parent_key else schema
    except OmegaConfBaseException:
        parent = None
    keys = list(parent.keys()) if isinstance(parent, DictConfig) else []
    close = difflib.get_close_matches(leaf, [str(k) for k in keys], n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{'.'.join(filter(None, [parent_key, close[0]]))}'?)"
    if keys:
        return f" (valid keys here: {', '.join(map(str, keys))})"
    return ""


def explain(err: OmegaConfBaseException, schema: DictConfig) -> tuple[str, str]:
    """(full_key, message) for an OmegaConf error, worded for a user."""
    key = getattr(err, "full_key", None) or ""
    msg = getattr(err, "msg", None) or str(err).splitlines()[0]
    if isinstance(err, ConfigKeyError):
        return key, "unknown key" + _did_you_mean(schema, key)
    if isinstance(err, MissingMandatoryValue):
        return key, "missing required value"
    if isinstance(err, ValidationError):
        return key, f"wrong type: {msg.splitlines()[0]}"
    if isinstance(err, InterpolationResolutionError):
        return key, f"bad interpolation: {msg.splitlines()[0]}"
    return key, msg.splitlines()[0]


# YAML 1.1 (PyYAML's, and OmegaConf's) reads `7:1` as a base-60 integer, 421: a ratio, a time or
# any colon-joined digits came out as a number nobody wrote (`launcher.gen_train_ratio=7:1` was
# "got '421'"). YAML 1.2 has no base 60; neither do these loaders.
_BASE60 = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")


def _without_base60(loader):
    class Loader(loader):
        pass
    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
        for first, resolvers in loader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(_INT, re.compile(
        r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"), list("-+0123456789"))
    Loader.add_implicit_resolver(_FLOAT, re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))
    return Loader


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
# libyaml's parser where PyYAML was built with it (its wheels are): the same safe constructor,
# several times faster to parse.
_FAST_LOADER = _without_base60(getattr(yaml, "CSafeLoader", yaml.SafeLoader))
_LOADER = _without_base60(yaml.SafeLoader)


def parse_yaml(text: str):
    """`yaml.safe_load` without base-60 numbers, parsed by libyaml. Its error messages are worded
    apart from the pure-Python parser's, so a text that fails is parsed again by the latter."""
    try:
        return yaml.load(text, Loader=_FAST_LOADER)
    except yaml.YAMLError:
        return yaml.load(text, Loader=_LOADER)


def plain_overrides(overrides) -> list[str]:
    """The overrides with a colon-joined number quoted, so OmegaConf's YAML 1.1 reader keeps it
    the text it is (see _BASE60)."""
    out = []
    for ov in overrides:
        key, eq, value = ov.partition("=")
        out.append(f"{key}={value.strip()!r}" if eq and _BASE60.match(value.strip()) else ov)
    return out


def read_yaml(src: Path, sections: tuple[str, ...]) -> dict:
    """The file's top-level mapping of sections; a ConfigError says what is wrong and where."""
    try:
        raw = parse_yaml(src.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{src}: no such file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{src}:{mark.line + 1}:{mark.column + 1}" if mark else str(src)
        problem = getattr(e, "problem", None) or str(e)
        ctx, ctx_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
        if ctx and ctx_mark:
            problem += f" ({ctx} at line {ctx_mark.line + 1})"
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{src}: the top level must be a mapping of sections "
                          f"({', '.join(sections)}), got {type(raw).__name__}")
    return raw


def merged(fresh: DictConfig, raw: dict | None, overrides) -> DictConfig:
    """`fresh` (a copy of the schema, which this changes) with the file's values, then the
    overrides, merged in: `unsafe_merge` merges in place, where `merge` first copies its first
    config. (launcher/config.py makes the copy by unpickling bytes made once, in a sixth of a
    deep copy's time; merging the file and overrides so took a fifth of the time of two merges.)"""
    parts = ([OmegaConf.create(raw)] if raw is not None else []) + \
        ([OmegaConf.from_dotlist(plain_overrides(overrides))] if overrides else [])
    return OmegaConf.unsafe_merge(fresh, *parts)


def merged_naming_each_culprit(schema: DictConfig, src: Path | None, raw: dict | None,
                               overrides) -> tuple[DictConfig, list[str]]:
    """The merge of `merged`, one setting of the file and one override at a time: what merges,
    and a line naming each that does not (where it was written, what is wrong), so a typo never
    hides the next mistake."""
    cfg, lines = schema, []
    for key, value in _leaves(raw or {}):
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.create(_nested(key, value)))
        except OmegaConfBaseException as e:
            full, msg = explain(e, schema)
            lines.append(f"{where_in_file(src, full or key)}: {msg}")
    for ov, plain in zip(overrides, plain_overrides(overrides), strict=True):
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([plain]))
        except OmegaConfBaseException as e:
            key, msg = explain(e, schema)
            lines.append(f"override '{ov}': {key}: {msg}")
    return cfg, lines


def _leaves(node, prefix: str = ""):
    """(dotted key, value) of every setting of a YAML mapping (a list is one value)."""
    for k, v in node.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _nested(dotted: str, value) -> dict:
    out = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def scalars(value):
    """Every scalar of a plain (to_container) config."""
    if isinstance(value, dict):
        for v in value.values():
            yield from scalars(v)
    elif isinstance(value, list):
        for v in value:
            yield from scalars(v)
    else:
        yield value
