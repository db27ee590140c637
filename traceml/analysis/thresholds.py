"""Named thresholds of the diagnoses: one constant each, with its meaning and unit.

Every constant is explained for users in ``docs/reading-output.md`` (a test keeps the two in
step) and copied into ``final_summary.json`` under ``analysis.thresholds``, so a report always
says which limits produced it. Percentages are 0-100.
"""

from __future__ import annotations

# --- the analysis window ------------------------------------------------------------------------
#: Steps at the start of the aligned window left out (process-group setup, first kernels,
#: allocator warm-up); skipped only while at least MIN_WINDOW_STEPS steps remain.
WARMUP_STEPS = 5
#: Fewest aligned steps (common to every rank that reported steps) the step-time diagnosis
#: needs; fewer gives INSUFFICIENT_DATA.
MIN_WINDOW_STEPS = 10

#: Fewest GPU-timed steps (common to every rank) in the window for the GPU clock; fewer gives
#: the CPU clock. The SDK times one step in TRACEML_GPU_TIMING_EVERY_N_STEPS on the GPU.
MIN_GPU_TIMED_STEPS = 3

# --- step time: job-wide ------------------------------------------------------------------------
#: INPUT_BOUND: the typical rank waits for its next batch at least this share of its step (%).
INPUT_BOUND_PCT = 15.0
#: H2D_BOUND: host-to-device copies take at least this share of the typical rank's step (%).
H2D_BOUND_PCT = 15.0
#: RESIDUAL_HEAVY: time inside the step outside every measured phase is at least this share
#: of the typical rank's step (%).
RESIDUAL_HEAVY_PCT = 25.0
#: COMM_BOUND: the collectives' transfer (per step, the least time any rank spent in them:
#: traceml/analysis/comm.py) is at least this share of the typical step.
COMM_BOUND_PCT = 25.0

# --- step time: stragglers ----------------------------------------------------------------------
#: A rank straggles when its own time in one part of the step (input wait, H2D, forward +
#: optimizer, residual) exceeds the typical rank's by at least this share of the typical step
#: time (%) ...
STRAGGLER_GAP_PCT = 10.0
#: ... and by at least this many milliseconds per step (sub-millisecond noise on tiny steps
#: is not a straggler).
STRAGGLER_MIN_GAP_MS = 1.0

#: LATE_ARRIVAL: a rank holds up at least this share of the collectives compared
#: (traceml/analysis/skew.py) (%): it arrives last, later than the others' median by the
#: straggler floor above (STRAGGLER_GAP_PCT of the typical step and STRAGGLER_MIN_GAP_MS) and
#: by at least twice the largest clock error bound of the nodes compared.
LATE_ARRIVAL_PCT = 50.0

# --- time outside the steps ---------------------------------------------------------------------
#: OUTSIDE_STEP_TIME: the ranks spend at least this share of their wall time between steps,
#: not waiting for the DataLoader (evaluation, checkpoints, logging between steps) (%).
OUTSIDE_STEP_PCT = 20.0
#: A gap between two steps counts as one outside-step pause when its outside-step time is at
#: least this share of the rank's median step time (%) (and at least 1 ms).
OUTSIDE_GAP_MIN_PCT = 50.0

# --- spikes, onsets, drift ---------------------------------------------------------------------
#: A step is a spike of a part when the part exceeds its own median by at least this share of
#: the rank's median step time (%) ...
SPIKE_MIN_PCT = 100.0
#: ... and the part spikes (STEP_SPIKES) when 2 or more spikes cost, summed, at least this
#: share of the summed wall time of the window steps (%).
SPIKE_SHARE_PCT = 10.0

