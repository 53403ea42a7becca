"""The speculative sensor lives in engine/worker/sensor.py: the loader attaches it for the utility
estimator too, and worker/ must not import speculative/. Re-exported here for existing imports."""

from __future__ import annotations

from engine.worker.sensor import SpecSensor, sensor_for

__all__ = ["SpecSensor", "sensor_for"]
