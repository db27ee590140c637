"""Why the steps are slow: the primary diagnosis and the other step-time findings.

Candidates, each with the step time it costs every step (``impact_ms``):

* stragglers (INPUT_STRAGGLER, H2D_STRAGGLER, COMPUTE_STRAGGLER, STRAGGLER, NODE_STRAGGLER):
  in DDP the gradient all-reduce makes every rank's step time equal, so the slow rank is found
  from each rank's *own* parts of the step: input wait, H2D, forward + optimizer, residual.
  Backward is never used for this: it holds the all-reduce, where the fast ranks wait for the
  slow one. Neither is a residual that is a wait: a rank whose time outside the measured phases
  is matched by another rank's own work or time outside its step waits for that rank in a
  collective called by hand (:func:`_waits`), and is never named. The slow rank is compared with the
  typical rank (the lower median across ranks),
  and the gap is what every rank waits per step.
* job-wide bottlenecks (INPUT_BOUND, H2D_BOUND, RESIDUAL_HEAVY): the typical rank — the lower
  median across ranks, so one slow rank cannot make the job look bound — spends a large share
  of its step there; COMM_BOUND (:mod:`traceml.analysis.comm`, a candidate the caller passes
  in ``extra``): the collectives' transfer itself takes a large share of every step.

The candidate with the largest impact is the primary diagnosis; the others are findings. With
none, the run is COMPUTE_BOUND (``info``: nothing outside the model's compute holds it back).
Too few steps or unmeasured phases give INSUFFICIENT_DATA naming what is missing.

Each rule stands alone: the data rules are functions (:data:`INSUFFICIENT_RULES`), each
straggler part and each typical-share bottleneck one row of its table (:data:`STRAGGLER_PARTS`,
:data:`_BOUNDS`) that one function evaluates; COMM_BOUND comes in ``extra``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from traceml.analysis import thresholds as th
from traceml.analysis.document import Typical
from traceml.analysis.findings import EVENTS, MEDIAN, Finding, ranks_text
from traceml.analysis.phases import Clock, Profile, missing_phases
from traceml.analysis.stats import lower_median, median
from traceml.analysis.window import Window

INSUFFICIENT_DATA = "INSUFFICIENT_DATA"
COMPUTE_BOUND = "COMPUTE_BOUND"
NODE_STRAGGLER = "NODE_STRAGGLER"

#: How to add step data to a script (the action of a run without it).
HOW_TO_INSTRUMENT = (
    "Call traceml.init() once per rank after the process group is set up, and wrap each "
    "optimizer step in `with traceml.trace_step(model):` (see docs/quickstart.md)."
)


@dataclass(frozen=True)
class _Part:
    """A part of the step a straggler can be attributed to."""

    name: str  # evidence name
    label: str  # what is measured, for the summary sentence
    kind: str
    value: Callable[[Profile], float | None]  # ms per step
    action: str


STRAGGLER_PARTS = (
    _Part(
        "input_wait",
        "input wait",
        "INPUT_STRAGGLER",
        lambda p: p.median_ms["input_wait"],
        "Find why {who} loads data more slowly: its data shard or files (storage, "
        "decoding), its DataLoader workers (num_workers, CPU affinity), or a busy host; give "
        "it more loader workers or rebalance the data.",
    ),
    _Part(
        "h2d",
        "host-to-device copy time",
        "H2D_STRAGGLER",
        lambda p: p.median_ms["h2d"],
        "Check {who}'s host-to-device path: pinned memory (pin_memory=True), non_blocking "
        "copies, and the PCIe/NUMA placement of its GPU.",
    ),
    _Part(
        "forward_optimizer",
        "forward + optimizer time",
        "COMPUTE_STRAGGLER",
        lambda p: p.own_compute_ms,
        "Check {who}'s device (clocks, thermal throttling, a shared or slower GPU), uneven "
        "batches (sequence lengths, padding), and rank-specific code in forward or the "
        "optimizer.",
    ),
    _Part(
        "residual",
        "time outside the measured phases",
        "STRAGGLER",
        lambda p: p.median_ms["residual"],
        "{who} does extra work inside the step outside forward, backward and optimizer "
        "(logging, metrics, checkpointing, .item() syncs): move it out of the step or off "
        "the critical path; time it with traceml.phase() to see it.",
    ),
)
STEP_PART = _Part(
    "step",
    "step time",
    "STRAGGLER",
    lambda p: p.step_ms["median"] if p.step_ms else None,
    "{who}'s steps are slower but no measured phase explains it: look for work the phases "
    "do not cover, or a slower device.",
)


@dataclass(frozen=True)
class _Bound:
    """A job-wide bottleneck: a part whose typical share of the step passes a threshold."""

    part: str
    kind: str
    threshold_name: str
    words: str
    action: str


_BOUNDS = (
    _Bound(
        "input_wait",
        "INPUT_BOUND",
        "INPUT_BOUND_PCT",
        "waiting for input",
        "Speed up data loading: more DataLoader workers (num_workers), pin_memory=True and "
        "persistent_workers=True, prefetching, lighter decoding/augmentation (or on the GPU), "
        "faster storage or a preprocessed, cached dataset.",
    ),
    _Bound(
        "h2d",
        "H2D_BOUND",
        "H2D_BOUND_PCT",
        "copying data to the device",
        "Use pin_memory=True and .to(device, non_blocking=True), send smaller tensors (e.g. "
        "uint8, converted on the GPU), and overlap the copy with compute (prefetch on a "
        "separate CUDA stream).",
    ),
    _Bound(
        "residual",
        "RESIDUAL_HEAVY",
        "RESIDUAL_HEAVY_PCT",
        "outside every measured phase (not input, forward, backward or optimizer)",
        "Find the host work inside the step: loss or metrics computed outside the model, "
        "logging, .item()/.cpu() calls that synchronize, checkpointing. Time suspects with "
        "traceml.phase() or a profiler, then move them out of the step or do them less often.",
    ),
)


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def typical(profiles: dict[int, Profile]) -> Typical:
    """The typical rank's figures: per part, the lower median across ranks (ms, and % of the
    step); each figure is taken on its own, so the parts need not add up to the step."""
    parts = next(iter(profiles.values())).median_ms.keys() if profiles else ()
    return Typical(
        step_time_ms=_round(
            lower_median(p.step_ms["median"] if p.step_ms else None for p in profiles.values())
        ),
        phase_median_ms={
            k: _round(lower_median(p.median_ms[k] for p in profiles.values())) for k in parts
        },
        phase_share_pct={
            k: _round(lower_median(p.share_pct[k] for p in profiles.values()), 1)
            for k in parts
            if k != "dataloader_next"
        },
    )


def severity(impact_ms: float, step_ms: float) -> str:
    """``critical`` when ``impact_ms`` is at least CRITICAL_PCT of the step ``step_ms``, else
    ``warning``."""
    return "critical" if impact_ms >= step_ms * th.CRITICAL_PCT / 100.0 else "warning"


def no_step_data(window: Window, clock: Clock) -> Finding | None:
    """INSUFFICIENT_DATA: no rank reported a training step."""
    if window.steps:
        return None
    return Finding(
        INSUFFICIENT_DATA,
        "warning",
        "No step data: no rank reported a training step, so TraceML cannot say where "
        "step time goes (system and process figures are still reported).",
        HOW_TO_INSTRUMENT,
        evidence={
            "statistic": EVENTS,
            "missing": ["steps"],
            "ranks_without_steps": window.ranks_without_steps,
        },
        ranks=window.ranks_without_steps,
    )


def too_few_steps(window: Window, clock: Clock) -> Finding | None:
    """INSUFFICIENT_DATA: fewer than MIN_WINDOW_STEPS steps common to every rank."""
    if len(window.indices) >= th.MIN_WINDOW_STEPS:
        return None
    return Finding(
        INSUFFICIENT_DATA,
        "warning",
        f"Only {len(window.indices)} steps are common to every rank that reported steps; "
        f"the diagnosis needs at least {th.MIN_WINDOW_STEPS} (MIN_WINDOW_STEPS).",
        f"Run at least {th.MIN_WINDOW_STEPS + th.WARMUP_STEPS} steps so that warm-up can "
        "be left out; if a rank stopped early, see the health findings.",
        evidence={
            "statistic": EVENTS,
            "missing": ["steps"],
            "window_steps": len(window.indices),
            "min_window_steps": th.MIN_WINDOW_STEPS,
        },
        ranks=window.ranks,
    )


def phases_never_measured(window: Window, clock: Clock) -> Finding | None:
    """INSUFFICIENT_DATA: a required phase (forward, backward, optimizer) was never measured
    on some rank, so the residual would absorb it."""
    lacking = missing_phases(clock)
    if not lacking:
        return None
    what = "; ".join(f"{name} on {ranks_text(r)}" for name, r in lacking.items())
    return Finding(
        INSUFFICIENT_DATA,
        "warning",
        f"Phases never measured ({what}): without them the step cannot be broken down.",
        "Pass the model to traceml.trace_step(model) so forward is timed, call "
        "loss.backward() and optimizer.step() inside the traced step, or time custom code "
        'with traceml.phase("forward"|"backward"|"optimizer").',
        evidence={"statistic": EVENTS, "missing": sorted(lacking), "ranks_lacking": lacking},
        ranks=sorted({r for ranks in lacking.values() for r in ranks}),
    )


#: The data rules, checked in order before any diagnosis: the first that applies is the
#: primary diagnosis (INSUFFICIENT_DATA), and nothing else is diagnosed.
INSUFFICIENT_RULES = (no_step_data, too_few_steps, phases_never_measured)


def straggler_floor(step_ms: float) -> float:
    """The smallest gap over the typical rank that makes a straggler (ms per step):
    STRAGGLER_GAP_PCT of the typical step ``step_ms``, at least STRAGGLER_MIN_GAP_MS."""
    return max(th.STRAGGLER_MIN_GAP_MS, step_ms * th.STRAGGLER_GAP_PCT / 100.0)


def _stragglers(
    profiles: dict[int, Profile],
    node_of: dict[int, int | None],
    step_ms: float,
    synchronized: bool,
) -> list[Finding]:
    if len(profiles) < 2:
        return []
    floor_ms = straggler_floor(step_ms)
    findings: list[Finding] = []
    named: set[int] = set()
    # Under DDP/FSDP every step ends with a collective, so step times differ only by when
    # each rank leaves it: noise, never a straggler. Only the ranks' own phases can tell.
    parts = STRAGGLER_PARTS if synchronized else STRAGGLER_PARTS + (STEP_PART,)
    for part in parts:
        values = {r: v for r, p in profiles.items() if (v := part.value(p)) is not None}
        if len(values) < 2:
            continue
        typical_ms = statistics.median_low(values.values())
        slow = {r: v - typical_ms for r, v in values.items() if v - typical_ms >= floor_ms}
        if synchronized and part.name == "residual":
            slow = {r: g for r, g in slow.items() if not _waits(r, g, profiles)}
        if part is STEP_PART:
            slow = {r: g for r, g in slow.items() if r not in named}
        if not slow:
            continue
        named |= set(slow)
        typical_rank = min(r for r, v in values.items() if v == typical_ms and r not in slow)
        findings.append(
            _straggler_finding(part, values, slow, typical_rank, node_of, profiles, step_ms)
        )
    return findings


def _own_ms(p: Profile) -> float:
    """A rank's own time per step, that no collective holds (ms): the medians of its input
    wait, H2D, forward and optimizer, and of its time outside the steps."""
    parts = [p.median_ms.get(k) for k in ("input_wait", "h2d", "forward", "optimizer")]
    outside = median(p.parts.get("outside", ())) if p.parts else None
    return sum(v or 0.0 for v in parts) + (outside or 0.0) / 1000.0


def _waits(rank: int, gap_ms: float, profiles: dict[int, Profile]) -> bool:
    """Whether ``rank``'s time outside the measured phases, ``gap_ms`` over the typical rank,
    is its wait for another rank in a collective of the step (an all-reduce called by hand):
    another rank's own time (:func:`_own_ms`) exceeds ``rank``'s by at least half that gap.
    A rank that waits for others is never the straggler; the one it waits for spent the
    time in its own work or outside its step."""
    own = _own_ms(profiles[rank])
    return any(_own_ms(p) - own >= gap_ms / 2 for r, p in profiles.items() if r != rank)


def _straggler_finding(
    part: _Part,
    values: dict[int, float],
    slow: dict[int, float],
    typical_rank: int,
    node_of: dict[int, int | None],
    profiles: dict[int, Profile],
    step_ms: float,
) -> Finding:
    """The finding for ``slow`` (rank -> gap over the typical rank, ms) in ``part``: a
    NODE_STRAGGLER when they are exactly the ranks of whole nodes, else the part's kind."""
    worst = max(slow, key=lambda r: slow[r])
    gap = round(slow[worst], 3)  # as the evidence carries it, so that the text says the same
    evidence = {
        "statistic": MEDIAN,
        "part": part.name,
        "slow_rank": worst,
        "slow_ms": _round(values[worst]),
        "typical_rank": typical_rank,
        "typical_ms": _round(values[typical_rank]),
        "gap_ms": _round(gap),
        "gap_pct_of_step": _round(100.0 * gap / step_ms, 1),
        "step_time_ms": _round(step_ms),
        "slow_ranks": [
            {"rank": r, "ms": _round(values[r]), "gap_ms": _round(g)}
            for r, g in sorted(slow.items(), key=lambda kv: -kv[1])
        ],
    }
    slow_nodes = _whole_nodes(set(slow), set(profiles), node_of)
    worst_ms = (
        f"{values[worst]:.1f} ms"
        if len(slow) == 1
        else f"up to {values[worst]:.1f} ms (rank {worst})"
    )
    typical_where = f"rank {typical_rank}"
    if slow_nodes:
        kind = NODE_STRAGGLER
        who = "node " + ", ".join(str(n) for n in slow_nodes)
        evidence["slow_nodes"] = slow_nodes
        evidence["typical_node"] = node_of.get(typical_rank)
        subject = f"{who.capitalize()} (all its ranks)"
        typical_where += f" on node {node_of.get(typical_rank)}"
        action = part.action.format(who=who) + (
            " Look at what the node's ranks share: storage and network, CPU load, GPU model "
            "and temperature."
        )
    else:
        kind = part.kind
        who = ranks_text(list(slow))
        subject = who.capitalize()
        action = part.action.format(who=who)
        action = action[0].upper() + action[1:]
    summary = (
        f"{subject} {part.label}: {worst_ms} per step (typical {typical_where}: "
        f"{values[typical_rank]:.1f} ms); every step waits about {gap:.1f} ms for it "
        f"({100.0 * gap / step_ms:.0f}% of the {step_ms:.1f} ms step; medians per step)."
    )
    return Finding(
        kind,
        severity(gap, step_ms),
        summary,
        action,
        evidence=evidence,
        ranks=list(slow),
        nodes=slow_nodes or sorted({n for r in slow if (n := node_of.get(r)) is not None}),
        impact_ms=gap,
    )


