"""Apache Beam batch pipelines: corpus to token shards (`corpus`), run telemetry to reports (`telemetry`).

Both run on the in-process FnApiRunner here and unchanged on Dataflow or Flink; see docs/pipelines.md.
"""

from diloco import logs

# Beam's BigQuery client module warns on the root logger, at import, that apitools is missing: the
# pipelines use no BigQuery
logs.quiet("", "apitools not found")
