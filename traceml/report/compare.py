"""``traceml compare A B``: what changed from run A (baseline) to run B, and a verdict.

Each metric of :func:`~traceml.report.flat.flatten` present in either run gets its
delta (B - A) and a status: ``improved``, ``regressed`` or ``unchanged`` (within
:data:`EQUIVALENT_PCT`). Step parts are judged against A's step time (input wait going from
0.4 to 0.6 ms is +50% of itself but noise for the step). The verdict comes from the key
metrics (step time, peak allocated memory, GPU utilisation), so it also works for CPU-only
runs, which only have step time; throughput and MFU are shown, not key (a bigger batch raises
them while it slows the step, and the step-time verdict already judges the same job):

* IMPROVEMENT — some key metric improved, none regressed;
* REGRESSION — some key metric regressed, none improved;
* MIXED — some improved and some regressed;
* EQUIVALENT — no key metric moved by more than :data:`EQUIVALENT_PCT`;
* INCONCLUSIVE — a run cannot stand for its configuration: it has no step time (no step
  data, or too few steps), its verdict is INSUFFICIENT_DATA, a rank crashed or was stopped,
  or its summary is partial.
"""

from __future__ import annotations

import random
import textwrap
from dataclasses import dataclass

from traceml.analysis.document import PARTS
from traceml.analysis.stats import lower_median, median, percentile
from traceml.report.flat import flatten
from traceml.report.fmt import missing_text, num

#: A change smaller than this share of the baseline is noise: ``unchanged`` (%).
EQUIVALENT_PCT = 5.0
#: The gate documented for CI (``--fail-on-regression 5``): a step-time regression fails it
#: when its whole 95 % interval lies above 0 and its estimate exceeds 5 % (%).
DEFAULT_GATE_PCT = 5.0
#: Bootstrap of the step-time change: replicates, confidence level, RNG seed (a rerun of the
#: same compare gives the same interval).
BOOTSTRAP_REPLICATES = 1000
BOOTSTRAP_CONFIDENCE = 95.0
BOOTSTRAP_SEED = 0
#: Exit code of ``traceml compare --fail-on-regression`` when a key metric regressed by more
#: than the given percentage (2 is for usage errors).
REGRESSION_EXIT_CODE = 3
#: Exit code of ``traceml compare --fail-on-regression`` when the verdict is INCONCLUSIVE: a
#: gate must not pass a run it could not judge.
INCONCLUSIVE_EXIT_CODE = 4
#: Version of the compare document's layout (compare.json).
COMPARE_VERSION = 1

VERDICTS = ("IMPROVEMENT", "REGRESSION", "EQUIVALENT", "MIXED", "INCONCLUSIVE")


@dataclass(frozen=True)
class _Metric:
    name: str
    unit: str
    lower_is_better: bool
    key: bool
    vs_step: bool = False  # judged as a share of A's step time


METRICS = (
    _Metric("step_time_ms", "ms", True, True),
    _Metric("step_time_p95_ms", "ms", True, False),
    *(_Metric(f"{p}_ms", "ms", True, False, vs_step=True) for p in PARTS),
    _Metric("peak_allocated_bytes", "bytes", True, True),
    _Metric("gpu_util_pct", "%", False, True),
    _Metric("samples_per_s", "1/s", False, False),
    _Metric("tokens_per_s", "1/s", False, False),
    _Metric("mfu_pct", "%", False, False),
)


def _metric_row(m: _Metric, a: dict, b: dict) -> dict | None:
    va, vb = a.get(m.name), b.get(m.name)
    if va is None and vb is None:
        return None
    row = {
        "name": m.name,
        "unit": m.unit,
        "better": "lower" if m.lower_is_better else "higher",
        "key": m.key,
        "a": va,
        "b": vb,
        "delta": None,
        "delta_pct": None,
        "status": "not_comparable",
    }
    if va is None or vb is None:
        return row
    delta = vb - va
    row["delta"] = round(delta, 3)
    row["delta_pct"] = round(100.0 * delta / va, 1) if va else None
    basis = a.get("step_time_ms") if m.vs_step else va
    change_pct = 100.0 * delta / basis if basis else 0.0
    if abs(change_pct) < EQUIVALENT_PCT or delta == 0:
        row["status"] = "unchanged"
    else:
        row["status"] = "improved" if (delta < 0) == m.lower_is_better else "regressed"
    row["change_pct"] = round(change_pct, 1)
    return row


