"""Observing and tuning a run: metrics.jsonl, the plot, the trace, recorded batches, the staleness simulator."""
