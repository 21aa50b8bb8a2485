"""The staleness simulator and its cost model: what-if runs of the buffer's own rules on a traced run's costs."""
