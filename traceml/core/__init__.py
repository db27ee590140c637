"""What the SDK, the launcher and the aggregator share, importing none of them: run-directory
layout and names (:mod:`.rundir`), the aggregator's endpoint (:mod:`.endpoint`), the ``traceml``
logger (:mod:`.log`) and running a typer command (:mod:`.cli`). See docs/architecture.md."""
