"""One way to tell the user something: the ``traceml`` logger (traceml/core/log.py).

Each case runs a real Python process whose only TraceML call is ``traceml.init()`` with no
aggregator configured: the SDK's one warning line is the message under test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import traceml_env

WARNING = (
    "traceml: no aggregator configured (run the script with `traceml run`, or set "
    "TRACEML_AGGREGATOR and TRACEML_RUN_NAME); telemetry is off"
)


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=traceml_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_sdk_warning_is_one_line_in_the_traceml_format():
    result = run_python("import traceml; print(traceml.init())")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "False\n"
    assert result.stderr == WARNING + "\n"


def test_the_user_silences_it_the_standard_way():
    result = run_python(
        """
        import logging, traceml
        logging.getLogger("traceml").setLevel(logging.ERROR)
        print(traceml.init())
        """
    )
    assert result.returncode == 0, result.stderr
    assert (result.stdout, result.stderr) == ("False\n", "")


def test_a_level_set_before_import_is_kept():
    result = run_python(
        """
        import logging
        logging.getLogger("traceml.sdk").setLevel(logging.CRITICAL)
        import traceml
        print(traceml.init())
        """
    )
    assert (result.stdout, result.stderr) == ("False\n", "")


def test_basic_config_of_the_script_does_not_print_it_twice():
    result = run_python(
        """
        import logging, traceml
        logging.basicConfig(level=logging.DEBUG, format="ROOT %(message)s")
        traceml.init()
        """
    )
    assert result.stderr == WARNING + "\n"


def test_the_user_routes_it_to_a_handler_of_their_own():
    result = run_python(
        """
        import logging, sys, traceml
        from traceml.core import log
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append((record.name, record.levelname, record.getMessage()))
        logger = logging.getLogger("traceml")
        logger.removeHandler(log.HANDLER)
        logger.addHandler(Keep())
        traceml.init()
        print(records)
        """
    )
    assert result.stderr == ""
    message = WARNING.removeprefix("traceml: ")
    assert result.stdout == repr([("traceml.sdk", "WARNING", message)]) + "\n"


def test_closed_or_missing_stderr_never_raises_into_training():
    result = run_python(
        """
        import sys, traceml
        sys.stderr.close()
        a = traceml.init()
        sys.stderr = None
        b = traceml.init()
        import logging
        logging.getLogger("traceml.launcher").error("error: %s", object())
        print(a, b)
        """
    )
    assert result.returncode == 0
    assert result.stdout == "False False\n"


def test_a_broken_pipe_on_stderr_never_raises_into_training():
    """stderr is a pipe whose reader has gone (a ``| head`` that exited)."""
    code = textwrap.dedent(
        """
        import traceml
        ok = [traceml.init() for _ in range(3)]
        print(ok, flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=traceml_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stderr.close()  # the reader is gone before the first line
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert out == b"[False, False, False]\n"


def test_the_aggregator_logger_keeps_its_own_prefix(capsys):
    from traceml.core import log

    log.get("aggregator").info("serving")
    log.get("launcher").error("error: refused")
    log.get().warning("100% %s literal")  # no arguments: the message is not %-formatted
    assert capsys.readouterr().err == (
        "traceml-aggregator: serving\ntraceml: error: refused\ntraceml: 100% %s literal\n"
    )
