"""``python -m traceml.sdk.autorun SCRIPT [ARGS]``: a training script, instrumented, unchanged.

``traceml run`` has torchrun start each rank this way (``torchrun --module
traceml.sdk.autorun SCRIPT ARGS``; ``--no-auto-instrument`` or ``TRACEML_AUTO_INSTRUMENT=0``
starts ``SCRIPT`` itself instead). The rank's telemetry starts (``traceml.init()``), zero-code
steps are turned on (:mod:`traceml.sdk.auto`), and then ``SCRIPT`` runs as ``__main__`` the
way ``python SCRIPT ARGS`` runs it:

* ``sys.argv`` is ``[SCRIPT, *ARGS]`` (``SCRIPT`` as given), ``sys.path[0]`` the script's
  directory (symbolic links resolved), ``__file__`` its absolute path, ``__name__`` ``"__main__"``,
  ``__package__`` and ``__spec__`` None; ``sys.modules["__main__"]`` is the script's module (for
  pickling and multiprocessing) and the script is compiled without this module's ``__future__``
  flags. ``runpy.run_path`` is not used because it cannot give both ``sys.argv[0]`` as given
  and an absolute ``__file__``, and it swaps ``sys.modules["__main__"]`` back when the script
  returns.
* An uncaught exception prints its traceback from the script's own frame on (this module's
  frames left out) and exits with code 1; ``SystemExit`` (``sys.exit(n)``) and
  ``KeyboardInterrupt`` propagate as they would. stdout and stderr are the script's alone.

Fail-open: if TraceML cannot start, one ``traceml:`` warning, and the script runs all the same.
"""

import builtins
import importlib.machinery
import io
import os
import sys
import types


def _instrument() -> None:
    try:
        from traceml.sdk import auto

        auto.start()
    except Exception as exc:  # TraceML itself cannot be imported
        print(
            f"traceml: zero-code instrumentation failed ({type(exc).__name__}: {exc}); "
            "training continues without it",
            file=sys.stderr,
            flush=True,
        )


def run_script(script: str, args: list[str]) -> None:
    """Run ``script`` with ``args`` as ``python script args`` would, in this process.

    Raises:
        SystemExit: the script's own, or code 1 after an uncaught exception's traceback.
        KeyboardInterrupt: as the script raised it.
    """
    path = os.path.abspath(script)
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=path,
        __cached__=None,
        __builtins__=builtins,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
        __spec__=None,
        __package__=None,
    )
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    sys.modules["__main__"] = module
    code = None
    try:
        with io.open_code(path) as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
        exec(code, module.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        tb = exc.__traceback__  # a SyntaxError keeps none of it, as under plain Python
        while tb is not None and tb.tb_frame.f_code is not code:
            tb = tb.tb_next
        # The hook prints the exception's own traceback: it must start at the script's frame.
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.exit(1)


def main() -> None:
    """Entry point: ``sys.argv[1]`` is the script, the rest its arguments."""
    if len(sys.argv) < 2:
        sys.exit("usage: python -m traceml.sdk.autorun SCRIPT [ARGS...]")
    script, *args = sys.argv[1:]
    _instrument()
    run_script(script, args)


if __name__ == "__main__":
    main()
