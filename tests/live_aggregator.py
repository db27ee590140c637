"""The old import path of :class:`LiveAggregator` and its helpers:
``tests/helpers/aggregator.py``."""

from helpers.aggregator import LiveAggregator, finish, make_client, step

__all__ = ["LiveAggregator", "finish", "make_client", "step"]
