"""The README's quick start is real code: extracted from the README and run as a user would run it
(a file of their own, named as the model entry point), at a tiny size on the real services."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from rich.console import Console

from diloco.run import train

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def quick_start() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_quick_start_trains_a_users_flax_model(tiny_config, tmp_path, monkeypatch):
    code = quick_start()
    assert 20 <= len(code.strip().splitlines()) <= 32       # "about 25 lines"
    (tmp_path / "my_model.py").write_text(code)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{ROOT}")    # the learners import the user's file
    monkeypatch.syspath_prepend(str(tmp_path))
    # the README runs on the defaults (preset decoupled); steps ~30 ms (see test_end_to_end)
    cfg = tiny_config(preset="decoupled", model={"entry": "my_model:spec", "options": {}},
                      inner={"steps": 60, "warmup_steps": 5},
                      regions=[{"name": "us", "learners": 2, "speed": 0.25}, {"name": "eu", "learners": 2, "speed": 0.25}])
    s = train(cfg, progress=False, console=Console(quiet=True))
    c = s["contributions"]
    assert c["applied"] == c["published"] > 0 and c["applied_twice"] == 0
    assert s["eval_loss_end"] < s["eval_loss_start"]
    sys.modules.pop("my_model", None)
