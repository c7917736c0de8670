"""Every ```python block of README.md and docs/*.md runs as written, unless its first line says why it
cannot here (`# doc-test: skip, <why>`: it needs the broker and Redis, a finished run, or is a fragment);
and every `section.key` the docs name is a key of the config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from diloco.config import Config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = "# doc-test: skip, "


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, code) of each ```python block in a Markdown file."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


BLOCKS = [(path, line, code) for path in DOCS for line, code in python_blocks(path)]


def test_the_docs_have_blocks_and_each_skipped_one_says_why():
    assert len(BLOCKS) >= 10
    for path, line, code in BLOCKS:
        first = code.splitlines()[0]
        assert not first.startswith("# doc-test") or (first.startswith(SKIP) and len(first) > len(SKIP) + 10), \
            f"{path.name}:{line}: {first!r}"


@pytest.mark.parametrize("path,line,code", [b for b in BLOCKS if not b[2].startswith(SKIP)],
                         ids=[f"{b[0].name}:{b[1]}" for b in BLOCKS if not b[2].startswith(SKIP)])
def test_a_doc_block_runs_as_written(path, line, code, monkeypatch):
    monkeypatch.chdir(ROOT)                     # configs/local.yaml and examples/ as in a checkout
    monkeypatch.syspath_prepend(str(ROOT))
    exec(compile(code, f"{path.name}:{line}", "exec"), {"__name__": f"doc_block_{line}"})


FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "csv", "png", "txt", "log", "toml", "bin"}


def _config_keys_named(text: str) -> list[str]:
    """Each `section.key` in backticks (alone, or followed by `=`, `:`, a space or `[`) whose section is
    one of the config's, leaving out file names (`data.py`)."""
    sections = set(Config.model_fields)
    return sorted({m.group(1) for m in re.finditer(r"`([a-z_]+\.[a-z_]+)(?:[ =:`\[])", text)
                   if m.group(1).split(".")[0] in sections and m.group(1).split(".")[1] not in FILE_SUFFIXES})


def test_every_config_key_the_docs_name_exists():
    named = {key: path.name for path in DOCS for key in _config_keys_named(path.read_text())}
    assert len(named) >= 40, sorted(named)
    missing = []
    for key, where in sorted(named.items()):
        section, field = key.split(".")
        if field not in getattr(Config.model_fields[section].annotation, "model_fields", {}):  # regions: a list
            missing.append(f"{where}: {key}")
    assert missing == [], missing
