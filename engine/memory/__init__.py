"""The memory planner: what the machine has (machine.py), what the model needs (footprint.py),
and where each part goes (planner.py). `serve`, `generate` and `plan` share it."""
