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
    """A user mistake in an experiment file or override; the message says what and where."""


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


# libyaml's parser where PyYAML was built with it (its wheels are): the same safe constructor,
# several times faster to parse.
_FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_yaml(text: str):
    """`yaml.safe_load`, parsed by libyaml. Its error messages are worded apart from the
    pure-Python parser's, so a text that fails is parsed again by the latter for its error."""
    try:
        return yaml.load(text, Loader=_FAST_LOADER)
    except yaml.YAMLError:
        return yaml.safe_load(text)


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
        ([OmegaConf.from_dotlist(list(overrides))] if overrides else [])
    return OmegaConf.unsafe_merge(fresh, *parts)


def merged_naming_the_culprit(schema: DictConfig, src: Path | None, raw: dict | None, overrides) -> DictConfig:
    """The merge of `merged`, the file first, then one override at a time; the first that fails
    raises a ConfigError naming it."""
    cfg = schema
    if raw is not None:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.create(raw))
        except OmegaConfBaseException as e:
            key, msg = explain(e, schema)
            raise ConfigError(f"{where_in_file(src, key)}: {msg}") from None
    for ov in overrides:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([ov]))
        except OmegaConfBaseException as e:
            key, msg = explain(e, schema)
            raise ConfigError(f"override '{ov}': {key}: {msg}") from None
    return cfg


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