def _typical(samples: list[list[float]], rng: random.Random | None) -> float:
    """The key step-time statistic of one run: the lower median across ranks of each rank's
    median; with ``rng``, of one bootstrap resample (with replacement) of every rank."""
    medians = []
    for values in samples:
        drawn = rng.choices(values, k=len(values)) if rng else values
        medians.append(median(drawn))
    return lower_median(medians)


def change_interval(a: list[list[float]], b: list[list[float]]) -> tuple[float, float] | None:
    """The :data:`BOOTSTRAP_CONFIDENCE` % interval of the step-time change from A to B (%).

    Args:
        a, b: each run's ``ranks[].step_time_sample_ms`` (one list per rank, ms).

    Percentile bootstrap over steps, :data:`BOOTSTRAP_REPLICATES` replicates, seeded with
    :data:`BOOTSTRAP_SEED`: each replicate resamples every rank's steps of both runs and takes
    100 x (B's statistic / A's - 1). None when a run has no sample.
    """
    a, b = [v for v in a if v], [v for v in b if v]
    if not a or not b:
        return None
    rng = random.Random(BOOTSTRAP_SEED)
    changes = sorted(
        100.0 * (_typical(b, rng) / _typical(a, rng) - 1.0) for _ in range(BOOTSTRAP_REPLICATES)
    )
    tail = (100.0 - BOOTSTRAP_CONFIDENCE) / 2.0
    return (round(percentile(changes, tail), 1), round(percentile(changes, 100.0 - tail), 1))


def _unfit(summary: dict, labels: dict) -> str:
    """Why a run cannot be compared ("" when it can): insufficient data, a rank that did not
    complete, or a partial summary."""
    if labels.get("verdict") == "INSUFFICIENT_DATA":
        return "has too little step data (INSUFFICIENT_DATA)"
    if summary["run"].get("missing_ranks"):
        return f"is partial ({missing_text(summary)})"
    ended = [r["rank"] for r in summary["ranks"] if r["end"]["state"] != "completed"]
    if ended:
        return f"did not complete on ranks {ended}"
    return ""


def compare(a: dict, b: dict, *, a_path: str = "", b_path: str = "") -> dict:
    """The compare document of summary documents ``a`` (baseline) and ``b``."""
    (ma, la), (mb, lb) = flatten(a), flatten(b)
    rows = [r for r in (_metric_row(m, ma, mb) for m in METRICS) if r is not None]
    interval = change_interval(
        *([r.get("step_time_sample_ms") for r in doc["ranks"]] for doc in (a, b))
    )
    for r in rows:
        if r["name"] == "step_time_ms" and interval and r["status"] != "not_comparable":
            r["change_ci_pct"] = list(interval)
    key = [r for r in rows if r["key"]]
    improved = [r["name"] for r in key if r["status"] == "improved"]
    regressed = [r["name"] for r in key if r["status"] == "regressed"]
    step = next((r for r in rows if r["name"] == "step_time_ms"), None)
    unfit = [
        f"run {n} {why}"
        for n, doc, labels in (("A", a, la), ("B", b, lb))
        for why in [_unfit(doc, labels)]
        if why
    ]
    if step is None or step["status"] == "not_comparable":
        which = [n for n, m in (("A", ma), ("B", mb)) if "step_time_ms" not in m]
        verdict = "INCONCLUSIVE"
        why = f"Run {' and '.join(which)} has no step time (no step data or too few steps)."
    elif unfit:
        verdict = "INCONCLUSIVE"
        why = "; ".join(unfit).capitalize() + ": its figures do not stand for its setup."
    else:
        if improved and regressed:
            verdict = "MIXED"
        elif improved:
            verdict = "IMPROVEMENT"
        elif regressed:
            verdict = "REGRESSION"
        else:
            verdict = "EQUIVALENT"
        why = (
            f"Step time {step['a']:.2f} → {step['b']:.2f} ms "
            f"({step['delta']:+.2f} ms, {step['delta_pct']:+.1f}%)"
        )
        why += (f"; improved: {', '.join(improved)}" if improved else "") + (
            f"; regressed: {', '.join(regressed)}" if regressed else ""
        )
        if not improved and not regressed:
            why += f"; no key metric moved by {EQUIVALENT_PCT:g}% or more"
        why += "."
    notes = []
    if a["run"]["world_size"] != b["run"]["world_size"]:
        notes.append(
            f"World sizes differ (A {a['run']['world_size']}, B {b['run']['world_size']}): "
            "per-step figures compare, throughput does not."
        )
    if la.get("clock") != lb.get("clock"):
        notes.append(
            f"Clocks differ (A {la.get('clock')}, B {lb.get('clock')}): phase times are not "
            "measured the same way."
        )
    kind_a, kind_b = la["verdict"], lb["verdict"]
    return {
        "compare_version": COMPARE_VERSION,
        "verdict": verdict,
        "summary": why,
        "a": _side(a, la, a_path),
        "b": _side(b, lb, b_path),
        "diagnosis_change": {
            "a": kind_a,
            "b": kind_b,
            "changed": kind_a != kind_b,
        },
        "metrics": rows,
        "notes": notes,
        "equivalent_pct": EQUIVALENT_PCT,
    }


