"""The crash test (loadtests/crashtest.py), short: SIGKILL the whole service mid-write a few times, restart it,
and check PostgreSQL, the resident index, jobs and SSB data. The full run (50 kills): docs/design/verification.md."""

from __future__ import annotations

import json

from loadtests import crashtest


def test_a_write_in_doubt_may_hold_either_state_and_an_answer_settles_it():
    ledger = crashtest.Ledger()
    assert ledger.possible(7) == [None]
    new = ledger.begin([7], lambda i: 1)
    assert ledger.possible(7) == [None, 1]           # sent, no answer yet: either
    ledger.acknowledged([7], new)
    assert ledger.possible(7) == [1]
    gone = ledger.begin([7], lambda i: None)
    ledger.refused([7], gone)                        # a 4xx: certainly not applied
    assert ledger.possible(7) == [1]


def test_killed_mid_write_the_service_loses_nothing_acknowledged(tmp_path):
    assert crashtest.main(["--kills", "3", "--ssb-every", "2", "--min-s", "0.5", "--max-s", "1.5",
                           "--out", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("crash-*.json")).read_text())
    assert report["kills"] == 3 and report["failed_rounds"] == 0
    assert report["acked_writes"] > 50  # it really wrote between kills
    assert all(r["present_checked"] > 0 and r["loaded_from"] for r in report["rounds"])
