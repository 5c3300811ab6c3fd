"""deploy/k8s: every manifest valid against the Kubernetes schemas of a pinned version (kubernetes-validate,
strict: unknown fields are errors), and consistent with the node's config: ports, probe paths (asked of the
real router app), probe budgets, the preStop drain and the grace period, the admin token from the Secret."""
from __future__ import annotations

import asyncio
import copy
import re
from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml

from supervisor.config_load import parse_config
from supervisor.metrics import Metrics
from supervisor.router import build_router
from supervisor.router.routing import RoutingTable
from harness import ROOT

K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSIONS = ("1.34.0", "1.37.0")  # the oldest and newest schemas kubernetes-validate 1.37.0 ships


def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def resources() -> list[dict]:
    docs = []
    for name in kustomization()["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def one(kind: str) -> dict:
    (doc,) = [d for d in resources() if d["kind"] == kind]
    return doc


def container() -> dict:
    (c,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def config_map() -> dict:
    return one("ConfigMap")["data"]


def node_config():
    return parse_config(config_map()["understudy.yaml"], "deploy/k8s/configmap.yaml understudy.yaml")


def env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in container()["env"]}


def test_kustomization_lists_every_manifest_in_the_folder():
    k = kustomization()
    assert k["kind"] == "Kustomization" and k["namespace"] == "understudy"
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(k["resources"]) == on_disk
    assert {d["kind"] for d in resources()} == {"Namespace", "ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_for_the_pinned_kubernetes(version):
    for doc in resources():
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_catches_a_typo():
    bad = copy.deepcopy(one("Deployment"))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # sic
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[0], strict=True)


def test_the_config_is_valid_and_listens_where_the_pod_says():
    cfg = node_config()
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": cfg.router.port, "admin": cfg.admin.port}
    assert cfg.router.host == cfg.admin.host == "0.0.0.0"  # kubelet probes and Prometheus come from outside the pod
    assert cfg.limits.peer_connection_share == 1  # behind the Service's SNAT clients share addresses
    (svc_port,) = one("Service")["spec"]["ports"]
    assert svc_port["targetPort"] == "http" and svc_port["port"] == cfg.router.port
    ann = one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == str(cfg.admin.port)
    assert ann["prometheus.io/path"] == "/metrics"
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus >= cfg.model.tp_size
    assert cfg.resolved_device() == "cuda" and len(cfg.resolved_gpu_ids()) <= gpus


def test_probe_paths_exist_on_the_real_router_and_mean_what_the_pod_needs():
    c = container()
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert all(p["port"] == "http" for p in probes.values())
    assert probes["readinessProbe"]["path"] == probes["startupProbe"]["path"] == "/readyz"
    assert probes["livenessProbe"]["path"] == "/healthz"  # a drained node must not be restarted
    app = build_router(RoutingTable(), Metrics(), hold_timeout_s=1, retry_after_s=1, upstream_timeout_s=1)

    async def get(path: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as client:
            return await client.get(path)
    assert asyncio.run(get(probes["livenessProbe"]["path"])).status_code == 200
    ready = asyncio.run(get(probes["readinessProbe"]["path"]))
    assert ready.status_code == 503 and ready.json()["ready"] is False  # no primary yet: not ready


def test_probe_budgets_fit_the_config():
    cfg, c = node_config(), container()
    start, ready, live = c["startupProbe"], c["readinessProbe"], c["livenessProbe"]
    # a cold start (daemon load, then an engine's canary) finishes before the startupProbe gives up
    assert start["periodSeconds"] * start["failureThreshold"] >= cfg.daemons.load_timeout_s + cfg.failover.startup_timeout_s
    # one probe landing in a failover (milliseconds without a primary) never takes the node out
    assert ready["failureThreshold"] >= 2
    assert ready["periodSeconds"] * (ready["failureThreshold"] - 1) > 1.0
    # the kubelet never restarts a supervisor that is merely busy for a heartbeat or two
    assert live["periodSeconds"] * live["failureThreshold"] >= 3 * cfg.failover.heartbeat_timeout_for(cfg.device)


def test_prestop_drains_then_waits_boundedly_and_the_grace_period_covers_it_all():
    cfg, c, data = node_config(), container(), config_map()
    spec = one("Deployment")["spec"]["template"]["spec"]
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["/bin/sh", "/etc/understudy/prestop-drain.sh"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts["config"] == "/etc/understudy" and volumes["config"]["configMap"]["name"] == one("ConfigMap")["metadata"]["name"]
    assert env()["UNDERSTUDY_CONFIG"] == "/etc/understudy/understudy.yaml" and "understudy.yaml" in data
    script = data["prestop-drain.sh"]
    assert "understudy drain" in script and "understudy status --json" in script
    drain_call = int(re.search(r"timeout (\d+) understudy drain", script).group(1))
    poll_call = int(re.search(r"timeout (\d+) understudy status", script).group(1))
    lb, wait = int(env()["DRAIN_LB_SECONDS"]), int(env()["DRAIN_WAIT_SECONDS"])
    ready = c["readinessProbe"]
    # the load balancer has seen /readyz fail before the wait for in-flight requests starts
    assert lb >= ready["periodSeconds"] * ready["failureThreshold"] + ready["timeoutSeconds"]
    prestop_worst = drain_call + lb + wait + poll_call + 1
    assert spec["terminationGracePeriodSeconds"] > prestop_worst + cfg.failover.drain_timeout_s + cfg.failover.stop_timeout_s


def init_container() -> dict:
    (c,) = one("Deployment")["spec"]["template"]["spec"]["initContainers"]
    return c


def test_admin_token_comes_from_the_secret_into_the_configured_token_file():
    cfg, c, init = node_config(), container(), init_container()
    spec = one("Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    secret = volumes["admin-token"]["secret"]
    # the image runs as a non-root user: the Secret is root:fsGroup, readable by that group, by no one else
    assert secret["secretName"] == "understudy-admin-token" and secret["defaultMode"] == 0o440
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]
    # an init container copies it, 0600 and the pod user's, where the config's token_file is
    assert init["image"] == c["image"]
    command = " ".join(init["command"] + init["args"])
    assert f"umask 077 && cat {mounts['admin-token']}/token > {cfg.resolved_token_file()}" in command
    assert "admin-token" not in {m["name"] for m in c["volumeMounts"]}  # the server never sees the Secret
    assert c["args"] == ["-c", env()["UNDERSTUDY_CONFIG"]] and "command" not in c  # the image's entrypoint
    # the token copy and the runtime dir live in the pod's memory-backed emptyDir
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["run"] == {m["name"]: m["mountPath"] for m in init["volumeMounts"]}["run"]
    assert str(cfg.resolved_token_file()).startswith(mounts["run"] + "/")
    assert str(cfg.resolved_runtime_dir()).startswith(mounts["run"] + "/") and volumes["run"]["emptyDir"]["medium"] == "Memory"
    assert Path(cfg.resolved_cache_dir()) == Path(mounts["cache"])
    assert cfg.model.path.startswith(mounts["models"] + "/")


def test_one_pod_per_gpu_node_and_at_most_one_node_disrupted():
    d = one("Deployment")
    labels = d["spec"]["template"]["metadata"]["labels"]
    (term,) = d["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"] == labels
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    pdb = one("PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["selector"]["matchLabels"] == labels
    assert one("Service")["spec"]["selector"] == labels == d["spec"]["selector"]["matchLabels"]