def _whole_nodes(slow: set[int], ranks: set[int], node_of: dict[int, int | None]) -> list[int]:
    """Nodes all of whose (2 or more) window ranks are slow, when that is exactly the slow set
    and not every node; else []."""
    by_node: dict[int, set[int]] = {}
    for r in ranks:
        node = node_of.get(r)
        if node is None:
            return []
        by_node.setdefault(node, set()).add(r)
    if len(by_node) < 2:
        return []
    nodes = sorted(n for n, members in by_node.items() if members <= slow)
    covered = set().union(*(by_node[n] for n in nodes)) if nodes else set()
    if (
        nodes
        and covered == slow
        and len(nodes) < len(by_node)
        and all(len(by_node[n]) >= 2 for n in nodes)
    ):
        return nodes
    return []


def _bounds(profiles: dict[int, Profile], typ: Typical, step_ms: float) -> list[Finding]:
    findings = []
    limits = th.as_dict()
    for bound in _BOUNDS:
        ms = typ.phase_median_ms.get(bound.part)
        if ms is None or not step_ms:
            continue
        # One statistic for the whole claim: the typical median per step, as a share of the
        # typical median step (a few long steps move neither; they are spikes).
        share = round(100.0 * ms / step_ms, 1)
        limit = limits[bound.threshold_name]
        if share < limit:
            continue
        evidence = {
            "statistic": MEDIAN,
            "part": bound.part,
            "typical_ms": ms,
            "typical_share_pct": share,
            "threshold_pct": limit,
            "step_time_ms": _round(step_ms),
            "per_rank_ms": {str(r): _round(p.median_ms[bound.part]) for r, p in profiles.items()},
        }
        if bound.part == "input_wait":
            evidence["dataloader_next_ms"] = typ.phase_median_ms.get("dataloader_next")
        findings.append(
            Finding(
                bound.kind,
                severity(ms, step_ms),
                f"The typical rank spends {ms:.1f} ms per step ({share:.0f}% of its "
                f"{step_ms:.1f} ms step; medians per step) {bound.words}; "
                f"{'every rank' if len(profiles) > 1 else 'the rank'} is affected "
                f"(threshold {bound.threshold_name} = {limit:g}%).",
                bound.action,
                evidence=evidence,
                ranks=sorted(profiles),
                impact_ms=ms,
            )
        )
    return findings


