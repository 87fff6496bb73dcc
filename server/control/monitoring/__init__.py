"""Watching what is served: SLOs, drift, payload logs, the dashboard, the observability tasks."""
