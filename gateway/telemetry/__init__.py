"""Observing the gateway: Prometheus metrics (traces and logs join here later)."""
