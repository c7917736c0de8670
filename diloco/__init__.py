"""Decoupled DiLoCo: learners publish fragment deltas to Kafka; a syncer merges them into TensorStore."""

__version__ = "0.1.0"
