"""Evaluating the embedded model pair by stage: text and perplexity, routing and cache statistics,
decoding, the measurement of one pair, and the model card.

The entry point is `python -m models.embedded.evaluate` (models/embedded/evaluate.py).
"""
