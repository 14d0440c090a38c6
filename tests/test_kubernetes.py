"""docs/launchers.md's MPIJob manifest against the image it names (Dockerfile, docker/sshd.Dockerfile): the
user, its ssh directory, the sshd configuration and port, the script's path. In-process, no Kubernetes. The
manifest's fields against the MPI Operator's CRD schema are not checked here (the schema is not in this
repository; docs/launchers.md says when and how it was checked)."""

from __future__ import annotations

import re

import yaml

from tests.launch import ROOT

DOCS = ROOT / "docs" / "launchers.md"
DOCKERFILE = (ROOT / "Dockerfile").read_text()
SSHD = (ROOT / "docker" / "sshd.Dockerfile").read_text()


def manifest() -> dict:
    section = DOCS.read_text().split("## Kubernetes: the MPI Operator", 1)[1]
    return yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))


def containers(job: dict, role: str) -> list[dict]:
    return job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]["containers"]


def test_the_manifest_is_an_mpijob_of_the_operators_v2beta1_api():
    job = manifest()
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    assert job["spec"]["mpiImplementation"] == "OpenMPI" and set(job["spec"]["mpiReplicaSpecs"]) == {"Launcher",
                                                                                                     "Worker"}


def test_the_keys_are_mounted_where_the_images_user_and_its_sshd_look():
    job = manifest()
    user = re.search(r"useradd --create-home .*?(\w+)\s*\\", DOCKERFILE).group(1)
    assert re.search(rf"^USER {user}$", DOCKERFILE, re.M) and re.search(rf"^USER {user}$", SSHD, re.M)
    home = f"/home/{user}"
    assert job["spec"]["sshAuthMountPath"] == f"{home}/.ssh"  # not the operator's default /root/.ssh
    worker = containers(job, "Worker")[0]
    assert worker["command"][:2] == ["/usr/sbin/sshd", "-De"] and worker["command"][2] == "-f"
    config = worker["command"][3]
    assert config == f"{home}/.sshd_config" and f"> {config}" in SSHD
    written = re.search(rf"printf '([^']*)'\s*\\\s*> {re.escape(config)}", SSHD).group(1).split("\\n")
    assert f"HostKey {home}/.ssh/id_rsa" in written  # the operator's key file name
    assert "StrictModes no" in written  # the mounted Secret's modes are the operator's
    client = re.search(r"printf '(Host \*[^']*)'", SSHD).group(1).split("\\n")
    server_port = next(line for line in written if line.startswith("Port "))
    assert f"    {server_port}" in client and "    StrictHostKeyChecking no" in client
    assert int(server_port.split()[1]) > 1024  # a non-root sshd cannot bind a lower port


def test_the_launcher_runs_the_images_example_with_its_environment():
    job = manifest()
    launcher = containers(job, "Launcher")[0]["command"]
    assert launcher[0] == "mpirun" and launcher[-2:] == ["python", "examples/train_torch.py"]
    assert "-x" in launcher and launcher[launcher.index("-x") + 1] == "PATH"  # the venv, for ssh-started ranks
    assert re.search(r"^WORKDIR /workspace$", DOCKERFILE, re.M)
    assert "COPY --chown=app:app examples/ /workspace/examples/" in DOCKERFILE
    images = {c["image"] for role in ("Launcher", "Worker") for c in containers(job, role)}
    assert images == {"registry.example.com/hvdp:cpu-sshd"}
    assert "-t registry.example.com/hvdp:cpu-sshd" in DOCS.read_text()  # the build the docs show makes it
