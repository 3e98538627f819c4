"""Goodput from the event log: the report, its chart and its Prometheus metrics."""
