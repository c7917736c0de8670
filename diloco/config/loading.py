"""From YAML, keyword sections and `--set key=value` overrides to a validated Config, and back to YAML."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from diloco.config.model import PRESETS, Config
from diloco.config.secrets import redact_url
from diloco.config.sections import ConfigError


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.0.c` in a nested dict/list tree, creating dicts on the way."""
    keys = dotted.split(".")
    node: Any = tree
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError(f"--set {dotted}: {key!r} is not an index of a list of {len(node)}")
            key = int(key)
            if last:
                node[key] = value
            else:
                node = node[key]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {'.'.join(keys[:i])} is not a section")
        if last:
            node[key] = value
        else:
            node = node.setdefault(key, {})


def parse_overrides(pairs: list[str]) -> list[tuple[str, Any]]:
    out = []
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set {pair!r}: expected key=value, e.g. inner.steps=200")
        key, raw = pair.split("=", 1)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", key):
            raise ConfigError(f"--set {pair!r}: {key!r} is not a dotted key")
        out.append((key, yaml.safe_load(raw) if raw else None))
    return out


def build_config(tree: dict[str, Any], overrides: list[str] = ()) -> Config:
    """Defaults, then the preset's settings, then `tree` on top (sections merge, lists replace), then
    the overrides."""
    tree, pairs = _plain(tree), parse_overrides(list(overrides))
    preset = next((v for k, v in reversed(pairs) if k == "preset"), tree.get("preset", "decoupled"))
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ConfigError(f"config key preset: must be one of {', '.join(PRESETS)} (got {preset!r})")
    tree = _merge(_merge(Config().model_dump(mode="json"), PRESETS[preset]), tree)
    for key, value in pairs:
        _set_path(tree, key, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load YAML (None = embedded defaults), apply `key=value` overrides, validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    return build_config(tree, overrides)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def merge_sections(base: dict, top: dict) -> dict:
    """`top` over `base`, key by key inside sections (lists replace): one key given keeps the rest."""
    return _merge(base, _plain(top))


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def _plain(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_plain(v) for v in tree]
    return tree


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "literal_error":
            msg = f"must be one of {e['ctx']['expected']}"
        msg = msg.removeprefix("Value error, ")
        if not e["loc"]:  # a cross-field check: its message names the keys
            lines.append(msg)
            continue
        inp = e.get("input")
        secret = "password" in where or "@" in str(inp)  # a user info, URL or not: not echoed
        shown = "" if isinstance(inp, (dict, list, tuple)) or secret else f" (got {redact_url(inp) if isinstance(inp, str) else inp!r})"
        lines.append(f"config key {where}: {msg}{shown}")
    return "invalid config:\n  " + "\n  ".join(lines)
