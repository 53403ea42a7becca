"""Training the embedded model pair by stage: configs, data, balancing, the loop, checkpoints and flags.

The entry point is `python -m models.embedded.train` (models/embedded/train.py).
"""
