"""``smp2ds convert --to kubernetes``: an estimator's job as a Kubeflow training-operator ``PyTorchJob``.

The manifest targets the operator's ``kubeflow.org/v1`` API as of training-operator v1.7 and later (tested against
the v1.9 CRD schema, ``schemas/vendor/kubeflow-training-operator``): one ``Master`` replica and ``nodes - 1``
``Worker`` replicas, ``spec.nprocPerNode`` the plan's ranks per node, and per pod that many
``nvidia.com/gpu`` (none with ``--cpu``). The operator exports ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` to every pod, which torchrun reads as its
flags, so the container runs ``torchrun SCRIPT ARGS`` with the SageMaker environment of ``convert --to torchrun``
(``cluster_job``) as its ``env``. Kubernetes accepts variable names such as ``SM_HP_CHECKPOINT-DIR`` that no shell
can export, so every variable goes into ``env`` as it is. Kubernetes expands ``$(NAME)`` in a container's command
and environment, so every ``$`` is written ``$$`` (which Kubernetes turns back into ``$``).

Every pod mounts a memory-backed ``/dev/shm`` (the container runtime's 64 MB default is too small for NCCL and
DataLoader workers) and requests what it limits: the node's GPUs, or with ``--cpu`` one core per rank. AWS's EFA
variables of the estimator are left out (named in the annotation ``smp2ds/left-out-env``) unless ``--efa`` keeps
them; then each pod also asks for the instance's EFA interfaces (``vpc.amazonaws.com/efa``, AWS's device plugin).

Rendered as YAML when PyYAML is importable, else as JSON (``kubectl apply -f`` reads both).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from smp2ds.translator.launcher import shell_name
from smp2ds.translator.tools.cluster_job import free_of

API_VERSION = "kubeflow.org/v1"
OPERATOR_PORT = 23456
"""The training-operator's default rendezvous port (the container port named ``pytorchjob-port``)."""
CONTAINER = "pytorch"
"""The container name the operator looks for in a PyTorchJob's pods."""
NODE_HOST = 'export SM_CURRENT_HOST="algo-$((PET_NODE_RANK + 1))"; exec "$@"'
"""Run by ``sh -c`` in each pod of a multi-node job: SageMaker's name of this node, then torchrun."""
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def check_job_name(name: str) -> str:
    """``name`` if it is a valid PyTorchJob name (a DNS label: the operator names pods and services after it)."""
    if len(name) > 63 or not _DNS_LABEL.match(name):
        raise ValueError(f"--job-name {name!r} is not a Kubernetes name: use at most 63 lower-case letters, digits "
                         "and '-', starting and ending with a letter or digit")
    return name


def job_name(source: str) -> str:
    """A PyTorchJob name from the input file's name (``gpt2_30b.json`` -> ``smp2ds-gpt2-30b``)."""
    stem = re.sub(r"\.[^./]*$", "", source.rsplit("/", 1)[-1]) if source not in ("-", "<stdin>") else "job"
    name = "smp2ds-" + re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")
    return name[:63].rstrip("-") or "smp2ds-job"


def literal(text: str) -> str:
    """``text`` as Kubernetes must see it to pass it on unchanged: ``$`` doubled, so no ``$(NAME)`` expands."""
    return text.replace("$", "$$")


def container(job: Mapping[str, Any], image: str, gpus: bool) -> dict[str, Any]:
    """The ``pytorch`` container of every pod: image, command, environment, port and GPUs."""
    nodes, nproc = int(job["nodes"]), int(job["nproc_per_node"])
    env = [{"name": name, "value": literal(str(value))} for name, value in job["env"].items()]
    if not gpus:
        env.append({"name": "DS_ACCELERATOR", "value": "cpu"})
    command = ["torchrun", *job["script"]]
    if nodes > 1:
        # sh (dash) drops names it cannot hold (SM_HP_CHECKPOINT-DIR) from what it execs: env hands them on again
        unshell = [f"{name}={value}" for name, value in job["env"].items() if not shell_name(name)]
        command = ["sh", "-c", NODE_HOST, "smp2ds-node", *(["env", *unshell] if unshell else []), *command]
    command = [literal(word) for word in command]
    spec: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "command": command,
        "env": env,
        "ports": [{"name": "pytorchjob-port", "containerPort": free_of(OPERATOR_PORT, job.get("ddp_port"))}],
    }
    wanted: dict[str, Any] = {"nvidia.com/gpu": nproc} if gpus else {"cpu": nproc}
    if job.get("efa"):
        wanted[EFA_RESOURCE] = efa_interfaces(job.get("instance_type"))
    spec["resources"] = {"requests": dict(wanted), "limits": dict(wanted)}
    spec["volumeMounts"] = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    return spec


SHM_VOLUME = "dshm"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
_EFA_INTERFACES = {"p4d.24xlarge": 4, "p4de.24xlarge": 4, "p5.48xlarge": 32, "p5e.48xlarge": 32,
                   "p5en.48xlarge": 16, "trn1.32xlarge": 8, "trn1n.32xlarge": 16}
"""EFA network interfaces per instance type (AWS's published figures); other types: 1."""


def efa_interfaces(instance_type: str | None) -> int:
    """How many EFA interfaces a pod on ``instance_type`` (``ml.`` prefix allowed) asks for."""
    name = (instance_type or "").removeprefix("ml.")
    return _EFA_INTERFACES.get(name, 1)


def pytorchjob(job: Mapping[str, Any], *, name: str, image: str, gpus: bool = True,
               namespace: str | None = None) -> dict[str, Any]:
    """The ``PyTorchJob`` manifest (a dict) for ``job`` (``cluster_job``)."""
    nodes = int(job["nodes"])

    def replica(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [container(job, image, gpus)],
                                      "volumes": [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}]}}}

    replicas = {"Master": replica(1)}
    if nodes > 1:
        replicas["Worker"] = replica(nodes - 1)
    metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/created-by": "smp2ds"}}
    if job.get("left_out"):
        metadata["annotations"] = {"smp2ds/left-out-env": ",".join(job["left_out"]) + " (AWS EFA settings; "
                                   "convert with --efa to keep them)"}
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": API_VERSION,
        "kind": "PyTorchJob",
        "metadata": metadata,
        "spec": {
            "nprocPerNode": str(job["nproc_per_node"]),
            "runPolicy": {"cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": replicas,
        },
    }


def render_manifest(manifest: Mapping[str, Any], fmt: str = "auto") -> str:
    """``manifest`` as YAML (``fmt`` ``auto`` with PyYAML installed, or ``yaml``) or JSON."""
    if fmt in ("auto", "yaml"):
        try:
            import yaml
        except ImportError:
            if fmt == "yaml":
                raise ValueError("YAML output needs PyYAML (pip install pyyaml); use -o FILE.json for JSON") from None
        else:
            return yaml.safe_dump(dict(manifest), sort_keys=False, default_flow_style=False, width=1000)
    return json.dumps(manifest, indent=2) + "\n"
