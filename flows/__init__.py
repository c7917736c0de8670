"""Prefect flows: a run's life cycle (`decoupled-diloco`), evals of checkpoints (`diloco-eval`), reports,
and the production job backend (`tpu`). See docs/prefect.md."""
