"""docs/launchers.md's MPIJob manifest, in-process, with no Kubernetes:

- against the MPI Operator's CRD as the Kubernetes API server takes it: the CustomResourceDefinition in
  tests/data/mpi-operator/ (kubeflow/mpi-operator at v0.8.0, unchanged; its README says where from). The
  apiVersion and kind are the CRD's, metadata.name is there and a valid name, every field is one the schema
  declares (the server silently drops, "prunes", the others, so a misspelled field would vanish rather than
  fail), no field is left null (dropped too), and the rest validates against the version's openAPIV3Schema with
  jsonschema, with the server's own keywords: x-kubernetes-int-or-string (an integer or a string),
  x-kubernetes-list-type (no duplicate entries in a set or a map-keyed list), x-kubernetes-preserve-unknown-fields
  (unknown fields kept), and the int32/int64 ranges. A test fails if the CRD uses a keyword these checks do not
  handle. MISTAKES shows each check rejecting a realistic mistake, naming its path. The schema cannot catch
  everything: the replica roles are map keys it leaves free (test_the_manifest_is_an_mpijob_... checks them),
  cleanPodPolicy and restartPolicy are free strings, and the operator's own checks at run time (one launcher,
  the job name as a DNS label) are not in it.
- against the image it names (Dockerfile, docker/sshd.Dockerfile): the user, its ssh directory, the sshd
  configuration and port, the script's path.

Neither has run a pod."""

from __future__ import annotations

import functools
import hashlib
import json
import re

import jsonschema
import pytest
import yaml

from tests.launch import ROOT

DOCS = ROOT / "docs" / "launchers.md"
DOCKERFILE = (ROOT / "Dockerfile").read_text()
SSHD = (ROOT / "docker" / "sshd.Dockerfile").read_text()
CRD = ROOT / "tests" / "data" / "mpi-operator" / "kubeflow.org_mpijobs.yaml"
VERSION = "v2beta1"
# What the API server accepts as an object's name (a DNS subdomain, as for any custom resource).
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# The schema keywords the checks below handle; description and default change nothing a manifest is checked for,
# and x-kubernetes-map-type only tells server-side apply how to merge.
HANDLED = {"type", "properties", "additionalProperties", "required", "items", "enum", "pattern", "format", "anyOf",
           "description", "default", "x-kubernetes-int-or-string", "x-kubernetes-list-type",
           "x-kubernetes-list-map-keys", "x-kubernetes-map-type", "x-kubernetes-preserve-unknown-fields"}


def manifest_text() -> str:
    section = DOCS.read_text().split("## Kubernetes: the MPI Operator", 1)[1]
    return re.search(r"```yaml\n(.*?)```", section, re.S).group(1)


def manifest(text: str | None = None) -> dict:
    return yaml.safe_load(manifest_text() if text is None else text)


@functools.cache
def crd() -> dict:
    # 670 kB of YAML: the C loader reads it in a third of a second, the pure-Python one in ten times that.
    return yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def schema() -> dict:
    return next(v for v in crd()["spec"]["versions"] if v["name"] == VERSION)["schema"]["openAPIV3Schema"]


