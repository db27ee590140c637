"""The old import path of the planted runs' constants: ``tests/helpers/planted.py``; the runs
themselves come from the ``planted`` fixture (tests/conftest.py)."""

from helpers.planted import DELAY_MS, HAS_TENSORBOARD, STEPS, PlantedRun, side_by_side

__all__ = ["DELAY_MS", "HAS_TENSORBOARD", "STEPS", "PlantedRun", "side_by_side"]
