"""The deployment and dashboard files parse and carry what their tools require: KubeRay's
RayCluster fields, `ray up`'s config (checked by Ray's own validator), docker-compose's
services and mounts, Grafana's provisioning, and a dashboard that takes its data source from
a variable."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY, GRAFANA = ROOT / "deploy", ROOT / "grafana"


def config_files() -> list[Path]:
    return sorted(p for d in (DEPLOY, GRAFANA) for p in d.rglob("*")
                  if p.suffix in (".yaml", ".yml", ".json") or p.name.endswith((".yaml.example",)))


def load_all(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def by_kind(path: Path, kind: str) -> dict:
    docs = [d for d in load_all(path) if d.get("kind") == kind]
    assert len(docs) == 1, f"{path.name}: expected one {kind}, found {len(docs)}"
    return docs[0]


def test_every_yaml_and_json_file_parses():
    files = config_files()
    names = {p.relative_to(ROOT).as_posix() for p in files}
    assert {"deploy/prometheus.yml", "deploy/docker-compose.yaml", "deploy/kuberay/raycluster.yaml",
            "deploy/ray-up/cluster.yaml", "grafana/dashboards/pdcluster.json",
            "grafana/provisioning/datasources/prometheus.yaml",
            "grafana/provisioning/dashboards/pdcluster.yaml"} <= names
    for p in files:
        if p.suffix == ".json":
            json.loads(p.read_text())
        else:
            assert load_all(p), f"{p} is empty"


def test_kuberay_raycluster_has_what_kuberay_requires():
    rc = by_kind(DEPLOY / "kuberay" / "raycluster.yaml", "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    assert rc["metadata"]["name"]
    head = rc["spec"]["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert all(isinstance(v, str) for v in head["rayStartParams"].values()), "rayStartParams values are strings"
    head_containers = head["template"]["spec"]["containers"]
    assert head_containers and all(c["image"] and c["name"] for c in head_containers)
    assert 8000 in {p["containerPort"] for p in head_containers[0].get("ports", [])}, "the router's port"
    groups = rc["spec"]["workerGroupSpecs"]
    assert groups
    for g in groups:
        assert g["groupName"]
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert isinstance(g["rayStartParams"], dict)
        containers = g["template"]["spec"]["containers"]
        assert containers and all(c["image"] and c["name"] for c in containers)
        gpus = [c["resources"]["limits"].get("nvidia.com/gpu") for c in containers]
        assert all(gpus) and int(gpus[0]) >= 1, f"worker group {g['groupName']} asks for no nvidia.com/gpu"
        for c in containers:           # Kubernetes: an extended resource's request equals its limit
            limit = c["resources"]["limits"]["nvidia.com/gpu"]
            assert c["resources"].get("requests", {}).get("nvidia.com/gpu", limit) == limit
    # Whatever serves: a RayJob (or a container command) running `pdcluster serve --address auto`.
    texts = [json.dumps(d) for p in (DEPLOY / "kuberay").glob("*.yaml") for d in load_all(p)]
    assert any("pdcluster serve --address auto" in t for t in texts)
    job = by_kind(DEPLOY / "kuberay" / "serve-job.yaml", "RayJob")
    assert job["apiVersion"] == "ray.io/v1"
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == rc["metadata"]["name"]
    assert job["spec"]["entrypoint"].startswith("pdcluster serve --address auto")
    svc = by_kind(DEPLOY / "kuberay" / "raycluster.yaml", "Service")
    assert svc["spec"]["selector"]["ray.io/cluster"] == rc["metadata"]["name"]


def test_kuberay_serve_entrypoint_parses_with_our_cli():
    from cluster.cli import build_parser
    job = by_kind(DEPLOY / "kuberay" / "serve-job.yaml", "RayJob")
    args = build_parser().parse_args(job["spec"]["entrypoint"].split()[1:])
    assert args.command == "serve" and args.address == "auto" and args.host == "0.0.0.0"


def test_kuberay_routers_attach_to_the_serve_jobs_pools():
    from cluster.cli import build_parser
    job = by_kind(DEPLOY / "kuberay" / "serve-job.yaml", "RayJob")
    serve = build_parser().parse_args(job["spec"]["entrypoint"].split()[1:])
    routers = by_kind(DEPLOY / "kuberay" / "serve-job.yaml", "Deployment")
    pod = routers["spec"]["template"]
    assert routers["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (c,) = pod["spec"]["containers"]
    args = build_parser().parse_args(c["command"][1:])
    rc = by_kind(DEPLOY / "kuberay" / "raycluster.yaml", "RayCluster")
    assert args.command == "router" and args.cluster_id == serve.cluster_id
    assert args.address == f"{rc['metadata']['name']}-head-svc:6379"          # KubeRay's head service
    assert args.served_model_name == serve.served_model_name and args.host == "0.0.0.0"
    assert {p["containerPort"] for p in c["ports"]} == {args.port}


def test_ray_up_config_passes_rays_validator():
    from ray.autoscaler._private.util import prepare_config, validate_config
    raw = yaml.safe_load((DEPLOY / "ray-up" / "cluster.yaml").read_text())
    assert raw["cluster_name"] and raw["provider"]["type"]
    types = raw["available_node_types"]
    assert raw["head_node_type"] in types
    for name, t in types.items():
        assert t["node_config"] and "CPU" in t["resources"], name
    assert any(t["resources"].get("GPU", 0) >= 1 for t in types.values()), "no GPU node type"
    validate_config(prepare_config(raw))              # what `ray up` itself runs first
    broken = dict(raw, head_node_type="nope")
    with pytest.raises(ValueError):
        validate_config(prepare_config(broken))
    assert any("ray start --head" in c for c in raw["head_start_ray_commands"])


def test_docker_compose_runs_prometheus_and_grafana_with_provisioning():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert {"prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        assert svc["image"], name
        for volume in svc.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("."):                 # bind mounts of this repository exist
                assert (DEPLOY / source).resolve().exists(), f"{name}: {source} does not exist"
            elif not source.startswith("/"):
                assert source in compose.get("volumes", {}), f"{name}: undeclared volume {source}"
    prom_mounts = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"])
    assert prom_mounts["./prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    graf_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert graf_mounts["../grafana/provisioning"] == "/etc/grafana/provisioning"
    # The dashboard provider's path is where the dashboards are mounted.
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "pdcluster.yaml").read_text())
    assert graf_mounts["../grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    assert services["grafana"]["environment"]["PROMETHEUS_URL"]


def test_prometheus_config_scrapes_the_router():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "pdcluster")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert "127.0.0.1:8000" in targets                 # `pdcluster serve`'s default address
    # Relative to the config file: deploy/targets/ for a local binary, and in the container the
    # folder compose mounts beside the config.
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    mounts = dict(v.rsplit(":", 2)[:2] if v.count(":") == 2 else v.split(":", 1)
                  for v in compose["services"]["prometheus"]["volumes"])
    config_dir = Path(mounts["./prometheus.yml"]).parent
    for f in job["file_sd_configs"][0]["files"]:
        assert not f.startswith("/") and f.startswith("targets/"), f
        assert (DEPLOY / f).parent == DEPLOY / "targets"
        assert Path(mounts["./targets"]) == config_dir / "targets"


def test_grafana_provisioning_files():
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["access"] == "proxy" and source["url"] and source["name"]
    dash = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "pdcluster.yaml").read_text())
    assert dash["apiVersion"] == 1
    (provider,) = dash["providers"]
    assert provider["type"] == "file" and provider["name"] and provider["options"]["path"]


def test_dashboard_takes_its_data_source_from_a_variable():
    d = json.loads((GRAFANA / "dashboards" / "pdcluster.json").read_text())
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 30
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for top in d["panels"] for p in [top, *top.get("panels", [])]]
    for p in panels:
        if p["type"] == "row":
            continue
        assert p.get("targets"), f"panel {p['title']!r} has no query"
        for ref in [p["datasource"]] + [t["datasource"] for t in p["targets"]]:
            assert ref == {"type": "prometheus", "uid": "${datasource}"}, f"panel {p['title']!r}: {ref}"
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    # What the issue asks the dashboard to show, by the metrics its panels read.
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    for metric in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "e2e_request_latency_seconds_bucket", "slo_met_total", "request_success_total",
                   "generation_tokens_total", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits_total",
                   "num_preemptions_total", "kv_transfer_bytes_total", "kv_transfer_seconds_bucket",
                   "kv_transfer_failures_total", "pool_workers", "pool_role_changes_total",
                   "engine_step_duration_seconds_bucket"):
        assert f"pdcluster:{metric}" in exprs, metric
    uids = set(re.findall(r'"uid":\s*"([^"]*)"', json.dumps(d)))
    assert uids <= {d["uid"], "${datasource}", "-- Grafana --"}, f"hard-coded data source uids: {uids}"


def test_dockerfile_copies_what_exists():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG RAY_IMAGE=rayproject/ray:[\w.-]+", text, re.MULTILINE)
    assert re.search(r"^FROM ", text, re.MULTILINE)
    for line in re.findall(r"^COPY (.+)$", text, re.MULTILINE):
        sources = [w for w in line.split() if not w.startswith("--")][:-1]
        for s in sources:
            assert (ROOT / s).exists(), f"COPY {s}: not in the repository"
    ray_pin = re.search(r'"ray(?:\[[\w,]+\])?==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"rayproject/ray:{ray_pin}-" in text, "the base image's ray differs from pyproject.toml's"
    assert (DEPLOY / "Dockerfile.dockerignore").exists()