#: Fewest steps on each side of a change point (onset of a straggler, SLOWDOWN).
ONSET_MIN_STEPS = 5
#: A straggler for a stretch of the run (a rank slower than the other ranks for part of the
#: window, :mod:`traceml.analysis.segments`): fewest steps the stretch lasts.
STRETCH_MIN_STEPS = 10
#: ... and by how much it is slower, at least: this share of the typical step time (%) (and
#: STRAGGLER_MIN_GAP_MS). Twice the whole-window gap: on a busy host a rank loses 10-15 % of
#: its step for ten steps now and then (seen on the shared 2-core test machine).
STRETCH_GAP_PCT = 20.0
#: SLOWDOWN is not a start-up transient: a rise of the job's step time that is mostly input
#: wait, from an input wait below the straggler floor, at or before this step of the run, is
#: the DataLoader's prefetched batches running out (num_workers x prefetch_factor batches are
#: ready before the first step; 64 = 32 workers x the default 2), the start of the steady state.
STARTUP_PREFETCH_STEPS = 64
#: SLOWDOWN: the job's median step after the change point exceeds the median before by at
#: least this share of it (%) (and 1 ms). High: a busy shared host swings the step time of a
#: whole job by 20 % for tens of steps.
SLOWDOWN_PCT = 40.0
#: STEP_TIME_DRIFT: a straight line fits the job's step time better than a change point and
#: rises by at least this share of its median over the window (%) (and 1 ms).
DRIFT_PCT = 40.0
#: ... over at least this many window steps: a slow leak shows over tens of steps; over a few,
#: a busy host's swings and the DataLoader's prefetched batches running out fit a rising line
#: (seen: a 15-step input-bound run on the loaded 2-core test machine called STEP_TIME_DRIFT).
DRIFT_MIN_STEPS = 50

#: A step-time finding whose recoverable time is at least this share of the typical step is
#: ``critical``; below it, ``warning``.
CRITICAL_PCT = 40.0

# --- memory -------------------------------------------------------------------------------------
#: MEMORY_PRESSURE: a rank's peak reserved CUDA memory is at least this share of its GPU's
#: total memory (%).
MEMORY_PRESSURE_PCT = 90.0
#: MEMORY_IMBALANCE: (highest - lowest) peak allocated memory across ranks is at least this
#: share of the highest (%).
MEMORY_IMBALANCE_PCT = 20.0
#: Share of a rank's memory readings at the start of the run treated as the caching
#: allocator's warm-up and left out of the creep test (fraction 0-1).
MEMORY_WARMUP_FRACTION = 0.25
#: MEMORY_CREEP: after warm-up, the median of the last third of peak-allocated readings
#: exceeds the median of the first third by at least this share of the latter (%) ...
MEMORY_CREEP_PCT = 5.0
#: ... and by at least this many bytes (64 MiB).
MEMORY_CREEP_MIN_BYTES = 64 * 1024 * 1024
#: Fewest memory readings of a rank for the creep test; fewer gives a ``null`` trend.
MEMORY_MIN_SAMPLES = 6
#: HOST_MEMORY_CREEP, NODE_RAM_GROWTH: the later half of the readings after warm-up rises
#: with at least this Mann-Kendall z (3: a flat series rises so by chance about once in a
#: thousand), and at its Theil-Sen rate the memory grows by MEMORY_CREEP_PCT and
#: MEMORY_CREEP_MIN_BYTES over the readings after warm-up.
MEMORY_GROWTH_Z = 3.0

# --- system and process -------------------------------------------------------------------------
#: LOW_GPU_UTILIZATION: a rank's GPU is busy less than this share of the time, median (%).
GPU_UTIL_LOW_PCT = 50.0
#: MODERATE_GPU_UTILIZATION: below this share, median, but not low (%).
GPU_UTIL_MODERATE_PCT = 80.0
#: HIGH_CPU: a node's CPUs (all cores) are busy at least this share, median (%).
CPU_HIGH_PCT = 90.0
#: HIGH_RAM: a node's used RAM reaches this share of its total, maximum (%).
RAM_HIGH_PCT = 90.0
#: NODE_RAM_GROWTH: a node's used RAM grows (the host-memory growth test) and its ranks' RSS
#: growth, summed, explains less than this share of the node's rate (%): the growth is
#: elsewhere (DataLoader workers, other processes, /dev/shm).
NODE_RAM_UNEXPLAINED_PCT = 50.0
#: HIGH_GPU_TEMPERATURE: a GPU reaches this temperature, maximum (°C).
GPU_TEMP_HIGH_C = 85.0


def as_dict() -> dict[str, float | int]:
    """Every threshold above by name (what ``analysis.thresholds`` in the summary holds)."""
    return {
        name: value
        for name, value in globals().items()
        if name.isupper() and isinstance(value, (int, float))
    }
