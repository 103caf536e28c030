"""The deployment files: docker-compose.yml (+ deploy/compose.cpu.yml), the images, Prometheus and Grafana.

No Docker daemon and no network: the compose file is interpolated as Compose does and validated against the
Compose Specification's JSON schema vendored in deploy/schema (and with `docker compose config` where that CLI
plugin exists); its commands are parsed by the real `ddtree` argument parsers; Prometheus' config and the dashboard's
PromQL go through promtool; and the dashboard's metric names are compared with what the services really export, on
their live /metrics pages (`ddtree serve` on the tiny test models), where a real Prometheus also evaluates every
dashboard query when the `prometheus` binary is installed.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ddtree.cli import build_parser
from runtime.service import ServiceMetrics
from tests.conftest import make_drafter
from tests.gateway_support import make_chat_target
from tests.services import free_ports, interrupt, wait_gateway_ready

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
CPU_OVERRIDE = REPO / "deploy" / "compose.cpu.yml"
ENV_EXAMPLE = REPO / ".env.example"
SCHEMA = REPO / "deploy" / "schema" / "compose-spec.json"
PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "ddtree.json"
HEALTHCHECK_SCRIPT = REPO / "deploy" / "grpc_healthcheck.py"
DDTREE = [sys.executable, "-m", "ddtree.cli"]
DOCKERFILES = {"model": REPO / "deploy" / "Dockerfile.model", "gateway": REPO / "deploy" / "Dockerfile.gateway"}
SERVICES = {"draft", "verify", "gateway", "prometheus", "grafana"}
MODEL_SERVICES = ("draft", "verify")
# Settings the compose file passes to a service before the service has them; each is checked once it exists.
PENDING_SETTINGS = {"DDTREE_VERIFY_TP": "the verifier's --tp (tensor parallelism)"}


# --- Compose: loading and interpolating as `docker compose` does ---------------------------------------------------


class Reset:
    """Compose's `!reset` tag in an override file: removes the attribute from the merged model."""


class Override:
    """Compose's `!override` tag: replaces the attribute instead of merging with it."""

    def __init__(self, value) -> None:
        self.value = value


class ComposeLoader(yaml.SafeLoader):
    pass


def _override(loader: yaml.SafeLoader, node: yaml.Node) -> Override:
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    return Override(loader.construct_scalar(node))


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())
ComposeLoader.add_constructor("!override", _override)
VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))"
)


def load_yaml(path: Path) -> dict:
    with open(path) as f:
        return yaml.load(f, Loader=ComposeLoader)  # noqa: S506 - a SafeLoader with one extra tag


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip().strip("'\"")
    return env


def interpolate(value, env: dict[str, str], used: set[str] | None = None):
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR:+alt} and $$, in every string."""
    if isinstance(value, dict):
        return {k: interpolate(v, env, used) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env, used) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(m: re.Match) -> str:
        if m["escaped"]:
            return "$"
        name = m["braced"] or m["plain"]
        if used is not None:
            used.add(name)
        current, op, arg = env.get(name), m["op"], m["arg"] or ""
        unset_or_empty = not current if op and op.startswith(":") else current is None
        if op in (":-", "-"):
            return arg if unset_or_empty else current
        if op in (":?", "?"):
            if unset_or_empty:
                raise ValueError(f"required variable {name}: {arg}")
            return current
        if op in (":+", "+"):
            return "" if unset_or_empty else arg
        return current or ""

    return VARIABLE.sub(substitute, value)


def merge(base: dict, override: dict) -> dict:
    """Compose's override merge, as far as our override files use it: mappings merge, sequences append, !reset
    removes, !override replaces."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, Reset):
            merged.pop(key, None)
        elif isinstance(value, Override):
            merged[key] = value.value
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        elif isinstance(value, list) and isinstance(merged.get(key), list):
            merged[key] = merged[key] + value
        else:
            merged[key] = value
    return merged


def compose(env: dict[str, str] | None = None, cpu: bool = False) -> dict:
    doc = load_yaml(COMPOSE)
    if cpu:
        doc = merge(doc, load_yaml(CPU_OVERRIDE))
    return interpolate(doc, env or {})


def validate(doc: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)  # the schema says draft-07 (as a URL jsonschema does not know)
    errors = [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(doc)]
    assert not errors, "\n".join(errors)


