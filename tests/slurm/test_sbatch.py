"""examples/slurm.sbatch on a real Slurm cluster (conftest.py): the main job with each launcher the script
offers, on one node and across two; jobs preempted mid-epoch (SIGUSR1 to the ranks, SIGUSR1 to the batch
shell, `scontrol requeue`) that requeue and end with the same weights as an uninterrupted job; a Lightning job
(examples/train_lightning.py) requeued the same way, against an uninterrupted one; a job suspended longer
than the watchdog's limit that still finishes; and a long job's whole life (life.py: a GPT with sharded AdamW
requeued, a rank killed, resubmitted on two nodes) against its uninterrupted twin.

Every job is submitted at once, from a directory outside the checkout, and Slurm runs them as its two nodes
(2 CPUs each) free up; the fixture sends each disturbance once that job's first checkpoint exists (so during
its second epoch), and waits for all of them. Each test then reads its job's records (jobcomp: one line per
run), its output file and its result line.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.launch import ROOT, result_line
from tests.slurm import life as lifetime

pytestmark = pytest.mark.slurm

SCRIPT = ROOT / "examples" / "slurm.sbatch"
ENDED = lifetime.ENDED  # a job's states once it is over (a requeued run's record says PENDING)
SUSPEND_SECONDS = 12
WATCHDOG_TIMEOUT = "4"  # the suspended job's HVDP_WATCHDOG_TIMEOUT: the suspension is 3x longer


@dataclass
class Job:
    label: str
    launcher: str
    allocation: tuple[str, ...]  # sbatch options: each form SLURM_TASKS_PER_NODE takes is exercised
    disturb: str | None = None   # "usr1", "batch-usr1", "requeue" or "suspend", once its first checkpoint exists
    first: str = "ckpt-*.pt"     # its first checkpoint: a glob in its checkpoint directory
    env: dict = field(default_factory=dict)
    args: tuple[str, ...] = ()  # the sbatch script's arguments: --python/--script, then -- and the job's flags
    id: int = 0
    out: Path | None = None
    checkpoints: Path | None = None
    submitted: float = 0.0
    disturbed: float | None = None
    resumed: float | None = None  # when a suspended job was resumed
    ended: float | None = None
    runs: list[dict] = field(default_factory=list)

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out and self.out.exists() else ""

    def result(self) -> dict:
        return result_line(self.output())

    def describe(self) -> str:
        runs = [(r.get("JobState"), r.get("ExitCode"), r.get("NodeList")) for r in self.runs]
        return f"job {self.id} ({self.label}): runs {runs}\n--- output (last 4000 characters):\n{self.output()[-4000:]}"


UNINTERRUPTED = {
    ("srun", 1): ("--nodes=1", "--ntasks-per-node=2"),
    ("srun", 2): ("--nodes=2",),  # run from a copy without the --ntasks-per-node line: one task per node, "1(x2)"
    ("mpirun", 1): ("--nodes=1", "--ntasks-per-node=2"),
    ("mpirun", 2): ("--nodes=2", "--ntasks-per-node=1"),
    ("horovodrun", 1): ("--nodes=1", "--ntasks-per-node=2"),
}
DISTURBED = {
    "usr1": Job("SIGUSR1 to the ranks (scancel --signal=USR1)", "srun", ("--nodes=1", "--ntasks-per-node=2"),
                "usr1"),
    # these two read their samples from files with shard(num_workers=2) (examples/train_torch.py --files, the
    # same training as from memory): Slurm's requeue signals every process of the job, DataLoader workers too
    # (issue 45: the checkpoint was lost to "DataLoader worker exited unexpectedly")
    "batch-usr1": Job("SIGUSR1 to the batch shell (scancel --batch --signal=USR1, as --signal=B:USR1@120 at the "
                      "time limit), 2 DataLoader workers per rank", "horovodrun", ("--nodes=1", "--ntasks-per-node=2"),
                      "batch-usr1", args=("--", "--files", "{work}/batch-usr1-files")),
    "requeue": Job("scontrol requeue (SIGTERM to every process, DataLoader workers too)", "mpirun",
                   ("--nodes=2", "--ntasks-per-node=1"), "requeue", args=("--", "--files", "{work}/requeue-files")),
    "suspend": Job(f"scontrol suspend for {SUSPEND_SECONDS} s, then resume", "srun",
                   ("--nodes=1", "--ntasks-per-node=2"), "suspend", env={"HVDP_WATCHDOG_TIMEOUT": WATCHDOG_TIMEOUT}),
}
# examples/train_lightning.py through the same script (--script): its checkpoint directory is the Trainer's
# default_root_dir, where ModelCheckpoint writes checkpoints/epoch=<e>-step=<s>.ckpt at each epoch's end and
# hvdp's preemption Lightning's hpc_ckpt_<n>.ckpt. 12 epochs (2.5 s for 6 unloaded): the requeue lands well
# before fit ends
LIGHTNING_ARGS = ("--script", str(ROOT / "examples" / "train_lightning.py"), "--", "--epochs", "12")
LIGHTNING = {
    "lightning": Job("Lightning, uninterrupted", "srun", ("--nodes=1", "--ntasks-per-node=2"), args=LIGHTNING_ARGS),
    "lightning-requeue": Job("Lightning, HorovodStrategy(preemption=True), scontrol requeue", "srun",
                             ("--nodes=1", "--ntasks-per-node=2"), "requeue", first="checkpoints/epoch=*.ckpt",
                             args=LIGHTNING_ARGS),
}
# A long job's whole life (life.py): the short one among these jobs; HVDP_LIFE_CYCLES=n (`make soak-life`)
# runs only the long ones, n cycles each
CYCLES = int(os.environ["HVDP_LIFE_CYCLES"]) if os.environ.get("HVDP_LIFE_CYCLES") else None
LIVES = ["life"] if CYCLES is None else ["life-same-size", "life-resized"]


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory) -> dict:
    """Every job of this module, submitted together, disturbed and waited for."""
    work = tmp_path_factory.mktemp("sbatch")
    todo = {(launcher, nodes): Job(f"{launcher} on {nodes} node(s)", launcher, allocation)
            for (launcher, nodes), allocation in UNINTERRUPTED.items()}
    todo.update(DISTURBED)
    todo.update(LIGHTNING)
    # the long job's life first: its runs and resubmissions are the longest chain of this batch
    lives = lifetime.lives(work, CYCLES)
    for life in lives.values():
        life.submit(slurm)
    # A user's copy, outside the checkout, without the --ntasks-per-node line: HVDP_ROOT names the checkout
    edited = work / "edited.sbatch"
    edited.write_text("".join(line for line in SCRIPT.read_text().splitlines(keepends=True)
                              if not line.startswith("#SBATCH --ntasks-per-node")))
    todo[("srun", 2)].env = {"HVDP_ROOT": str(ROOT)}
    # ...which runs the user's own script (a copy of the example, outside the checkout) with a python given by
    # path, as docs/recipes.md's Slurm recipe says (`--python`, `--script`, then `--` and the script's flags)
    shutil.copy(ROOT / "examples" / "train_torch.py", work / "my_train.py")
    todo[("srun", 2)].args = ("--python", sys.executable, "--script", "{work}/my_train.py")
    if CYCLES is not None:  # the soak: its lives alone
        todo = {}
    for key, job in todo.items():
        name = re.sub(r"\W+", "-", str(key)).strip("-")
        job.out, job.checkpoints = work / f"{name}.out", work / f"{name}-checkpoints"
        job.submitted = time.monotonic()
        script = edited if key == ("srun", 2) else SCRIPT
        args = [a.format(work=work) for a in job.args]
        job.id = slurm.sbatch(*job.allocation, "--cpus-per-task=1", f"--output={job.out}", str(script), *args,
                              cwd=work, HVDP_LAUNCHER=job.launcher, HVDP_CHECKPOINT_DIR=str(job.checkpoints),
                              **job.env)
    todo.update(lives)
    deadline = time.monotonic() + (900 if CYCLES is None else 900 + 300 * CYCLES)
    while any(j.ended is None for j in todo.values()):
        if time.monotonic() > deadline:
            slurm.run("scancel", *(str(j.id) for j in todo.values() if j.ended is None and j.id), check=False)
            break
        for job in todo.values():
            job.drive(slurm) if isinstance(job, lifetime.Life) else _drive(slurm, job)
        time.sleep(0.1)
    slurm.wait_idle(120)
    report = "\n".join(f"  job {j.id:2d} {j.label}: {len(j.runs)} run(s), {j.ended - j.submitted:.0f} s from "
                       f"submission to the end" for j in todo.values() if j.ended)
    print(f"\nslurm jobs (all submitted at once, 2 nodes of 2 CPUs on a 2-core host):\n{report}")
    return todo


def _drive(slurm, job: Job) -> None:
    """One look at `job`: disturb it when its time has come, note when it has ended for good."""
    if job.ended is not None:
        return
    now = time.monotonic()
    if job.disturb and job.disturbed is None and any(job.checkpoints.glob(job.first)):
        job.disturbed = now
        action = {"usr1": ["scancel", "--signal=USR1"], "batch-usr1": ["scancel", "--batch", "--signal=USR1"],
                  "requeue": ["scontrol", "requeue"], "suspend": ["scontrol", "suspend"]}[job.disturb]
        slurm.run(*action, str(job.id))
    if job.disturb == "suspend" and job.disturbed and job.resumed is None and now > job.disturbed + SUSPEND_SECONDS:
        job.resumed = now
        slurm.run("scontrol", "resume", str(job.id))
    job.runs = slurm.completions(job.id)
    if job.runs and job.runs[-1].get("JobState") in ENDED:
        job.ended = now


@pytest.mark.parametrize("launcher,nodes", [("srun", 1), ("srun", 2), ("mpirun", 1), ("mpirun", 2),
                                            ("horovodrun", 1), ("horovodrun", 2)])
def test_main_job_trains_with_each_launcher(jobs, launcher, nodes):
    """sbatch examples/slurm.sbatch: accuracy, every test sample counted once, the ranks on the nodes Slurm
    gave, replicas bit-identical (the example's check_consistency fails the job otherwise) and the same
    weights under every launcher and node count."""
    if (launcher, nodes) == ("horovodrun", 2):
        pytest.skip("horovodrun reaches the other nodes over ssh, under their node names: n1 and n2 are two slurmd "
                    "on this one host, with no such host names and no sshd (tests/multihost runs horovodrun "
                    "across two hosts over ssh; srun and mpirun start their ranks through Slurm instead)")
    job = jobs[(launcher, nodes)]
    assert [r["JobState"] for r in job.runs] == ["COMPLETED"], job.describe()
    assert job.runs[0]["ExitCode"] == "0:0" and job.runs[0]["NodeCnt"] == str(nodes), job.describe()
    result = job.result()
    assert result["test_accuracy"] >= 0.97 and result["world_size"] == 2, job.describe()
    assert result["test_samples"] == 359
    assert f"2 ranks on {' '.join(['n1', 'n2'][:nodes]) if nodes == 2 else job.runs[0]['NodeList']} via {launcher}" \
        in job.output(), job.describe()
    if (launcher, nodes) == ("srun", 2):  # the user's own script and python, given to the sbatch
        assert f"hvdp: running {sys.executable} {job.out.parent / 'my_train.py'}" in job.output(), job.describe()
    reference = jobs[("srun", 1)].result()["weights_sha256"]
    assert result["weights_sha256"] == reference, "another launcher trained other weights:\n" + job.describe()


@pytest.mark.parametrize("disturbance", ["usr1", "batch-usr1", "requeue"])
def test_preempted_job_requeues_and_ends_with_the_uninterrupted_weights(jobs, disturbance):
    """A stop signal mid-epoch: every rank stops after the same step, one checkpoint, exit 75, requeue (by the
    script after a SIGUSR1; by Slurm itself for `scontrol requeue`), and the second run resumes from that
    checkpoint mid-epoch and ends bit-identical to the uninterrupted job."""
    job = jobs[disturbance]
    assert job.disturbed is not None, "the job never wrote its first checkpoint:\n" + job.describe()
    assert len(job.runs) == 2 and job.runs[-1]["JobState"] == "COMPLETED", job.describe()
    out = job.output()
    assert "(restart 0)" in out and "(restart 1)" in out, job.describe()
    resumes = re.findall(r"resumed from epoch (\d+) step (\d+)", out)
    assert len(resumes) == 1 and int(resumes[0][1]) > 0, f"not resumed mid-epoch once: {resumes}\n" + job.describe()
    if disturbance != "requeue":  # after a SIGUSR1 nobody but the script requeues the job
        assert f"hvdp: requeueing job {job.id} (exit 75)" in out, job.describe()
    assert "exited unexpectedly" not in out, job.describe()  # its DataLoader workers outlived the signal
    result = job.result()
    assert result["weights_sha256"] == jobs[("srun", 1)].result()["weights_sha256"], job.describe()
    assert result["test_accuracy"] >= 0.97


def test_suspended_job_finishes(jobs):
    """`scontrol suspend` stops every process of the job (SIGSTOP) for 3x the watchdog's limit; after
    `scontrol resume` the job trains on and ends as if it had never stopped."""
    job = jobs["suspend"]
    assert job.disturbed is not None and job.resumed is not None, job.describe()
    assert [r["JobState"] for r in job.runs] == ["COMPLETED"], job.describe()
    assert "process was paused for" in job.output(), job.describe()  # the watchdog saw it, and said so
    assert job.ended - job.resumed < 300
    result = job.result()
    assert result["weights_sha256"] == jobs[("srun", 1)].result()["weights_sha256"], job.describe()


def test_lightning_job_requeued_by_slurm_resumes_from_its_hpc_checkpoint_with_the_uninterrupted_weights(jobs):
    """examples/train_lightning.py (HorovodStrategy(preemption=True)) under `scontrol requeue` once its first
    epoch's checkpoint exists: Slurm's SIGTERM reaches every process; hvdp's handling alone acts on it (every
    rank stops after the same step, rank 0 writes Lightning's HPC checkpoint, once, and the ranks exit 75, which
    Slurm records for the first run); Lightning's own (its SIGTERM notifier, its SLURMEnvironment requeue) does
    not. Slurm requeues the job, whose fit resumes from that checkpoint by Lightning's rule and ends with the
    weights of the uninterrupted Lightning job, bit for bit."""
    job, reference = jobs["lightning-requeue"], jobs["lightning"]
    assert [r["JobState"] for r in reference.runs] == ["COMPLETED"], reference.describe()
    assert reference.result()["resumed_from"] is None, reference.describe()
    assert job.disturbed is not None, "the job never wrote its first checkpoint:\n" + job.describe()
    assert len(job.runs) == 2 and job.runs[-1]["JobState"] == "COMPLETED", job.describe()
    out = job.output()
    # the ranks' requeue code as srun reports it (Slurm writes the first run's record, ExitCode and DerivedExitCode
    # 0:0, as it requeues the job, before the ranks have exited)
    exits = re.findall(r"srun: error: \S+: tasks? ([\d,-]+): Exited with exit code (\d+)", out)
    assert sorted(_tasks(ids) for ids, code in exits if code == "75") in ([[0, 1]], [[0], [1]]), job.describe()
    assert all(code == "75" for _, code in exits), job.describe()
    assert "(restart 0)" in out and "(restart 1)" in out, job.describe()
    assert "checkpoint written, exiting with 75" in out, job.describe()
    assert f"hvdp: requeueing job {job.id}" not in out, job.describe()  # Slurm requeued it, not the script
    for lightnings in ("Received SIGTERM", "Handling auto-requeue", "requeing job", "requeued successfully",
                       "exited unexpectedly"):
        assert lightnings not in out, f"{lightnings!r} in the output:\n" + job.describe()
    assert sorted(p.name for p in job.checkpoints.glob("hpc_ckpt_*")) == ["hpc_ckpt_1.ckpt"], job.describe()
    result, uninterrupted = job.result(), reference.result()
    stopped = torch.load(job.checkpoints / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=False)["global_step"]
    assert 0 < stopped < uninterrupted["global_step"], (stopped, job.describe())  # within the fit, after epoch 1
    print(f"\nlightning job {job.id}: requeued at optimizer step {stopped} of {uninterrupted['global_step']}, "
          f"runs {[(r['JobState'], r['ExitCode']) for r in job.runs]}")
    assert result["resumed_from"] == str(job.checkpoints / "hpc_ckpt_1.ckpt"), job.describe()
    assert result["global_step"] == uninterrupted["global_step"], job.describe()
    assert result["weights_sha256"] == uninterrupted["weights_sha256"], job.describe() + "\n" + reference.describe()
    assert result["test_samples"] == 359 and result["test_accuracy"] >= 0.95, job.describe()


def _tasks(ids: str) -> list[int]:
    """srun's task list ("0-1", "0,2-3", "1") as numbers."""
    return [t for part in ids.split(",") for t in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)]


