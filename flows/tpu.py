"""Deprecated: the GKE and TPU-VM job backends moved to `diloco.infra.tpu`, beside the local one
(`diloco.infra.jobs`). Names read from here are those, with a DeprecationWarning; removed next release."""

from __future__ import annotations

import warnings

from diloco.infra import tpu as _tpu


def __getattr__(name: str):
    value = getattr(_tpu, name)  # AttributeError for a name the backends never had
    warnings.warn(f"diloco.flows.tpu.{name} moved to diloco.infra.tpu.{name}; diloco.flows.tpu goes next release",
                  DeprecationWarning, stacklevel=2)
    return value
