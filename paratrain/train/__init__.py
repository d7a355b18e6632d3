"""The training loop, its callbacks, schedules and metrics."""
