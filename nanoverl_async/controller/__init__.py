"""Processes and their life: the checks before roles start, Ray actors, start-up phases, the reaper."""