def model_volumes(service: dict) -> dict[str, str]:
    """Container path -> host path of the /models mounts, all of which must be read-only."""
    mounts = {}
    for volume in service["volumes"]:
        source, target, *mode = volume.split(":")
        if target.startswith("/models/"):
            assert mode == ["ro"], f"{volume}: model directories are mounted read-only"
            mounts[target] = source
    return mounts


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


# --- Compose: validity --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("env", ["defaults", "env-example"])
@pytest.mark.parametrize("cpu", [False, True], ids=["gpu", "cpu-override"])
def test_compose_file_matches_the_compose_spec(env, cpu) -> None:
    validate(compose(read_env_file(ENV_EXAMPLE) if env == "env-example" else {}, cpu=cpu))


def test_readme_compose_snippets_merge_into_a_valid_file() -> None:
    """The docker-compose.override.yml examples of deploy/README.md (LXC device nodes, CDI) are valid overrides."""
    blocks = re.findall(r"```yaml\n(.*?)```", (REPO / "deploy" / "README.md").read_text(), re.DOTALL)
    overrides = [doc for doc in (yaml.load(b, Loader=ComposeLoader) for b in blocks) if "services" in doc]  # noqa: S506
    assert len(overrides) >= 2
    for override in overrides:
        assert set(override["services"]) <= SERVICES
        validate(interpolate(merge(load_yaml(COMPOSE), override), {}))


def test_env_example_documents_every_variable_with_its_default() -> None:
    used: set[str] = set()
    defaults: dict[str, str] = {}
    for path in (COMPOSE, CPU_OVERRIDE):
        interpolate(load_yaml(path), {}, used)
        for m in VARIABLE.finditer(path.read_text()):
            if m["op"] == ":-":
                defaults.setdefault(m["braced"], m["arg"])
    example = read_env_file(ENV_EXAMPLE)
    assert used == set(example), f"only in compose: {used - set(example)}; only in .env.example: {set(example) - used}"
    differing = {k: (defaults[k], example[k]) for k in defaults if defaults[k] != example[k]}
    assert not differing, f"compose default != .env.example value: {differing}"


def test_services_gpus_and_models() -> None:
    doc = compose({"DRAFT_GPU": "3", "VERIFY_GPUS": "4,5,6,7", "VERIFY_TP": "4", "TARGET_DIR": "/srv/big",
                   "DRAFTER_DIR": "/srv/big-dflash"})
    services = doc["services"]
    assert set(services) == SERVICES
    for name, gpus in (("draft", ["3"]), ("verify", ["4,5,6,7"])):
        svc = services[name]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["device_ids"] == gpus
        assert svc.get("ipc") == "host" or "shm_size" in svc, f"{name}: NCCL needs shared memory"
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile.model"
    assert services["draft"]["image"] == services["verify"]["image"], "one model image, two commands"
    assert services["verify"]["environment"]["DDTREE_VERIFY_TP"] == "4"
    assert model_volumes(services["verify"]) == {"/models/target": "/srv/big"}
    assert model_volumes(services["draft"]) == {"/models/target": "/srv/big", "/models/drafter": "/srv/big-dflash"}
    assert model_volumes(services["gateway"]) == {"/models/target": "/srv/big"}  # the tokenizer
    assert services["gateway"]["build"]["dockerfile"] == "deploy/Dockerfile.gateway"
    for name, svc in services.items():
        assert svc.get("restart") in ("always", "unless-stopped"), name
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    # what depends on a service waits for it to be healthy, and that service has a healthcheck
    assert {k: v["condition"] for k, v in services["gateway"]["depends_on"].items()} == {
        "verify": "service_healthy", "draft": "service_healthy"}
    for name, svc in services.items():
        for dependency, spec in svc.get("depends_on", {}).items():
            assert dependency in services and spec["condition"] == "service_healthy", (name, dependency)


def test_defaults_serve_the_bundled_demo_pair() -> None:
    services = compose()["services"]
    mounts = model_volumes(services["draft"])
    for host_path in mounts.values():
        assert (REPO / host_path / "config.json").is_file(), host_path
    assert mounts == {"/models/target": "./models/demo/target", "/models/drafter": "./models/demo/drafter"}
    for name, svc in services.items():  # every bind mount of a repository path exists
        for volume in svc.get("volumes", []):
            if volume.startswith("./"):
                assert (REPO / volume.split(":")[0]).exists(), f"{name}: {volume}"


