"""final_summary.json against its JSON Schema (docs/final_summary.schema.json): real outputs of
every planted run, and constructed GPU, live and zero-code summaries."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from rundata_factory import rank, rich_run, run_of, steps

from traceml.analysis import thresholds
from traceml.analysis.findings import KINDS, PRIMARY_KINDS
from traceml.analysis.summary import SCHEMA_VERSION, build_summary

SCHEMA = json.loads(
    (Path(__file__).resolve().parents[1] / "docs" / "final_summary.schema.json").read_text()
)
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def test_schema_is_valid_and_matches_the_code():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    props = SCHEMA["properties"]
    assert props["schema_version"]["const"] == SCHEMA_VERSION
    assert props["primary_diagnosis"]["allOf"][1]["properties"]["kind"]["enum"] == list(
        PRIMARY_KINDS
    )
    for section, kinds in KINDS.items():
        item = props["findings"]["properties"][section]["items"]
        assert item["allOf"][1]["properties"]["kind"]["enum"] == list(kinds)
    assert set(props["analysis"]["properties"]["thresholds"]["required"]) == set(
        thresholds.as_dict()
    )


@pytest.mark.slow
@pytest.mark.torchrun
@pytest.mark.parametrize(
    "scenario", ["balanced", "input", "input_straggler", "compute_straggler", "residual"]
)
def test_real_outputs_validate(scenario, planted):
    summary = planted(scenario).summary
    VALIDATOR.validate(summary)
    p = summary["primary_diagnosis"]
    assert p["summary"] and p["action"] and p["severity"] in ("info", "warning", "critical")


@pytest.mark.parametrize(
    "summary",
    [
        build_summary(rich_run()),
        build_summary(run_of([rank(0, steps()), rank(1, steps(), finish=False)]), live=True),
        build_summary(run_of([rank(0, [], finish=False)])),
    ],
    ids=["gpu-multi-node", "live", "zero-code"],
)
def test_constructed_summaries_validate(summary):
    VALIDATOR.validate(summary)


def test_a_fake_zero_is_rejected():
    """The schema is strict enough to catch a renamed key or a wrong type."""
    summary = build_summary(rich_run())
    summary["ranks"][0]["phase_median_ms"]["forward"] = "10"
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(summary)
    summary = build_summary(rich_run())
    summary["primary_diagnosis"]["kind"] = "SLOW"
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(summary)
