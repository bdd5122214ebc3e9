"""The deploy files: every process gets the environment the README documents; systemd units are hardened;
a refused beat writes nothing and exits 78, and its schedule file is in the state directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the dev extra

from core.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def _needs() -> dict[str, list[set[str]]]:
    """docs/deploy.md: per process, the variables it needs; ``A` or `B`` is one need met by either."""
    page = (ROOT / "docs" / "deploy.md").read_text()
    section = page.split("What each process reads", 1)[1].split("\n\n", 2)[1]
    needs: dict[str, list[set[str]]] = {}
    for row in section.splitlines()[2:]:
        _, process, wanted, _ = row.split("|")
        alternatives = re.sub(r"\([^)]*\)", "", wanted).split(",")  # an aside in brackets names no need
        needs[_process(process.strip(" `"))] = [set(re.findall(r"POOL_[A-Z_]+", a)) for a in alternatives]
    return needs


def _process(command: str) -> str:
    words = command.replace('"', " ").split()
    for name in ("init", "serve", "worker", "beat"):
        if name in words and ({"poolctl", "celery"} & {w.rsplit("/", 1)[-1] for w in words}):
            return name
    return ""


def _dotenv(path: Path) -> set[str]:
    lines = [line.split("=", 1)[0].strip() for line in path.read_text().splitlines()]
    return {name for name in lines if name and not name.startswith("#")}


def _kubernetes() -> list[tuple[str, set[str]]]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "poolkeeper.yaml").read_text()) if d]
    maps = {d["metadata"]["name"]: set(d.get("data", {})) for d in docs if d["kind"] == "ConfigMap"}
    found = []
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        spec = d["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            env = {e["name"] for e in c.get("env", [])}
            for source in c.get("envFrom", []):
                env |= maps.get(source.get("configMapRef", {}).get("name"), set())
            found.append((_process(" ".join(c["command"])), env))
    return found


def _compose(name: str) -> list[tuple[str, set[str]]]:
    services = yaml.safe_load((DEPLOY / name).read_text())["services"]
    found = []
    for service in services.values():
        command = service.get("command", [])
        env = set(service.get("environment", {}))
        for env_file in service.get("env_file", []):
            env |= _dotenv(DEPLOY / (env_file + ".example" if env_file == ".env" else env_file))
        found.append((_process(" ".join(command) if isinstance(command, list) else command), env))
    return found


def _systemd() -> list[tuple[str, set[str]]]:
    found = []
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        text = unit.read_text()
        env = set(re.findall(r"^Environment=(POOL_[A-Z_]+)=", text, re.M))
        if re.search(r"^EnvironmentFile=/etc/poolkeeper/env$", text, re.M):
            env |= _dotenv(DEPLOY / "systemd" / "env.example")
        for command in re.findall(r"^ExecStart(?:Pre)?=(.*)$", text, re.M):
            found.append((_process(command), env))
    return found


@pytest.mark.parametrize(
    "manifest",
    ["k8s/poolkeeper.yaml", "docker-compose.yml", "docker-compose.sqlite.yml", "systemd/*.service"],
)
def test_each_manifest_runs_every_process_with_the_environment_the_readme_documents(manifest: str) -> None:
    needs = _needs()
    assert set(needs) == {"init", "worker", "beat", "serve"}
    found = {
        "k8s/poolkeeper.yaml": _kubernetes,
        "docker-compose.yml": lambda: _compose("docker-compose.yml"),
        "docker-compose.sqlite.yml": lambda: _compose("docker-compose.sqlite.yml"),
        "systemd/*.service": _systemd,
    }[manifest]()
    assert {p for p, _ in found if p} == set(needs), f"{manifest} runs every process the README names"
    missing = [
        (process, sorted(need))
        for process, env in found
        if process
        for need in needs[process]
        if not need & env
    ]
    assert missing == [], f"{manifest}: processes without what the README says they need"


def test_every_systemd_unit_has_the_hardening_its_readme_promises() -> None:
    hardening = ["NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes"]
    hardening += ["PrivateDevices=yes", "CapabilityBoundingSet=", "User=poolkeeper", "Group=poolkeeper"]
    readme = (DEPLOY / "systemd" / "README.md").read_text()
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        lines = unit.read_text().splitlines()
        assert [h for h in hardening if h not in lines] == [], unit.name
        assert f"`{unit.name}`" in readme, f"{unit.name} is in deploy/systemd/README.md"


def test_a_refused_beat_writes_no_schedule_file_and_exits_78(tmp_path: Path) -> None:
    cwd, state = tmp_path / "cwd", tmp_path / "state"
    cwd.mkdir()
    env = {
        **os.environ,
        "POOL_DATABASE_URL": f"sqlite:///{tmp_path}/never-initialised.db",
        "POOL_BOARD_URL": f"sqlite:///{tmp_path}/board.db",
        "POOL_REDIS_URL": "redis://127.0.0.1:1/0",
        "XDG_STATE_HOME": str(state),
        "PYTHONPATH": str(ROOT),
    }
    argv = [sys.executable, "-m", "celery", "-A", "tasks", "beat", "-l", "info"]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 78, done.stderr
    assert "run `poolctl init`" in done.stderr
    assert sorted(p.name for p in cwd.iterdir()) == []
    assert not state.exists() or not any(state.rglob("*")), "nothing in the state directory either"
    assert "exit 78 (as `poolctl` does: run `poolctl init`)" in (ROOT / "docs" / "deploy.md").read_text()


def test_beats_default_schedule_file_is_in_the_state_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks import celery

    monkeypatch.setenv("XDG_STATE_HOME", "/var/lib/x")
    assert (
        celery.schedule_file(Settings(namespace="blue")) == "/var/lib/x/poolkeeper/blue-celerybeat-schedule"
    )


# --- autoscaling: the KEDA ScaledObject over the pool workers' StatefulSet --------------------

KEDA = DEPLOY / "k8s" / "keda" / "scaledobject.yaml"
KEDA_SCHEMA = DEPLOY / "k8s" / "schemas" / "keda-scaledobject-v1alpha1.json"


def _check_jsonschema(*files: Path) -> subprocess.CompletedProcess[str]:
    tool = Path(sys.executable).parent / "check-jsonschema"
    return subprocess.run(
        [str(tool), "--schemafile", str(KEDA_SCHEMA), *map(str, files)], capture_output=True, text=True
    )


def test_the_scaled_object_scales_the_pool_workers_between_a_floor_and_pool_size() -> None:
    scaled = yaml.safe_load(KEDA.read_text())
    [config] = [
        d
        for d in yaml.safe_load_all((DEPLOY / "k8s" / "poolkeeper.yaml").read_text())
        if d["kind"] == "ConfigMap"
    ]
    [workers] = list(yaml.safe_load_all((DEPLOY / "k8s" / "pool-workers.yaml").read_text()))
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert (target["kind"], target["name"]) == (workers["kind"], workers["metadata"]["name"])
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] == int(config["data"]["POOL_SIZE"])
    [trigger] = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "1"
    # A pod serves the ordinal its name ends with, with that ordinal's token, not the server secret.
    [container] = workers["spec"]["template"]["spec"]["containers"]
    script = container["command"][-1]
    assert 'n="${HOSTNAME##*-}"' in script and '--ordinal "$n"' in script and "/o$n" in script
    assert "POOL_SERVER_SECRET" not in json.dumps(workers)


def test_the_scaled_object_passes_keda_s_schema_and_a_typo_does_not(tmp_path: Path) -> None:
    done = _check_jsonschema(KEDA)
    assert done.returncode == 0, done.stdout + done.stderr
    scaled = yaml.safe_load(KEDA.read_text())
    typos: dict[str, Callable[[dict[str, Any]], object]] = {
        "a misspelt field": lambda d: d["spec"].update(maxReplicas=3),
        "a string count": lambda d: d["spec"].update(minReplicaCount="1"),
        "no target": lambda d: d["spec"].pop("scaleTargetRef"),
        "another kind": lambda d: d.update(kind="ScaledJob"),
    }
    for what, spoil in typos.items():
        broken = json.loads(json.dumps(scaled))
        spoil(broken)
        path = tmp_path / "broken.yaml"
        path.write_text(yaml.safe_dump(broken))
        assert _check_jsonschema(path).returncode != 0, f"{what} passes the schema"


def test_the_vendored_schema_is_keda_s_crd_as_ci_keda_schema_writes_it(tmp_path: Path) -> None:
    """The script's strictness: every object that lists its fields refuses others."""
    schema = json.loads(KEDA_SCHEMA.read_text())
    assert "KEDA v2.20.1" in schema["$comment"]
    spec = schema["properties"]["spec"]
    assert spec["additionalProperties"] is False and "scaleTargetRef" in spec["required"]
    assert spec["properties"]["triggers"]["items"]["properties"]["metadata"]["additionalProperties"] == {
        "type": "string"
    }
