"""The test suite's one set of helpers (``tests/conftest.py`` re-exports the old names):

- :mod:`helpers.aggregator`: a real aggregator process, free ports, the store's rows (shared
  with the benchmarks: ``benchmarks/aggregator_process.py``);
- :mod:`helpers.jobs`: running ``traceml run`` for real, its artifacts, its processes;
- :mod:`helpers.waiting`: waiting on a condition with a deadline (never a fixed sleep);
- :mod:`helpers.netns`: two hosts on one machine (network namespaces);
- :mod:`helpers.batches`: wire batches and node exit reports built by hand;
- :mod:`helpers.components`: the markers a test needs for what it starts.
- :mod:`helpers.cputime`: each test's CPU seconds, children included (``--cpu-times=N``);
- :mod:`helpers.schedule`: the order of the ``serial`` phase's tests.
"""