def _compute_bound(profiles: dict[int, Profile], typ: Typical, step_ms: float) -> Finding:
    medians = typ.phase_median_ms
    compute_ms = sum(medians.get(k) or 0.0 for k in ("forward", "backward", "optimizer"))
    compute = 100.0 * compute_ms / step_ms if step_ms else 0.0
    return Finding(
        COMPUTE_BOUND,
        "info",
        f"Compute dominates: forward, backward and optimizer take {compute_ms:.1f} ms per "
        f"step ({compute:.0f}% of the typical {step_ms:.1f} ms step; medians per step); no "
        "input, transfer, residual or straggler bottleneck passed its threshold.",
        "To go faster, make the compute faster: mixed precision (bf16 autocast), "
        "torch.compile, fused optimizers, a larger batch per device if memory allows; on "
        "GPUs check the utilization figures.",
        evidence={
            "statistic": MEDIAN,
            "compute_ms": _round(compute_ms),
            "compute_share_pct": round(compute, 1),
            "step_time_ms": _round(step_ms),
        },
        ranks=sorted(profiles),
    )


def diagnose(
    window: Window,
    clock: Clock,
    profiles: dict[int, Profile],
    node_of: dict[int, int | None],
    *,
    synchronized: bool = False,
    extra: Sequence[Finding] = (),
) -> tuple[Finding, list[Finding]]:
    """The primary diagnosis and the other step-time findings (largest impact first).

    Args:
        window: the aligned steps.
        clock: the analysis clock.
        profiles: each window rank's profile over the window.
        node_of: node rank of each rank (None when unknown).
        synchronized: the ranks meet in a collective every step (DDP, FSDP), so a
            difference in step time alone names no straggler.
        extra: further candidates with their ``impact_ms`` (outside-step time, spikes, ...).
    """
    for rule in INSUFFICIENT_RULES:
        missing = rule(window, clock)
        if missing is not None:
            return missing, []
    typ = typical(profiles)
    step_ms = typ.step_time_ms
    assert step_ms is not None, "the rules above leave steps on every window rank"
    candidates = (
        _stragglers(profiles, node_of, step_ms, synchronized)
        + _bounds(profiles, typ, step_ms)
        + list(extra)
    )
    if not candidates:
        return _compute_bound(profiles, typ, step_ms), []
    candidates.sort(key=lambda f: -(f.impact_ms or 0.0))  # every candidate has its impact
    return candidates[0], candidates[1:]
