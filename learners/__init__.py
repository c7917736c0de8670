"""Learners: independent JAX + optax jobs that train locally and publish fragment deltas."""
