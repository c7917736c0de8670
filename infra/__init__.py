"""Thin adapters at the edges (Kafka, Redis, TensorStore) and the local service stack."""
