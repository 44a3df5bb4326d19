"""Smaller versions of the failure drills (bench/drills.py) against a real stack of their own:
2 decode workers, 1 prefill worker, a relay, a router and 2 chat instances, each a process.

Each asserts the outcome, never the time: every reply completes, a greedy reply's text is the
same as in an undisturbed run of the same prompts, the client saw contiguous event ids, and the
store holds every assistant turn as complete (nothing left `running`).

The workers run in bf16, the default: a row's bits do not depend on the rows batched with it nor
on how its prompt was chunked (tests/unit/models/test_batch_invariance.py,
tests/unit/kernels/test_paged_attention_torch.py), so a greedy answer is the same text in any
company, and a continuation's is the uninterrupted one's (tests/unit/engine/test_replay.py)."""

import json
import subprocess
import sys

import pytest
from helpers import REPO

from tandem.devstack.hosts import can_make_hosts

# Where hosts of their own can be made (root), every process runs on its own and the partition
# drills run too: a reply of a cut-off decode worker continues elsewhere, and one whose relay
# cannot reach Redis resumes once the partition heals.
HOSTS = can_make_hosts() == ""
PARTITIONS = ("partition_decode", "partition_relay_redis") if HOSTS else ()
DRILLS = ("kill_decode", "kill_relay", "resume", *PARTITIONS)


@pytest.fixture(scope="module")
def drill_reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("drills") / "drills.json"
    command = [
        sys.executable, str(REPO / "bench" / "drills.py"), "--drills", ",".join(DRILLS), "--streams", "4",
        "--max-tokens", "40", "--resume-streams", "6", "--resume-drops", "3", "--out", str(out),
        "--env", "TANDEM_KV_CACHE_MIB=128",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    reports = {report["name"]: report for report in json.loads(out.read_text())}
    assert set(reports) == set(DRILLS), result.stdout
    return reports, result.stdout


@pytest.mark.parametrize("name", DRILLS)
def test_every_reply_completes_with_the_undisturbed_text(drill_reports, name):
    reports, table = drill_reports
    report = reports[name]
    n = report["num_replies"]
    assert (report["completed"], report["errors"], report["hung"]) == (n, 0, 0), table
    assert report["texts_identical"] == n, table
    assert report["ids_contiguous"], table
    assert report["stored"] == {"complete": n}, table


def test_the_faults_happened(drill_reports):
    reports, _ = drill_reports
    assert reports["kill_decode"]["fault"].startswith("kill -9 decode-")
    assert reports["kill_relay"]["fault"].startswith("kill -9 relay ")
    assert reports["resume"]["fault"] == "none"
    for name in PARTITIONS:
        assert reports[name]["fault"].startswith("cut ") and reports[name]["healed_unix_s"] > reports[name]["fault_unix_s"]
        assert reports[name]["pause_after_heal_s"] is not None
