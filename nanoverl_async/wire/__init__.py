"""What crosses the wire between roles: trajectories, versioned weights, and the keys that authenticate both."""
