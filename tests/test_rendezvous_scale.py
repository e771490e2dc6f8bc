"""The rendezvous-scale benchmark at a tiny size, so that it cannot rot: real stand-in agents
(one process, threads) against the session's etcd, three events, counted etcd operations."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import rendezvous_scale as bench  # noqa: E402

from rendezvous.planner import PLANNERS  # noqa: E402


def test_standins_form_and_replace(etcd_endpoint, tmp_path):
    n = 8
    opts = {"lease_ttl": 600.0, "monitor_interval": 60.0, "log": str(tmp_path / "children.log")}
    result = bench.run_tm(etcd_endpoint, n, procs=1, spares=2, opts=opts, timeout=60)
    events = result["events"]
    assert [e["generation"] for e in events] == [0, 1, 2]
    assert result["history_generations"] == [0, 1, 2]  # one plan per generation, none skipped
    for e in events:
        assert 0 < e["publish_s"] <= e["all_seen_s"]
        assert e["ops"] > 0 and e["by_op"]["get_prefix"] >= n - 1  # every live stand-in read the new plan
    for e in events[1:]:
        # Only the designated planners try the CAS: not one per node.
        assert 1 <= e["by_op"]["replace"] <= PLANNERS
    assert "\n| 8 | tm-launch | loss of first active node |" in bench.table([result])
