"""Decoupled DiLoCo: learners publish fragment deltas to Kafka; a syncer merges them into TensorStore.

The public API lives in `diloco.api`, whose `__all__` is the one list of public names; each is
importable from here too (`diloco.Session`, `diloco.ModelSpec`, `diloco.train`, `diloco.restore`,
...), loaded on first use so that the command line starts quickly.
"""

import importlib
import importlib.util

__version__ = "0.1.0"


def __getattr__(name: str):
    # A dunder probe (copy, pickle, inspect) or a submodule `from diloco import x` is about to load
    # never loads the API: only what may be one of its names does.
    if name.startswith("__") or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        raise AttributeError(f"module 'diloco' has no attribute {name!r}")
    api = importlib.import_module("diloco.api")
    if name not in api.__all__:
        raise AttributeError(f"module 'diloco' has no attribute {name!r}")
    return getattr(api, name)


def __dir__():
    return sorted([*globals(), *importlib.import_module("diloco.api").__all__])
