"""One typed config for a run, loaded from YAML with `--set key=value` overrides.

Every section is a pydantic model with `extra="forbid"`, so a misspelt key or a bad value fails at
load time with the dotted key and what is allowed.

The parts, all importable from here:
- sections.py: ConfigError, the section base and id/env/path patterns, the training sections (model,
  data, regions, inner, parallel, outer, fragments, syncer)
- services.py: the service sections (transport, state, store, joins, run, monitoring, chaos)
- backend.py: where the processes run (SliceConfig, BackendConfig)
- secrets.py: redact_url and resolve_secret (no secret goes in a config)
- model.py: Config, the top-level model with its cross-section checks, and PRESETS
- loading.py: build_config, load_config, parse_overrides, dump_config, merge_sections
"""

from diloco.config.backend import BackendConfig, SliceConfig
from diloco.config.loading import build_config, dump_config, load_config, merge_sections, parse_overrides
from diloco.config.model import PRESETS, Config
from diloco.config.secrets import redact_url, resolve_secret
from diloco.config.sections import (BUILTIN_MODEL, ConfigError, DataConfig, FragmentsConfig, InnerConfig, ModelConfig,
                                    OuterConfig, ParallelConfig, RegionConfig, SyncerConfig, TransformerOptions)
from diloco.config.services import (ChaosConfig, JoinConfig, MonitoringConfig, RunConfig, StateConfig, StoreConfig,
                                    TransportConfig)

__all__ = [
    "BUILTIN_MODEL", "PRESETS", "BackendConfig", "ChaosConfig", "Config", "ConfigError", "DataConfig",
    "FragmentsConfig", "InnerConfig", "JoinConfig", "ModelConfig", "MonitoringConfig", "OuterConfig",
    "ParallelConfig", "RegionConfig", "RunConfig", "SliceConfig", "StateConfig", "StoreConfig", "SyncerConfig",
    "TransformerOptions", "TransportConfig",
    "build_config", "dump_config", "load_config", "merge_sections", "parse_overrides", "redact_url",
    "resolve_secret",
]
