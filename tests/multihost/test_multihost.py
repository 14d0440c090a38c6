"""The main job and `hvdp verify` across two hosts, launched over ssh as on a cluster, and what a cut link does.

The hosts are network namespaces with their own sshd (see conftest.py). Every launch starts on hosta, as a
user logged into the first node would, and reaches hostb only over ssh and the private bridge.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.launch import HOROVODRUN, ROOT, env, result_line

pytestmark = pytest.mark.multihost

SCRIPT = ROOT / "examples" / "train_torch.py"
HOSTS = "hosta:1,hostb:1"
# Bounded failure when a host drops off the network (measured figures in test_cut_link's docstring).
GLOO_TIMEOUT = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "10"}      # every Gloo operation gives up after 10 s
MPI_KEEPALIVE = {"OMPI_MCA_oob_tcp_keepalive_time": "5",    # mpirun <-> orted: probe after 5 s idle,
                 "OMPI_MCA_oob_tcp_keepalive_intvl": "2",   # every 2 s, 3 misses = daemon lost
                 "OMPI_MCA_oob_tcp_keepalive_probes": "3"}


def horovodrun(cluster, controller: str) -> list[str]:
    return [HOROVODRUN, f"--{controller}", "-np", "2", "-H", HOSTS, "--network-interface", cluster.iface]


def mpirun(cluster) -> list[str]:
    return ["mpirun", "--allow-run-as-root", "-np", "2", "--hostfile", str(cluster.hostfile()),
            "-bind-to", "none", "-map-by", "slot",
            "-mca", "btl_tcp_if_include", cluster.iface, "-mca", "oob_tcp_if_include", cluster.iface,
            "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED"]


def launch(cluster, argv, timeout=240, **extra) -> subprocess.CompletedProcess:
    return cluster.on("hosta", argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env(**extra))


def _ok(proc) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-5000:]}"
    return out


@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_main_job_trains_across_hosts(cluster, controller):
    """horovodrun over ssh: one rank per host, accuracy as on one host, replicas bit-identical at the end
    (the example calls check_consistency, which fails the job otherwise)."""
    started = time.monotonic()
    out = _ok(launch(cluster, horovodrun(cluster, controller) + [sys.executable, str(SCRIPT)]))
    result = result_line(out)
    print(f"{controller}: {result} in {time.monotonic() - started:.1f}s")
    assert result["world_size"] == 2
    assert result["test_accuracy"] >= 0.97, result
    assert result["test_samples"] == 359


def test_mpirun_hostfile_runs_verify_across_hosts(cluster):
    """Plain mpirun with a hostfile: `hvdp verify`'s worker (2 ranks on 2 hosts vs 1 process, same steps)."""
    argv = mpirun(cluster) + [sys.executable, "-m", "hvdp.tools.cli", "verify", "--worker", "--framework", "torch"]
    out = _ok(launch(cluster, argv))
    verdict = result_line(out, "verify: ")
    assert verdict["size"] == 2 and verdict["ok"] and verdict["replicas_identical"], verdict


def test_doctor_names_launcher_on_every_host(cluster):
    """Under horovodrun's MPI mode each rank, on its own host, says horovodrun (mpi), not plain mpirun."""
    argv = horovodrun(cluster, "mpi") + [sys.executable, "-m", "hvdp.tools.cli", "doctor", "--no-build-check"]
    out = launch(cluster, argv).stdout
    for rank in (0, 1):
        assert f"Launcher: horovodrun (mpi); rank {rank} of 2" in out, out[-3000:]


def test_gloo_across_hosts_despite_a_loopback_hostname(cluster):
    """Stock Horovod 0.28.1's Gloo forgets --network-interface for the contexts its collectives use and
    hands the other host the address this machine's hostname resolves to (loopback or nothing), so the job
    cannot connect. Started with `ip netns exec` alone, hosta keeps the machine's hostname, which hosta's
    /etc/hosts does not know. hvdp's build (scripts/build_horovod.sh, fix 3) keeps the interface: the job
    trains, and doctor explains the trap as a note instead of a problem."""
    prefix = ["ip", "netns", "exec", cluster.host("hosta").netns] + horovodrun(cluster, "gloo")
    proc = subprocess.run(prefix + [sys.executable, "-m", "hvdp.tools.cli", "doctor", "--no-build-check"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env())
    out = proc.stdout + proc.stderr
    note = [line for line in out.splitlines() if line.startswith("[0]<stdout>:  note: this host's name")]
    assert note and "does not resolve" in note[0] and "fix 3" in note[0], out[-3000:]
    assert "[1]<stdout>:  note: this host's name" not in out, out[-3000:]  # hostb's name resolves
    proc = subprocess.run(prefix + [sys.executable, str(SCRIPT), "--epochs", "2"], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env=env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert result_line(out)["world_size"] == 2


def _run_and_cut(cluster, argv, extra: dict, budget: float):
    """Start the job on hosta, cut hostb's link once training runs; return (exit code, seconds, output)."""
    job = subprocess.Popen(cluster.host("hosta").prefix() + argv, cwd=ROOT, env=env(**extra), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not any("epoch 0:" in line for line in lines) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.poll() is None, "the job ended before training started:\n" + "".join(lines)[-4000:]
    assert any("epoch 0:" in line for line in lines), "training never started:\n" + "".join(lines)[-4000:]
    cluster.cut_link("hostb")
    cut = time.monotonic()
    try:
        code = job.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        code = None
    seconds = time.monotonic() - cut
    reader.join(10)
    return code, seconds, "".join(lines)


@pytest.mark.parametrize("controller,settings,message,budget", [
    # Gloo's timeout, in either of its words: the recv that gives up ("Timed out waiting 10000ms for recv"), or
    # the pair its timeout closed under another operation ("Application timeout caused pair closure")
    ("gloo", GLOO_TIMEOUT, "Timed out waiting|timeout caused pair closure", 40),
    ("mpi", MPI_KEEPALIVE, "ORTE has lost communication with a remote daemon", 40),
])
def test_cut_link_fails_the_job_in_bounded_time(cluster, controller, settings, message, budget):
    """hostb's link goes down mid-training (no FIN, no RST: its packets just vanish). The job must end
    non-zero, saying why, within `budget` seconds instead of hanging.

    Measured here: Gloo with HOROVOD_GLOO_TIMEOUT_SECONDS=10 ends 14 s after the cut (default 30 s: 34 s);
    MPI with the oob keepalive above 8.5 s (keepalive_time 10: 16 s); MPI with OpenMPI's defaults
    (keepalive after 300 s idle) still hung 150 s after the cut.
    """
    try:
        code, seconds, out = _run_and_cut(
            cluster, horovodrun(cluster, controller) + [sys.executable, str(SCRIPT), "--epochs", "400"],
            settings, budget)
    finally:
        subprocess.run(["ip", "-n", cluster.host("hostb").netns, "link", "set", cluster.iface, "up"], check=True)
    print(f"{controller}: exit {code} {seconds:.1f}s after the cut;",
          next((line for line in out.splitlines() if re.search(message, line)), ""))
    assert code is not None, f"still running {budget}s after the link was cut:\n{out[-4000:]}"
    assert code != 0 and re.search(message, out), f"exit {code} after {seconds:.1f}s:\n{out[-5000:]}"
