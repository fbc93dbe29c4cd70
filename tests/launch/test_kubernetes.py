"""The Kubernetes manifests (examples/clusters/kubernetes) fit together, checked without a
cluster: names, selectors, ports, mounts, variables and the Secret's key agree; the agents'
shell command, run with Kubernetes' variables, asks dtrain for what the controller expects; the
Secret as the kubelet mounts it passes dtrain's check."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dtrain import secretfile
from dtrain.cli import _parse
from dtrain.launch.agent import _parser as agent_parser

FOLDER = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "kubernetes"
POD_IP = "10.244.1.7"
"""What the downward API gives the controller's pod."""


def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """Every object of every file, by (kind, name)."""
    objects = {}
    for path in sorted(FOLDER.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            objects[document["kind"], document["metadata"]["name"]] = document
    return objects


OBJECTS = manifests()
SERVICE = OBJECTS["Service", "dtrain-controller"]
CONTROLLER = OBJECTS["Job", "dtrain-controller"]
AGENTS = OBJECTS["Job", "dtrain-agents"]
POLICY = OBJECTS["NetworkPolicy", "dtrain-job"]
CLAIM = OBJECTS["PersistentVolumeClaim", "dtrain-shared"]
FILES = OBJECTS["Pod", "dtrain-files"]


def pod(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["template"]["spec"]


def container(job: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod(job)["containers"]
    return only


def labels(job: dict[str, Any]) -> dict[str, str]:
    return job["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], chosen: dict[str, str]) -> bool:
    return all(chosen.get(key) == value for key, value in selector.items())


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a container's command and args: ``$(NAME)`` of a variable the
    container defines becomes its value, ``$$`` a ``$``, anything else stays as written."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def env_of(job: dict[str, Any], downward: dict[str, str]) -> dict[str, str]:
    """The container's variables: values as given, the downward API's from ``downward``."""
    env = {}
    for variable in container(job).get("env", []):
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        else:
            env[variable["name"]] = downward[variable["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def mounts(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each mount path of the job's container, with the volume mounted there."""
    return pod_mounts(pod(job))


def pod_mounts(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    (only,) = spec["containers"]
    return {m["mountPath"]: volumes[m["name"]] for m in only["volumeMounts"]}


def volume_under(job: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume that holds ``path`` in the container."""
    (holder,) = (m for m in mounts(job) if path == m or path.startswith(m.rstrip("/") + "/"))
    return mounts(job)[holder]


def controller_args() -> Any:
    """``dtrain run``'s flags in the controller's pod, parsed by dtrain."""
    env = env_of(CONTROLLER, {"status.podIP": POD_IP})
    command = [expand(word, env) for word in container(CONTROLLER)["command"]]
    assert command == ["dtrain", "run"]
    return _parse([*command[1:], *(expand(word, env) for word in container(CONTROLLER)["args"])])


def agent_argv(index: int, tmp_path: Path) -> list[str]:
    """What the agents' shell command runs as pod ``index``, with ``getent`` and ``dtrain``
    stood in for: ``dtrain``'s arguments."""
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir(exist_ok=True)
    answers = {
        "getent": f'[ "$*" = "hosts dtrain-controller" ] && echo "{POD_IP}    dtrain-controller"',
        "dtrain": f"python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\" "
        f"> {tmp_path}/argv.json",
    }
    for name, body in answers.items():
        (bin_folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_folder / name).chmod(0o755)
    env = {**env_of(AGENTS, {}), "JOB_COMPLETION_INDEX": str(index)}
    command = [expand(word, env) for word in container(AGENTS)["command"]]
    args = [expand(word, env) for word in container(AGENTS)["args"]]
    subprocess.run(
        [*command, *args],
        env={**env, "PATH": f"{bin_folder}{os.pathsep}{os.environ['PATH']}"},
        check=True,
        timeout=30,
    )
    return json.loads((tmp_path / "argv.json").read_text())


def test_the_service_reaches_the_controller_pod_and_no_agent_on_its_port() -> None:
    selector = SERVICE["spec"]["selector"]
    assert selects(selector, labels(CONTROLLER)) and not selects(selector, labels(AGENTS))
    (port,) = SERVICE["spec"]["ports"]
    (exposed,) = container(CONTROLLER)["ports"]
    assert port["port"] == port["targetPort"] == exposed["containerPort"]
    assert controller_args().cluster == f"join://{POD_IP}:{port['targetPort']}"


@pytest.mark.parametrize("index", [0, 3])
def test_each_agent_joins_the_service_with_the_secret_as_the_host_its_index_names(
    index: int, tmp_path: Path
) -> None:
    argv = agent_argv(index, tmp_path)
    assert argv[0] == "agent"
    agent = agent_parser("dtrain agent").parse_args(argv[1:])
    (port,) = SERVICE["spec"]["ports"]
    assert agent.join == f"{POD_IP}:{port['port']}"
    assert agent.host == f"algo-{index + 1}"
    assert agent.secret_file == controller_args().secret_file


def test_as_many_agents_run_at_once_as_the_controller_awaits_one_a_node() -> None:
    spec = AGENTS["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == controller_args().instance_count
    (rule,) = pod(AGENTS)["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert rule["topologyKey"] == "kubernetes.io/hostname"
    assert selects(rule["labelSelector"]["matchLabels"], labels(AGENTS))


def test_both_pods_mount_the_secret_the_script_creates_at_the_path_dtrain_reads(
    tmp_path: Path,
) -> None:
    created = secret_script(tmp_path)
    name, key = created["name"], created["key"]
    path = controller_args().secret_file
    for job in (CONTROLLER, AGENTS):
        volume = volume_under(job, path)["secret"]
        assert volume["secretName"] == name
        (item,) = volume["items"]
        mount = next(m for m, v in mounts(job).items() if v.get("secret") is volume)
        assert (item["key"], f"{mount}/{item['path']}") == (key, path)


def secret_script(tmp_path: Path) -> dict[str, Any]:
    """Run secret.sh with ``kubectl`` stood in for: the Secret's name and key, the value, and
    the value's file's mode, as kubectl saw them."""
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    seen = tmp_path / "kubectl.json"
    (bin_folder / "kubectl").write_text(
        "#!/usr/bin/env python3\n"
        "import json, os, sys\n"
        "file = sys.argv[-1].split('=', 2)[2]\n"
        "json.dump({'argv': sys.argv[1:], 'value': open(file).read(),\n"
        "           'mode': os.stat(file).st_mode & 0o777, 'file': file},\n"
        f"          open({str(seen)!r}, 'w'))\n"
    )
    (bin_folder / "kubectl").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_folder}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run([str(FOLDER / "secret.sh")], env=env, check=True, timeout=30)
    call = json.loads(seen.read_text())
    assert call["argv"][:4] == ["create", "secret", "generic", call["argv"][3]]
    assert call["argv"][4].startswith("--from-file=")
    key = call["argv"][4].removeprefix("--from-file=").split("=")[0]
    assert re.fullmatch("[0-9a-f]{64}", call["value"])  # dtrain asks for 16 or more
    assert call["mode"] == 0o600 and not Path(call["file"]).exists()
    return {"name": call["argv"][3], "key": key}


@pytest.mark.parametrize("job", [CONTROLLER, AGENTS], ids=["controller", "agents"])
def test_the_mounted_secret_is_one_dtrain_reads_as_the_pods_user(
    job: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``fsGroup`` the kubelet makes each file root's, of that group, its mode the
    volume's ``defaultMode`` with the group's read added; dtrain reads it as the pod's user."""
    context = pod(job)["securityContext"]
    assert context["runAsNonRoot"] and context["runAsUser"] != 0
    volume = volume_under(job, controller_args().secret_file)["secret"]
    mode = volume["defaultMode"] | stat.S_IRGRP
    monkeypatch.setattr(os, "geteuid", lambda: context["runAsUser"])
    monkeypatch.setattr(os, "getegid", lambda: context["runAsGroup"])
    monkeypatch.setattr(os, "getgroups", lambda: [context["fsGroup"]])
    mounted = os.stat_result((stat.S_IFREG | mode, 1, 1, 1, 0, context["fsGroup"], 64, 0, 0, 0))
    assert secretfile._file_refusal(mounted) is None


def test_code_channels_and_the_output_live_on_the_shared_volume() -> None:
    args = controller_args()
    claim = CLAIM["metadata"]["name"]
    controller_env = env_of(CONTROLLER, {"status.podIP": POD_IP})
    channel = args.channel[0].split("=", 1)[1].split(",")[0]
    for job, path in (
        (CONTROLLER, args.source_dir),
        (CONTROLLER, channel),
        (CONTROLLER, controller_env["DTRAIN_HOME"]),  # the job's record and model.tar.gz
        (AGENTS, channel),  # each agent reads its share where the controller checked it
    ):
        assert volume_under(job, path)["persistentVolumeClaim"]["claimName"] == claim, path
    assert "ReadWriteMany" in CLAIM["spec"]["accessModes"]
    for mount, volume in pod_mounts(FILES["spec"]).items():  # for kubectl cp, in and out
        assert (mount, volume["persistentVolumeClaim"]["claimName"]) == ("/shared", claim)
    for spec in (pod(CONTROLLER), pod(AGENTS), FILES["spec"]):
        # The default (Always) makes the volume's folders group-writable on every mount, and
        # dtrain refuses such a DTRAIN_HOME.
        assert spec["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


def test_agents_have_a_scratch_folder_a_large_shm_and_every_pod_its_resources() -> None:
    home = env_of(AGENTS, {})["DTRAIN_HOME"]
    assert "emptyDir" in volume_under(AGENTS, home)  # the host folders: this pod's own
    assert volume_under(AGENTS, "/dev/shm")["emptyDir"]["medium"] == "Memory"
    for job in (CONTROLLER, AGENTS):
        requests = container(job)["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests)
    image = container(CONTROLLER)["image"]
    assert container(AGENTS)["image"] == image  # the same Python environment


def test_the_network_policy_admits_the_jobs_pods_to_each_other_and_no_one_else() -> None:
    spec = POLICY["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert "ports" not in rule  # the store's and gloo's ports are ephemeral
    (peer,) = rule["from"]
    for job in (CONTROLLER, AGENTS):
        assert selects(spec["podSelector"]["matchLabels"], labels(job))
        assert selects(peer["podSelector"]["matchLabels"], labels(job))
    assert not selects(peer["podSelector"]["matchLabels"], FILES["metadata"].get("labels", {}))