def _side(summary: dict, labels: dict, path: str) -> dict:
    p = summary["primary_diagnosis"]
    return {
        "path": path,
        "run_name": summary["run"]["run_name"],
        "world_size": summary["run"]["world_size"],
        "clock": labels.get("clock"),
        "verdict": p["kind"],
        "severity": p["severity"],
        "ranks": p["ranks"],
    }


def regressions_beyond(document: dict, pct: float) -> list[dict]:
    """Key metrics of a compare document that got worse by more than ``pct`` percent.

    Step time, when both runs carry a step-time sample, is judged on its interval
    (``change_ci_pct``): it must lie wholly above 0 (B slower beyond the noise of its steps)
    and the estimate must exceed ``pct``. Other metrics, one figure per run, on the estimate.
    """
    worse = []
    for r in document["metrics"]:
        if not r["key"] or abs(r.get("change_pct") or 0.0) <= pct:
            continue
        ci = r.get("change_ci_pct")
        if ci is not None and ci[0] > 0 and r["delta"] > 0:
            worse.append(r)
        elif ci is None and r["status"] == "regressed":
            worse.append(r)
    return worse


def interval_text(row: dict) -> str:
    """``"95% interval +1.2% to +3.4%"`` of a metric row with ``change_ci_pct``, else ``""``."""
    ci = row.get("change_ci_pct")
    if ci is None:
        return ""
    return f"{BOOTSTRAP_CONFIDENCE:g}% interval {ci[0]:+.1f}% to {ci[1]:+.1f}%"


def _value(row: dict, side: str) -> str:
    v = row[side]
    if v is None:
        return "-"
    if row["unit"] == "bytes":
        return f"{v / 2**20:.0f} MiB"
    return num(v, 2 if row["unit"] == "ms" else 1)


def render_compare_text(document: dict) -> str:
    """The compare document for a human, verdict first, at most 80 columns."""
    a, b = document["a"], document["b"]
    width = 80
    head = f"TraceML compare · A '{a['run_name']}' → B '{b['run_name']}'"
    lines = [head if len(head) <= width else head[: width - 1] + "…", "=" * width]

    def wrap(label: str, text: str) -> None:
        lines.extend(
            textwrap.wrap(text, width, initial_indent=f"{label:<10}", subsequent_indent=" " * 10)
        )

    wrap("VERDICT", document["verdict"])
    wrap("WHY", document["summary"])
    change = document["diagnosis_change"]
    wrap(
        "DIAGNOSIS",
        f"{change['a']} ({a['severity']}) → {change['b']} ({b['severity']})"
        + ("" if change["changed"] else " (unchanged)"),
    )
    for note in document["notes"]:
        wrap("NOTE", note)
    lines += ["", f"{'metric':<22}{'A':>11}{'B':>11}{'delta':>11}{'%':>8}  status"]
    for r in document["metrics"]:
        delta = (
            "-"
            if r["delta"] is None
            else (
                f"{r['delta'] / 2**20:+.0f} MiB" if r["unit"] == "bytes" else f"{r['delta']:+.2f}"
            )
        )
        pct = "-" if r["delta_pct"] is None else f"{r['delta_pct']:+.1f}"
        lines.append(
            f"{r['name'] + (' *' if r['key'] else ''):<22}{_value(r, 'a'):>11}"
            f"{_value(r, 'b'):>11}{delta:>11}{pct:>8}  {r['status']}"
        )
    for r in document["metrics"]:
        if interval_text(r):
            lines += textwrap.wrap(
                f"{r['name']} change: {interval_text(r)} (bootstrap over steps, "
                f"{BOOTSTRAP_REPLICATES} replicates, seed {BOOTSTRAP_SEED}).",
                width,
            )
    lines += textwrap.wrap(
        f"* key metric (decides the verdict). A change under {document['equivalent_pct']:g}% "
        "of A's value (for step parts: of A's step time) is unchanged.",
        width,
    )
    return "\n".join(lines) + "\n"
