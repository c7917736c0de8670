"""Simulators that run the project's own policies at scales no test cluster reaches."""