@pytest.mark.parametrize("name", LIVES)
def test_a_long_jobs_life_ends_with_the_uninterrupted_weights(jobs, name):
    """tests/slurm/life_train.py (GPT, AdamW with sharded state, bf16 autocast, 2 accumulated passes, clipping,
    2 DataLoader workers per rank reading files, a checkpoint every k=4 steps) through its plan (life.py):
    `scontrol requeue` (every process signalled: one checkpoint, exit 75, Slurm requeues it on its one node),
    rank 1 killed with SIGKILL (the job fails; the user resubmits it, on two nodes). No run trains more than k
    steps twice, every checkpoint loads, those written before any change of world size and the end of a life
    that never changed it equal the uninterrupted job's bit for bit; across sizes the end is within
    life.RELATIVE of the distance trained since the resize (bf16 rounding, docs/elastic.md)."""
    life, reference = jobs[name], jobs["life-reference"]
    assert [r["JobState"] for r in reference.runs] == ["COMPLETED"], reference.describe()
    assert [e for e, _ in life.events] == life.plan, "the plan was not lived out:\n" + life.describe()
    assert life.runs and life.runs[-1]["JobState"] == "COMPLETED", life.describe()
    out = life.output()
    assert "exited unexpectedly" not in out, life.describe()  # the DataLoader workers outlived every signal
    runs = lifetime.segments(out)
    assert len(runs) == len(life.runs), f"{runs}\n" + life.describe()
    assert runs[0]["resumed"] is None, f"{runs}\n" + life.describe()
    assert all(r["resumed"] is not None for r in runs[1:]), f"{runs}\n" + life.describe()
    # each run ended as its event said: a requeue with its checkpoint and exit 75, a kill failed the job
    ends = [e for e in life.plan if not e.startswith("resubmit")]
    for run, record, event in zip(runs, life.runs, ends):
        if event == "requeue":
            assert run["requeued"] and record["JobState"] == "PENDING", (run, record, life.describe())
        else:
            assert not run["requeued"] and record["JobState"] == "FAILED", (run, record, life.describe())
    kills = re.findall(r"srun: error: \S+: task 1: Killed", out)  # srun ends the job at once, naming the rank
    assert len(kills) == life.plan.count("kill"), life.describe()
    redone = lifetime.redone(runs)
    assert all(0 <= r <= life.k for r in redone), f"steps redone {redone} (k={life.k})\n" + life.describe()
    assert all(r == 0 for r, e in zip(redone, ends) if e == "requeue"), (redone, life.describe())
    sizes = [2]  # a requeued run keeps its allocation, a resubmitted one has the plan's (nodes x ranks)
    for event in life.plan:
        if event == "requeue":
            sizes.append(sizes[-1])
        elif event != "kill":
            sizes.append(math.prod(int(n) for n in event.split()[1].split("x")))
    assert [r["size"] for r in runs] == sizes, f"{runs}\n" + life.describe()
    # every checkpoint loads; before the first change of world size they are the uninterrupted job's
    changed = next((r["resumed"] for r in runs if r["size"] != 2), None)
    mine = sorted(life.checkpoints.glob("ckpt-*.pt"))
    theirs = {p.name: lifetime.load(p) for p in sorted(reference.checkpoints.glob("ckpt-*.pt"))}
    compared = 0
    for path in mine:
        payload = lifetime.load(path)
        step = payload["hvdp"]["step"]
        if path.name in theirs and (changed is None or step <= changed):
            other = theirs[path.name]
            for part in ("model", "optimizer"):
                assert _equal(payload[part], other[part]), f"{path.name}: {part} differs\n" + life.describe()
            compared += 1
    assert compared >= 2, (compared, [p.name for p in mine])
    last = f"ckpt-{life.epochs * life.k:08d}.pt"
    end, uninterrupted = lifetime.load(life.checkpoints / last)["model"], theirs[last]["model"]
    seconds = [_seconds(r) for r in life.runs]
    if changed is None:
        assert life.result()["weights_sha256"] == reference.result()["weights_sha256"], life.describe()
        assert _equal(end, uninterrupted)
        worst, relative = 0.0, 0.0
    else:
        start = theirs[f"ckpt-{changed:08d}.pt"]["model"]
        worst, relative = lifetime.distance(end, uninterrupted, start)
        assert relative <= lifetime.RELATIVE, (worst, relative, life.describe())
    print(f"\n{name}: world sizes {sizes}, steps redone per interruption {list(zip(ends, redone))}, "
          f"seconds per run {seconds}, {len(mine)} checkpoints loaded ({compared} equal to the uninterrupted job's), "
          f"end vs uninterrupted: max |dw| {worst:.2e}, relative {relative:.2e}; "
          f"{life.ended - life.submitted:.0f} s from submission to the end")


def _equal(a, b) -> bool:
    """Two state_dicts (nested dicts, lists and tensors) equal in every bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def _seconds(record: dict) -> int:
    """A run's time from its jobcomp record (StartTime to EndTime)."""
    from datetime import datetime
    start, end = (datetime.fromisoformat(record[k]) for k in ("StartTime", "EndTime"))
    return round((end - start).total_seconds())
