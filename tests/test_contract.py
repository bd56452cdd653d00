"""The OpenAPI document is the contract: schemathesis `run --checks all` (coverage, fuzzing and stateful phases)
against a served process finds no failure. A short pass; the long one: docs/design/verification.md."""

from __future__ import annotations

import json

from loadtests import contract


def test_schemathesis_finds_no_failure_with_every_check(tmp_path):
    assert contract.main(["--max-examples", "5", "--out", str(tmp_path)]) == 0, \
        (tmp_path / "schemathesis.txt").read_text()[-6000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["generated"] > 1000 and summary["unique_failures"] == 0 and summary["errors"] == 0
    # examples are skipped: the schema gives none
    assert summary["phases"] == {"examples": "skip", "coverage": "success", "fuzzing": "success", "stateful": "success"}
