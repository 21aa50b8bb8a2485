"""The replay buffer: the admission gate, the staleness-bounded store, and the service roles talk to."""
