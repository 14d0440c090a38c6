"""Horovod's stall warning under hvdp's engine, without hvdp (issue 52 item 3). Under hvdp.init() the
watchdog ends such a job within its short limit instead: tests/faults/test_hangs.py."""

import pytest

from tests.faults.test_hangs import run_side_by_side
from tests.launch import ROOT

WORKER = ROOT / "tests" / "faults" / "stall_raw_worker.py"


def test_raw_horovods_stall_warning_names_the_missing_rank_and_ends_the_job():
    results = run_side_by_side(WORKER, [], {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2",
                                            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "8"}, limit=110)
    for launcher, (code, out, seconds) in results.items():
        assert "still running" not in out and code not in (0, None), (launcher, out[-3000:])
        warning = out[out.find("One or more tensors were submitted"):]
        assert "only.rank0" in warning and "missing ranks" in warning.lower(), (launcher, out[-3000:])
        assert "finished without noticing" not in out, (launcher, out[-3000:])
        assert seconds < 100, (launcher, seconds)  # ended by the stall shutdown, not by rank 1 waking at 120 s
