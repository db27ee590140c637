"""The typed summary: step columns, the generated JSON Schema, one finding rule at a time."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import jsonschema
import pytest
from rundata_factory import gpu_sample, rank, rich_run, run_of, step, steps, system_sample

from traceml.analysis import health, memory, step_time, system
from traceml.analysis.document import RankMemory, Summary, Trend, summary_schema
from traceml.analysis.rundata import StepTable
from traceml.analysis.schema import Keys, Refine, Schema, json_schema, plain
from traceml.analysis.summary import build, build_summary
from traceml.core.phases import STEP_FIELDS

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = ROOT / "docs" / "final_summary.schema.json"


# --- step columns ----------------------------------------------------------------------------
def test_step_columns_from_dicts_take_and_where():
    cols = StepTable.from_dicts(step(i, forward=1000 * i) for i in range(5))
    assert len(cols) == 5 and set(cols.columns) == set(STEP_FIELDS)
    assert cols["step"] == (0, 1, 2, 3, 4)
    assert cols["forward_us"] == (0, 1000, 2000, 3000, 4000)
    assert cols["gpu_step_us"] == (None,) * 5
    assert cols.where("step", {1, 2, 3})["forward_us"] == (1000, 2000, 3000)  # contiguous
    assert cols.where("step", {0, 4})["forward_us"] == (0, 4000)  # scattered
    assert cols.where("step", {9})["step"] == () and not cols.where("step", set())
    assert cols.take(range(5)) is cols


def test_step_columns_refuse_unknown_fields_and_uneven_lengths():
    good = dict(StepTable.from_dicts([step(0)]).columns)
    with pytest.raises(ValueError, match="not the step fields"):
        StepTable({**good, "loss_us": (1,)})
    with pytest.raises(ValueError, match="different lengths"):
        StepTable({**good, "step": (0, 1)})


# --- the typed document and its schema -------------------------------------------------------
def test_committed_schema_is_the_generated_one():
    generated = json.dumps(summary_schema(), indent=2, ensure_ascii=False) + "\n"
    assert SCHEMA_PATH.read_text(encoding="utf-8") == generated, (
        "docs/final_summary.schema.json is stale: run "
        "`python -m traceml.analysis.document docs/final_summary.schema.json`"
    )


def test_build_is_typed_and_build_summary_is_its_json():
    run = rich_run(60)
    typed = build(run)
    assert isinstance(typed, Summary)
    assert isinstance(typed.ranks[5].memory, RankMemory)
    assert isinstance(typed.ranks[5].memory.trend, Trend)
    doc = build_summary(run)
    assert plain(typed) == dict(doc, generated_unix_s=typed.generated_unix_s)
    jsonschema.Draft202012Validator(summary_schema()).validate(doc)


@dataclass
class _Inner:
    n: Annotated[int, Schema(minimum=0)]


@dataclass
class _Point:
    x: float


@dataclass
class _Outer:
    name: Annotated[str, Schema(enum=["a", "b"])]
    maybe: float | None
    inline: _Point | None
    items: list[_Inner]
    parts: Annotated[dict[str, int], Keys(("x", "y"), "the {}")]
    free: dict
    counts: dict[str, bool]
    narrowed: Annotated[_Inner, Refine({"properties": {"n": {"const": 1}}})]


@dataclass
class _NullableRef:
    ref: _Inner | None


def test_the_generator_maps_each_annotation():
    inner = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0}},
        "required": ["n"],
        "additionalProperties": False,
    }
    schema = json_schema(_Outer, defs={"inner": _Inner}, title="t", description="d")
    assert schema["$defs"] == {"inner": inner}
    assert schema["required"] == [
        "name",
        "maybe",
        "inline",
        "items",
        "parts",
        "free",
        "counts",
        "narrowed",
    ]
    props = schema["properties"]
    assert props["name"] == {"enum": ["a", "b"]}
    assert props["maybe"] == {"type": ["number", "null"]}
    assert props["inline"] == {
        "type": ["object", "null"],
        "properties": {"x": {"type": "number"}},
        "required": ["x"],
        "additionalProperties": False,
    }
    assert props["items"] == {"type": "array", "items": {"$ref": "#/$defs/inner"}}
    assert props["parts"] == {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "description": "the x"},
            "y": {"type": "integer", "description": "the y"},
        },
        "required": ["x", "y"],
        "additionalProperties": False,
    }
    assert props["free"] == {"type": "object"}
    assert props["counts"] == {"type": "object", "additionalProperties": {"type": "boolean"}}
    assert props["narrowed"] == {
        "allOf": [{"$ref": "#/$defs/inner"}, {"properties": {"n": {"const": 1}}}]
    }
    # A nullable $ref has no "type" to add null to: the generator refuses it.
    with pytest.raises(TypeError, match="cannot make"):
        json_schema(_NullableRef, defs={"inner": _Inner}, title="t", description="d")


# --- one rule at a time ------------------------------------------------------------------------
def test_a_health_rule_alone():
    r1 = rank(1, steps(), finish=False)
    r1.end = None
    run = run_of([rank(0, steps()), r1], missing=[1])
    ranks = build(run).ranks
    found = health.rank_missing(health.Facts(run, ranks, live=False, now_unix_s=2e9))
    assert (found.kind, found.ranks) == ("RANK_MISSING", [1])
    assert found.evidence == {"missing_ranks": [1]}
    assert health.rank_missing(health.Facts(run, ranks, live=True, now_unix_s=2e9)) is None
    assert health.rank_crashed(health.Facts(run, ranks, live=False, now_unix_s=2e9)) is None


def test_a_system_rule_alone():
    system_samples = {0: [system_sample(t, cpu=97.0) for t in range(0, 3_000_000, 1_000_000)]}
    gpus = {0: [gpu_sample(t, 0, 20.0) for t in range(0, 3_000_000, 1_000_000)]}
    run = run_of([rank(0, steps(), uuid="GPU-0-0")], system=system_samples, gpus=gpus)
    nodes = build(run).nodes
    facts = system.Facts(nodes, {"GPU-0-0": [0]})
    assert system.high_cpu(facts).evidence["per_node_cpu_percent_median"] == {"0": 97.0}
    low = system.low_gpu_utilization(facts)
    assert (low.kind, low.ranks, low.evidence["gpus"][0]["util_percent_median"]) == (
        "LOW_GPU_UTILIZATION",
        [0],
        20.0,
    )
    assert system.moderate_gpu_utilization(facts) is None
    assert system.high_ram(facts) is None and system.high_gpu_temperature(facts) is None


def test_a_memory_rule_alone():
    m = RankMemory(80 * 2**30, 79 * 2**30, 80 * 2**30, 98.8, None, None, None)
    assert memory.RULES == (memory._pressure, memory._imbalance, memory._creep)
    assert memory._pressure({0: m}).evidence["per_rank_pressure_pct"] == {"0": 98.8}
    assert memory._imbalance({0: m}) is None  # one rank has no spread


def test_a_step_time_data_rule_alone():
    run = run_of([rank(0, steps(8)), rank(1, steps(8))])
    typed = build(run)
    assert typed.primary_diagnosis.evidence["window_steps"] == 8
    assert [rule.__name__ for rule in step_time.INSUFFICIENT_RULES] == [
        "no_step_data",
        "too_few_steps",
        "phases_never_measured",
    ]
