"""The load plan: every decision of a load with its reason, made before anything is allocated
(`resolve.py`), as plain data (`load_plan.py`, `execution.py`); the worker builds to it."""