def test_serve_hands_settings_and_switches_to_the_services() -> None:
    from ddtree.serve import commands

    args = build_parser().parse_args(["serve", "--no-lanes", "--budget", "16", "--drafter", "none"])
    gateway = commands(args)["gateway"]
    assert "--no-lanes" in gateway and gateway[gateway.index("--budget") + 1] == "16"
    parsed = build_parser().parse_args(gateway[gateway.index("gateway"):])  # as the gateway process will
    assert (parsed.lanes, parsed.budget, parsed.drafter) == (False, 16, "none")
    assert "--lanes" in commands(build_parser().parse_args(["serve"]))["gateway"]
    for flags, passed in (([], None), (["--no-compile"], "--no-compile"), (["--compile"], "--compile")):
        services = commands(build_parser().parse_args(["serve", *flags]))
        for name in ("draft", "verify"):
            given = [a for a in services[name] if a.endswith("compile")]
            assert given == ([] if passed is None else [passed])
            parsed = build_parser().parse_args(services[name][services[name].index(name):])
            assert parsed.compile == {None: None, "--compile": True, "--no-compile": False}[passed]
    for flags, window in (([], None), (["--busy-poll-us", "0"], 0), (["--busy-poll-us", "7000"], 7000)):
        for name, cmd in commands(build_parser().parse_args(["serve", *flags])).items():  # all three processes
            assert build_parser().parse_args(cmd[cmd.index(name):]).busy_poll_us == window, name
    # the verifier warms up the rounds of the drafter's taps and the gateway's budget; the drafter drafts a step's
    # trees in one forward as the verifier verifies them
    services = commands(build_parser().parse_args(["serve", "--budget", "24", "--max-batch", "4"]))
    verify = build_parser().parse_args(services["verify"][services["verify"].index("verify"):])
    draft = build_parser().parse_args(services["draft"][services["draft"].index("draft"):])
    assert (verify.warm_up_taps, verify.warm_up_nodes, verify.max_batch, draft.max_batch) == ("1,3,5", 24, 4, 4)
    with pytest.raises(SystemExit, match="--target needs --drafter"):  # never speculation silently off
        commands(build_parser().parse_args(["serve", "--target", "some/target"]))
    # the verifier asks the gateway's drafter for each step's trees and cuts them to its load (--fit-trees)
    gateway = build_parser().parse_args(services["gateway"][services["gateway"].index("gateway"):])
    assert verify.drafter == gateway.drafter and verify.fit_trees
    for flags, fit in (([], True), (["--no-fit-trees"], False), (["--fit-trees"], True)):
        services = commands(build_parser().parse_args(["serve", *flags]))
        assert build_parser().parse_args(services["verify"][services["verify"].index("verify"):]).fit_trees == fit
        assert not [a for a in services["gateway"] if "fit-trees" in a]  # the verifier's option, not the gateway's
    services = commands(build_parser().parse_args(["serve", "--drafter", "none"]))
    verify = build_parser().parse_args(services["verify"][services["verify"].index("verify"):])
    assert verify.warm_up_taps == "" and verify.drafter is None  # no drafter: AR steps only


def test_service_commands_parse_with_the_real_cli() -> None:
    """The compose commands are accepted by the `ddtree` parsers as they are now (flags get renamed, too), and the
    DDTREE_* variables compose sets are settings the services read."""
    from draft_server.config import DraftServerConfig
    from gateway.config import GatewayConfig
    from verify_server.config import VerifyServerConfig

    services = compose(read_env_file(ENV_EXAMPLE))["services"]
    configs = {"draft": DraftServerConfig, "verify": VerifyServerConfig, "gateway": GatewayConfig}
    for name, config in configs.items():
        command = services[name]["command"]
        assert command[0] == name
        build_parser(name).parse_args(command)  # exits (SystemExit) on an unknown flag or a bad value
        fields = {f.upper() for f in config.__dataclass_fields__}
        for variable in services[name].get("environment", {}):
            if variable.startswith("DDTREE_"):
                assert variable.startswith(config.ENV_PREFIX), variable
                setting = variable.removeprefix(config.ENV_PREFIX)
                if setting not in fields and variable in PENDING_SETTINGS:
                    continue  # not a setting of the service yet; read as soon as it is one
                assert setting in fields, f"{name} has no setting {variable}"


