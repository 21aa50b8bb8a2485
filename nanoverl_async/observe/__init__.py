"""Observing a run: metrics.jsonl, the plot, the trace, recorded batches."""