def where(path) -> str:
    """A path as the API server writes it: spec.mpiReplicaSpecs.Worker.template.spec.containers[0].name."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def keywords(node: dict) -> set[str]:
    """Every keyword `node` and the schemas under it use (property names are not keywords)."""
    below = [*node.get("properties", {}).values(), *node.get("anyOf", []),
             *(node[k] for k in ("items", "additionalProperties") if isinstance(node.get(k), dict))]
    return set(node).union(*map(keywords, below))


def prune(value, node: dict, path: tuple, dropped: list[str]):
    """`value` as the API server keeps it under a structural schema, each thing it drops added to `dropped`: the
    fields `node` does not declare (unless x-kubernetes-preserve-unknown-fields), and nulls (the CRD has no
    nullable field; a null takes the field's default, if any)."""
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [prune(item, node["items"], (*path, i), dropped) for i, item in enumerate(value)]
    if not (isinstance(value, dict) and node.get("type") == "object"):
        return value
    declared, other = node.get("properties", {}), node.get("additionalProperties")
    kept = {}
    for key, item in value.items():
        inner = declared.get(key, other if isinstance(other, dict) else None)
        if inner is None and node.get("x-kubernetes-preserve-unknown-fields"):
            kept[key] = item  # as it is, null included
        elif inner is None:
            dropped.append(f"{where((*path, key))}: not a field of the schema; the API server would drop it")
        elif item is None:
            dropped.append(f"{where((*path, key))}: null; the API server would drop it (or put the default)")
        else:
            kept[key] = prune(item, inner, (*path, key), dropped)
    return kept


def _int_or_string(validator, on, value, node):
    if on and (isinstance(value, bool) or not isinstance(value, (int, str))):
        yield jsonschema.ValidationError(f"{value!r} is neither an integer nor a string")


def _list_type(validator, kind, value, node):
    """x-kubernetes-list-type: a set holds no item twice; a map holds no two items with the same keys."""
    if kind not in ("set", "map") or not isinstance(value, list):
        return  # atomic: any list
    if kind == "set":
        keys = [json.dumps(item, sort_keys=True) for item in value]
    else:
        names = node.get("x-kubernetes-list-map-keys", [])
        keys = [", ".join(f"{n}={item.get(n)}" for n in names) for item in value if isinstance(item, dict)]
    for key in sorted({k for k in keys if keys.count(k) > 1}):
        yield jsonschema.ValidationError(f"duplicate entries with {key}")


FORMATS = jsonschema.FormatChecker(formats=())
FORMATS.checks("int32")(lambda n: not isinstance(n, int) or -2**31 <= n < 2**31)
FORMATS.checks("int64")(lambda n: not isinstance(n, int) or -2**63 <= n < 2**63)
# A CRD's schema is OpenAPI v3.0's, whose keywords are JSON Schema draft 4's (exclusiveMaximum a boolean).
Kubernetes = jsonschema.validators.extend(jsonschema.Draft4Validator, {
    "x-kubernetes-int-or-string": _int_or_string, "x-kubernetes-list-type": _list_type})


def problems(job: dict) -> list[str]:
    """What the API server would reject in `job`, or drop from it, each as "path: why"."""
    spec = crd()["spec"]
    found = []
    for key, want in (("apiVersion", f"{spec['group']}/{VERSION}"), ("kind", spec["names"]["kind"])):
        if job.get(key) != want:
            found.append(f"{key}: {job.get(key)!r}, not the CRD's {want!r}")
    name = (job.get("metadata") or {}).get("name")
    if name is None:
        found.append("metadata.name: required")
    elif not (isinstance(name, str) and len(name) <= 253 and DNS_SUBDOMAIN.fullmatch(name)):
        found.append(f"metadata.name: {name!r} is not a DNS subdomain (lower-case letters, digits, '-' and '.')")
    # The server reads metadata as an ObjectMeta (above), and on create ignores status (a subresource).
    body = prune({k: v for k, v in job.items() if k not in ("metadata", "status")}, schema(), (), found)
    errors = Kubernetes(schema(), format_checker=FORMATS).iter_errors(body)
    return found + [f"{where(e.absolute_path)}: {e.message}" for e in sorted(errors, key=lambda e: where(e.path))]


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


WORKER = "spec.mpiReplicaSpecs.Worker.template.spec.containers[0]"
LIMITS = "spec.mpiReplicaSpecs.Worker.template.spec.containers[0].resources.limits"
# Mistakes a user could make in the docs' YAML: (text, its replacement, the path the error names, what it says).
MISTAKES = {
    "misspelled field": ("sshAuthMountPath:", "sshAuthMountpath:", "spec.sshAuthMountpath", "not a field"),
    "field where the v1 API had it": ("  runPolicy:\n    cleanPodPolicy", "  cleanPodPolicy", "spec.cleanPodPolicy",
                                      "not a field"),
    "field left empty": ("sshAuthMountPath: /home/app/.ssh", "sshAuthMountPath:", "spec.sshAuthMountPath", "null"),
    "enum value in another case": ("mpiImplementation: OpenMPI", "mpiImplementation: OpenMpi",
                                   "spec.mpiImplementation", "is not one of ['OpenMPI', 'Intel', 'MPICH']"),
    "slots as a string": ("slotsPerWorker: 1", 'slotsPerWorker: "1"', "spec.slotsPerWorker",
                          "'1' is not of type 'integer'"),
    "replicas as a list": ("replicas: 4", "replicas: [4]", "spec.mpiReplicaSpecs.Worker.replicas",
                           "[4] is not of type 'integer'"),
    "replicas past int32": ("replicas: 4", "replicas: 2147483648", "spec.mpiReplicaSpecs.Worker.replicas",
                            "is not a 'int32'"),
    "container without a name": ("- name: worker\n            image", "- image", WORKER,
                                 "'name' is a required property"),
    "misspelled container field": ("command: [\"/usr/sbin/sshd\"", "commands: [\"/usr/sbin/sshd\"",
                                   f"{WORKER}.commands", "not a field"),
    "limits outside resources": ('resources: {limits: {cpu: "4", memory: 8Gi}}', 'limits: {cpu: "4", memory: 8Gi}',
                                 f"{WORKER}.limits", "not a field"),
    "CPU as a decimal number": ('cpu: "4"', "cpu: 0.5", f"{LIMITS}.cpu", "0.5 is neither an integer nor a string"),
    "memory unit Kubernetes lacks": ("memory: 8Gi", "memory: 8GB", f"{LIMITS}.memory", "'8GB' does not match"),
    "two containers of one name": ("8Gi}}\n", "8Gi}}\n          - name: worker\n            image: busybox\n",
                                   "spec.mpiReplicaSpecs.Worker.template.spec.containers",
                                   "duplicate entries with name=worker"),
    "job without a name": ("  name: hvdp-digits", "  labels: {app: hvdp}", "metadata.name", "required"),
    "job name in capitals": ("name: hvdp-digits", "name: HVDP-digits", "metadata.name", "not a DNS subdomain"),
    "the operator's v1 API": ("kubeflow.org/v2beta1", "kubeflow.org/v1", "apiVersion", "not the CRD's"),
}


def edited(old: str, new: str) -> dict:
    text = manifest_text()
    assert text.count(old) == 1, f"{old!r} is not in the docs' manifest once"
    return manifest(text.replace(old, new))


def test_the_crd_is_the_operators_mpijob_copied_unchanged():
    readme = (CRD.parent / "README.md").read_text()
    assert f"`{hashlib.sha256(CRD.read_bytes()).hexdigest()}`" in readme  # the file the README describes
    assert (CRD.parent / "LICENSE").read_text().split()[:2] == ["Apache", "License"]
    assert (crd()["kind"], crd()["metadata"]["name"]) == ("CustomResourceDefinition", "mpijobs.kubeflow.org")
    assert [v["served"] for v in crd()["spec"]["versions"] if v["name"] == VERSION] == [True]


def test_the_schema_uses_only_keywords_these_checks_handle():
    # A new one (x-kubernetes-validations, nullable, x-kubernetes-embedded-resource...) needs handling here first.
    assert keywords(schema()) <= HANDLED, sorted(keywords(schema()) - HANDLED)


def test_the_manifest_is_valid_against_the_operators_crd():
    assert problems(manifest()) == []


@pytest.mark.parametrize("old, new, path, says", MISTAKES.values(), ids=MISTAKES.keys())
def test_a_mistake_in_the_manifest_is_rejected_naming_its_path(old, new, path, says):
    found = problems(edited(old, new))
    assert any(p.startswith(f"{path}: ") and says in p for p in found), found


@pytest.mark.parametrize("old, new", [('cpu: "4"', "cpu: 4"), ("  mpiImplementation: OpenMPI\n", "")],
                         ids=["quantity as an integer", "field left to its default"])
def test_what_the_server_accepts_is_accepted(old, new):
    assert problems(edited(old, new)) == []


def test_unknown_fields_are_kept_where_the_schema_preserves_them():
    # The MPIJob CRD has no such field; the rule the server follows, on a schema that has.
    node = {"type": "object", "properties": {"kept": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                                                      "properties": {"n": {"type": "integer"}}}}}
    dropped = []
    body = prune({"kept": {"n": 1, "free": {"any": 1}, "empty": None}, "typo": 1}, node, (), dropped)
    assert body == {"kept": {"n": 1, "free": {"any": 1}, "empty": None}} and dropped == [
        "typo: not a field of the schema; the API server would drop it"]