def test_ports_agree_between_services_healthchecks_and_prometheus() -> None:
    services = compose()["services"]
    draft, verify, gateway = (services[n]["command"] for n in ("draft", "verify", "gateway"))
    assert flag(gateway, "--drafter") == f"draft:{flag(draft, '--port')}"
    assert flag(gateway, "--verifier") == f"verify:{flag(verify, '--port')}"
    assert flag(verify, "--drafter") == f"draft:{flag(draft, '--port')}"  # each step's trees, asked by the verifier
    for name, command in (("draft", draft), ("verify", verify)):
        ports = {flag(command, "--port"), flag(command, "--lane-port"), flag(command, "--metrics-port")}
        assert ports <= set(services[name]["expose"])
        check = services[name]["healthcheck"]["test"]
        assert check[:3] == ["CMD", "python", "/app/grpc_healthcheck.py"]
        assert check[3] == f"127.0.0.1:{flag(command, '--port')}"
    assert services["draft"]["healthcheck"]["test"][4] == "ddtree.v1.Drafter"
    assert services["verify"]["healthcheck"]["test"][4] == "ddtree.v1.Verifier"
    assert f"127.0.0.1:{flag(gateway, '--port')}/health" in services["gateway"]["healthcheck"]["test"][-1]
    assert services["gateway"]["ports"] == [f"0.0.0.0:8000:{flag(gateway, '--port')}"]
    targets = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
               for job in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]}
    assert sorted(targets.values()) == sorted([[f"gateway:{flag(gateway, '--port')}"],
                                               [f"draft:{flag(draft, '--metrics-port')}"],
                                               [f"verify:{flag(verify, '--metrics-port')}"]])


def test_cpu_override_drops_the_gpu_reservations() -> None:
    services = compose(cpu=True)["services"]
    for name in MODEL_SERVICES:
        assert "deploy" not in services[name]
        assert services[name]["environment"][f"DDTREE_{name.upper()}_DEVICE"] == "cpu"
        assert compose()["services"][name]["environment"][f"DDTREE_{name.upper()}_DEVICE"] == "cuda"


