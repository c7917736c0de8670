"""Apache Beam batch pipelines: corpus to token shards (`corpus`), run telemetry to reports (`telemetry`).

Both run on the in-process FnApiRunner here and unchanged on Dataflow or Flink; see docs/pipelines.md.
"""
