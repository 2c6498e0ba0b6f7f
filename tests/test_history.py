"""History-checked failovers (tests/support/history.py) on a Sentinel topology: a primary, two
replicas and three sentinels; a stream of 2 shards with replication 3 under ``leader``
or ``quorum`` consistency; four client threads that publish, poll, ack, nack and drop
while the primary is SIGKILLed (not restarted) or SIGSTOPped until the sentinels fail
over and then SIGCONTed (it comes back as a replica).

Asserted in every trial: the invariants (b)-(e) of tests/support/history.py hold (anomalies a
leader rollback explains are counted, not failed), every client recovered on its own
client object, nothing hung, no bare exception leaked. Under ``quorum``: no
acknowledged publish lost or missing from the log, and nothing the isolated old
primary took counts as acknowledged. Under ``leader`` the losses are recorded (run
with ``-s`` to see them, or ``--junitxml`` for the properties), never failed on.

One trial per (consistency, fault) runs by default (15-30 s each); ``-m slow`` runs
four more seeds of each.
"""

from __future__ import annotations

from typing import Any

import pytest

from felix_redis.testing.server import redis_server_binary
from tests.support.history import TrialResult, run_trial

pytestmark = pytest.mark.skipif(
    redis_server_binary() is None, reason="redis-server is not installed (apt install redis-server)"
)

CASES = [(c, f) for c in ("leader", "quorum") for f in ("kill", "pause")]


def _check(result: TrialResult, record_property: Any) -> None:
    report = result.report
    print("\n" + result.line())
    for line in result.timeline():
        print("   ", line)
    record_property("summary", result.line())
    record_property("lost", report.lost)
    record_property("missing", report.missing)
    record_property("acknowledged", report.acknowledged)
    record_property("isolated_acknowledged", len(result.isolated_acknowledged))
    assert not result.notes, result.notes
    assert not result.stuck, f"client threads hung: {result.stuck}"
    assert not result.leaked, f"exceptions that are no FelixError: {result.leaked[:5]}"
    not_recovered = [name for name, v in result.recovery.items() if v is None]
    assert not not_recovered, f"clients that never published and polled again after the fault: {not_recovered}"
    violations = report.violations()
    assert not violations, "violations:\n  " + "\n  ".join(map(str, violations[:20]))
    if result.consistency == "quorum":
        # with no rollback window, a lost or missing acknowledged publish is a violation
        assert report.lost == 0 and report.missing == 0 and report.explained() == []
        assert not result.isolated_acknowledged, (
            f"the isolated old primary acknowledged {len(result.isolated_acknowledged)} publishes: "
            f"{result.isolated_acknowledged[:5]}")
    assert report.acknowledged >= 500


@pytest.mark.parametrize(("consistency", "fault"), CASES)
def test_failover_history(consistency: str, fault: str, record_property: Any) -> None:
    _check(run_trial(consistency, fault, seed=0), record_property)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize(("consistency", "fault"), CASES)
def test_failover_history_more_trials(consistency: str, fault: str, seed: int, record_property: Any) -> None:
    _check(run_trial(consistency, fault, seed=seed), record_property)