def _docker_compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _docker_compose_available(), reason="no `docker compose` CLI plugin")
@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "deploy/compose.cpu.yml"]])
def test_docker_compose_config(files) -> None:
    """`docker compose config` parses, interpolates and validates without a daemon."""
    argv = ["docker", "compose", "--env-file", ".env.example", "--project-directory", "."]
    for f in files:
        argv += ["-f", f]
    result = subprocess.run([*argv, "config", "-q"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --- Images ---------------------------------------------------------------------------------------------------------


def dockerignore_allows(patterns: list[str], path: str) -> bool:
    """Docker's .dockerignore semantics, enough for ours: last matching pattern wins, `!` re-includes, a pattern
    matching a directory covers everything in it, `*` stays within one path element, `**` spans several."""

    def regex(pattern: str) -> re.Pattern:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out + "(?:/.*)?")

    allowed = True
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.removeprefix("!").strip("/")
        if regex(pattern).fullmatch(path):
            allowed = negate
    return allowed


def dockerignore(dockerfile: Path) -> list[str]:
    lines = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_images_get_every_package_and_nothing_heavy(image) -> None:
    dockerfile = DOCKERFILES[image]
    text = dockerfile.read_text()
    patterns = dockerignore(dockerfile)
    copies = re.findall(r"^COPY\s+(\S+)\s+(\S+)", text, re.MULTILINE)
    sources = {src for src, _ in copies}
    for src in sources:
        assert (REPO / src).exists(), src
        assert dockerignore_allows(patterns, src), f"{src} is COPY'd but excluded by the .dockerignore"
    includes = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for package in {p.split(".")[0].rstrip("*") for p in includes}:
        assert package in sources, f"{image} image lacks package {package}"
        for module in (REPO / package).rglob("*.py"):
            rel = module.relative_to(REPO).as_posix()
            assert "__pycache__" in rel or dockerignore_allows(patterns, rel), rel
    assert "pyproject.toml" in sources
    for heavy in (".venv/bin/python", ".git/HEAD", "models/demo/target/config.json", "bench/prompts.jsonl",
                  "tests/conftest.py", "ddtree/__pycache__/cli.cpython-311.pyc"):
        assert not dockerignore_allows(patterns, heavy), f"{heavy} would be sent to the {image} build"
    assert re.search(r'^ENTRYPOINT \["ddtree"\]', text, re.MULTILINE)
    if image == "model":  # the compose healthcheck runs this path
        assert ("deploy/grpc_healthcheck.py", "/app/grpc_healthcheck.py") in copies


# --- Prometheus and Grafana -------------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_prometheus_config_passes_promtool() -> None:
    result = subprocess.run(["promtool", "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_matches_compose_and_prometheus() -> None:
    grafana = compose()["services"]["grafana"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    (datasource,) = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())["datasources"]
    (provider,) = yaml.safe_load((GRAFANA / "provisioning/dashboards/ddtree.yml").read_text())["providers"]
    prometheus = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    assert datasource["jsonData"]["timeInterval"] == prometheus["global"]["scrape_interval"]
    (variable,) = json.loads(DASHBOARD.read_text())["templating"]["list"]
    assert variable["type"] == "datasource" and variable["current"]["value"] == datasource["uid"]


def dashboard_panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard_panels() for t in p["targets"]]


def test_dashboard_is_generated_and_well_formed() -> None:
    sys.path.insert(0, str(GRAFANA))
    try:
        import make_dashboard
    finally:
        sys.path.remove(str(GRAFANA))
    assert DASHBOARD.read_text() == make_dashboard.render(), "run: python deploy/grafana/make_dashboard.py"
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["title"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert {"Overview", "Requests", "Latency", "Speculation", "Round time", "Sessions", "Memory"} <= set(rows)
    for panel in dashboard_panels():
        assert panel["title"] and panel["description"] and panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"]), panel["title"]
    exprs = " ".join(dashboard_exprs())
    assert "histogram_quantile(0.99, sum by (le) (rate(ddtree_time_to_first_token_seconds_bucket" in exprs
    assert ("1 + sum(rate(ddtree_spec_accepted_tokens_total[$__rate_interval])) / "
            "sum(rate(ddtree_spec_drafts_total[$__rate_interval]))") in exprs


def grafana_to_promql(expr: str, rate_interval: str = "1m", time_range: str = "5m") -> str:
    return expr.replace("$__rate_interval", rate_interval).replace("$__range", time_range)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_dashboard_promql_parses(tmp_path) -> None:
    """Every query as a recording rule: `promtool check rules` parses the PromQL."""
    rules = [{"record": f"ddtree:dashboard_query:{i}", "expr": grafana_to_promql(expr)}
             for i, expr in enumerate(dashboard_exprs())]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --- The dashboard against the services' live metrics -------------------------------------------------------------

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "untyped": ("",), "info": ("_info",)}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions, keywords, label names (in
    matchers and by/without/on/ignoring lists), ranges, strings, numbers or Grafana variables."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\$\{[^}]*\}|\$\w+", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.:])([A-Za-z_:][A-Za-z0-9_:]*)\b(?!\s*\()", e):
        if m.group(1).lower() not in PROMQL_WORDS:
            names.add(m.group(1))
    return names


def promql_label_names(expr: str) -> set[str]:
    """Label names in matchers and in by/without lists."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels = {m.group(1) for sel in re.findall(r"\{([^}]*)\}", e) for m in re.finditer(r"(\w+)\s*(?:=~|!~|!=|=)", sel)}
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", e):
        labels |= {label.strip() for label in group.split(",") if label.strip()}
    return labels


def test_promql_parsing_helpers() -> None:
    expr = ('histogram_quantile(0.9, sum by (le, phase) (rate(ddtree_round_phase_seconds_bucket[$__rate_interval])))'
            ' / clamp_min(sum(rate(ddtree_requests_total{finish_reason="error", x=~"a|b"}[5m])), 1e-9) + '
            'sum by (depth) (increase(a_total[$__range])) / scalar(sum(b_total offset 1m)) and on(job) up')
    assert promql_metric_names(expr) == {"ddtree_round_phase_seconds_bucket", "ddtree_requests_total", "a_total",
                                         "b_total", "up"}
    assert promql_label_names(expr) == {"le", "phase", "finish_reason", "x", "depth"}


def exported(text: str) -> dict[str, dict]:
    """Sample name -> {"family", "type", "labels" (seen on its samples)} for one /metrics page; histograms and
    counters are listed under every sample name they can have, with or without samples yet."""
    names: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        labels = {label for sample in family.samples for label in sample.labels} - {"le", "quantile"}
        for suffix in SUFFIXES.get(family.type, ("",)):
            names[family.name + suffix] = {"family": family.name, "type": family.type, "labels": labels,
                                           "sampled": bool(family.samples)}
    return names


def gpu_only_metric_names(prefix: str) -> set[str]:
    """What a model service exports on CUDA only (GPU memory gauges), from the services' own metrics code: the
    same ServiceMetrics built for a cuda device, minus what it exports on CPU."""
    by_device = {}
    real = torch.cuda.memory_allocated, torch.cuda.memory_reserved
    torch.cuda.memory_allocated = torch.cuda.memory_reserved = lambda device=None: 0
    try:
        for device in ("cpu", "cuda"):
            metrics = ServiceMetrics(prefix, "cache_bytes", "test", torch.device(device))
            by_device[device] = set(exported(generate_latest(metrics.registry).decode()))
    finally:
        torch.cuda.memory_allocated, torch.cuda.memory_reserved = real
    return by_device["cuda"] - by_device["cpu"]


def http_get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@dataclass
class Live:
    gateway: str  # http://127.0.0.1:PORT
    draft: str  # gRPC HOST:PORT
    verify: str
    metrics: dict[str, str]  # service -> metrics URL
    pages: dict[str, str]  # service -> /metrics text after traffic


def start(name: str, cmd: list[str], logs: Path) -> subprocess.Popen:
    with open(logs / f"{name}.log", "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """`ddtree serve` on the tiny chat target and a tiny drafter (as tests/services/test_e2e.py starts it), after one
    speculative and one autoregressive chat completion, so that round, RPC and forward metrics have samples."""
    models = tmp_path_factory.mktemp("deploy_models")
    target, drafter = make_chat_target(models / "target"), make_drafter(models / "drafter")
    http, draft, verify, draft_metrics, verify_metrics = free_ports(5)
    logs = tmp_path_factory.mktemp("deploy_logs")
    cmd = [*DDTREE, "serve", "--target", str(target), "--drafter", str(drafter), "--device", "cpu",
           "--dtype", "float32", "--port", str(http), "--draft-port", str(draft), "--verify-port", str(verify),
           "--draft-metrics-port", str(draft_metrics), "--verify-metrics-port", str(verify_metrics),
           "--health-interval", "0.5", "--served-model-name", "tiny"]
    serve = start("serve", cmd, logs)
    gateway = f"http://127.0.0.1:{http}"
    try:
        wait_gateway_ready(gateway, serve, (logs / "serve.log").read_text)
        for mode in ("ddtree", "off"):
            reply = httpx.post(f"{gateway}/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 24,
                "temperature": 0, "speculation": {"mode": mode, "budget": 8}})
            assert reply.status_code == 200, reply.text
        metrics = {"gateway": f"{gateway}/metrics", "draft": f"http://127.0.0.1:{draft_metrics}/metrics",
                   "verify": f"http://127.0.0.1:{verify_metrics}/metrics"}
        pages = {name: httpx.get(url, timeout=10).text for name, url in metrics.items()}
        yield Live(gateway, f"127.0.0.1:{draft}", f"127.0.0.1:{verify}", metrics, pages)
    finally:
        code = interrupt(serve)
    assert code == 0, (logs / "serve.log").read_text()  # stopped cleanly after the tests


def test_dashboard_queries_only_metrics_the_services_export(live) -> None:
    names: dict[str, dict] = {}
    for page in live.pages.values():
        names.update(exported(page))
    prefixes = {n.removesuffix("_active_sessions") for n in names if n.endswith("_active_sessions")}
    assert prefixes == {"ddtree_draft", "ddtree_verify"}, "the model services' metric prefixes changed"
    gpu_only = set().union(*(gpu_only_metric_names(p) for p in prefixes))
    assert gpu_only, "ServiceMetrics no longer exports GPU memory on CUDA"
    used: dict[str, set[str]] = {}
    for panel in dashboard_panels():
        for t in panel["targets"]:
            for name in promql_metric_names(t["expr"]):
                used.setdefault(name, set()).add(panel["title"])
    unknown = {name: sorted(panels) for name, panels in used.items() if name not in names and name not in gpu_only}
    assert not unknown, f"the dashboard queries metrics no service exports: {unknown}"
    # label names: each must be carried by the samples of some metric the same query reads (when it has samples)
    for expr in dashboard_exprs():
        read = [names[n] for n in promql_metric_names(expr) if n in names]
        if not read or not all(m["sampled"] for m in read):
            continue  # no samples yet (labelled children appear on first use): nothing to compare against
        carried = set().union(*(m["labels"] for m in read)) | {"le", "instance", "job"}
        assert promql_label_names(expr) <= carried, f"{expr}: labels {promql_label_names(expr) - carried}"


def test_compose_healthchecks_pass_against_live_services(live) -> None:
    services = compose()["services"]
    for name, address in (("draft", live.draft), ("verify", live.verify)):
        service = services[name]["healthcheck"]["test"][4]  # ["CMD", "python", script, address, service]
        argv = [sys.executable, str(HEALTHCHECK_SCRIPT), address, service]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0 and "SERVING" in result.stdout, result.stdout + result.stderr
    (closed,) = free_ports(1)
    result = subprocess.run([sys.executable, str(HEALTHCHECK_SCRIPT), f"127.0.0.1:{closed}", "ddtree.v1.Verifier",
                             "--timeout", "2"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr
    check = services["gateway"]["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-c"]
    code = check[3].replace("http://127.0.0.1:8000", live.gateway)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (Debian package prometheus)")
def test_dashboard_queries_evaluate_on_prometheus(live, tmp_path) -> None:
    """A real Prometheus scrapes the live services (prometheus.yml's jobs, pointed at loopback) and evaluates every
    dashboard query without error."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    addresses = {name: url.removeprefix("http://").removesuffix("/metrics") for name, url in live.metrics.items()}
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            static["targets"] = [addresses[t.split(":")[0]] for t in static["targets"]]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    (port,) = free_ports(1)
    api = f"http://127.0.0.1:{port}/api/v1"
    with open(tmp_path / "prometheus.log", "w") as log:
        process = subprocess.Popen(
            ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # every target up, and scraped a few times so rate() has samples
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            try:
                up = json.loads(http_get(f"{api}/query?query=count_over_time(up[1m])", 2)[1])["data"]["result"]
                if len(up) == 3 and all(float(r["value"][1]) >= 3 for r in up):
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        failures, empty = [], []
        for expr in dashboard_exprs():
            query = urllib.parse.urlencode({"query": grafana_to_promql(expr)})
            status, body = http_get(f"{api}/query?{query}")
            reply = json.loads(body)
            if status != 200 or reply["status"] != "success":
                failures.append(f"{expr}: {reply.get('error')}")
            elif not reply["data"]["result"]:
                empty.append(expr)
        assert not failures, "\n".join(failures)
        for name in ("ddtree_requests_running", "ddtree_draft_active_sessions", "ddtree_verify_kv_cache_bytes"):
            assert f"sum({name})" not in empty and f"sum by (instance) ({name})" not in empty, name
    finally:
        interrupt(process)


def test_the_model_services_share_one_gpu_within_the_stacks_share() -> None:
    """By default the drafter and the verifier share GPU 0: their memory shares add up to no more than one stack's
    (each refuses its start where the device has not its share free), and on the CPU override they hold none (a share
    is a CUDA device's: the services would refuse it)."""
    from runtime.memory import DEFAULT_UTILIZATION

    gpu, cpu = compose(read_env_file(ENV_EXAMPLE))["services"], compose(cpu=True)["services"]
    shares = [float(gpu[name]["environment"][f"DDTREE_{name.upper()}_GPU_MEMORY_UTILIZATION"])
              for name in ("draft", "verify")]
    assert gpu["draft"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == \
        gpu["verify"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    assert all(share > 0 for share in shares) and sum(shares) <= DEFAULT_UTILIZATION
    assert all(cpu[name]["environment"][f"DDTREE_{name.upper()}_GPU_MEMORY_UTILIZATION"] == ""
               for name in ("draft", "verify"))
