"""The deployment and dashboard files parse and carry what their tools require: KubeRay's
RayCluster fields, `ray up`'s config (checked by Ray's own validator), docker-compose's
services and mounts, Grafana's provisioning, and a dashboard that takes its data source from
a variable. And they keep the trust boundaries: Ray's token authentication on, the dashboard
on loopback or behind the NetworkPolicy, which admits only the cluster's pods to Ray's ports,
non-root pods, the routers' API key from a Secret or a file and never a command line, grace
periods above the drain, monitoring on loopback without default credentials, an image user
without sudo. Pure: files are parsed, nothing is started (a shell runs a guard or two)."""
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


# -- trust boundaries (issue 26): who may reach Ray, the routers and the monitoring ----------

KUBERAY = DEPLOY / "kuberay"
RAY_UP = DEPLOY / "ray-up" / "cluster.yaml"
NAME_LABEL = {"app.kubernetes.io/name": "pdcluster"}
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
RAY_PORTS = (6379, 8265, 10001, 8080, 52365, 10002, 19999)    # GCS, dashboard, client, metrics, agent, workers


def kuberay_docs() -> list[dict]:
    return [d for p in sorted(KUBERAY.glob("*.yaml")) for d in load_all(p)]


def kuberay_pods() -> dict[str, dict]:
    """Every pod template the KubeRay files make, by a name for messages."""
    pods = {}
    for d in kuberay_docs():
        name = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] == "RayCluster":
            pods[f"{name} head"] = d["spec"]["headGroupSpec"]["template"]
            for g in d["spec"]["workerGroupSpecs"]:
                pods[f"{name} group {g['groupName']}"] = g["template"]
        elif d["kind"] == "RayJob":
            # Without a template KubeRay makes a submitter pod with no securityContext or labels.
            assert "submitterPodTemplate" in d["spec"], f"{name}: no submitterPodTemplate"
            pods[f"{name} submitter"] = d["spec"]["submitterPodTemplate"]
        elif "template" in d.get("spec", {}):
            pods[name] = d["spec"]["template"]
    return pods


def containers(pod: dict) -> list[dict]:
    return pod["spec"].get("initContainers", []) + pod["spec"]["containers"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def secret_ref(container: dict, var: str) -> tuple[str, str] | None:
    """(Secret name, key) when `var` comes from a Secret, else None."""
    ref = env_of(container).get(var, {}).get("valueFrom", {}).get("secretKeyRef")
    return (ref["name"], ref["key"]) if ref else None


def serve_args():
    from cluster.cli import build_parser
    job = by_kind(KUBERAY / "serve-job.yaml", "RayJob")
    return build_parser().parse_args(job["spec"]["entrypoint"].split()[1:])


def drain_timeout_s(args) -> float:
    from router.config import RouterConfig
    return getattr(args, "drain_timeout_s", RouterConfig().drain_timeout_s)   # not given: the default


def test_kuberay_turns_on_ray_token_auth_everywhere():
    rc = by_kind(KUBERAY / "raycluster.yaml", "RayCluster")
    auth = rc["spec"]["authOptions"]
    assert auth["mode"] == "token"
    secret = auth["secretName"]             # the operator's dashboard client reads the token here
    # KubeRay refuses token mode below Ray 2.52.0 (its RayCluster validation).
    assert tuple(map(int, rc["spec"]["rayVersion"].split("."))) >= (2, 52, 0)
    # Every Ray container, and every driver pod that joins the cluster, carries the mode and the
    # token from that Secret's `auth_token` (the key KubeRay reads), never a literal token.
    ray_pods = {k: v for k, v in kuberay_pods().items() if "submitter" not in k}
    assert len(ray_pods) >= 3
    for where, pod in ray_pods.items():
        for c in pod["spec"]["containers"]:
            env = env_of(c)
            assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", f"{where} {c['name']}"
            assert secret_ref(c, "RAY_AUTH_TOKEN") == (secret, "auth_token"), f"{where} {c['name']}"
    for d in kuberay_docs():
        text = json.dumps(d)
        assert '"RAY_AUTH_MODE", "value": "disabled"' not in text
        assert '"mode": "disabled"' not in text


def test_ray_up_turns_on_ray_token_auth_on_every_node():
    raw = yaml.safe_load(RAY_UP.read_text())
    options = " ".join(raw["docker"]["run_options"] + raw["docker"].get("head_run_options", [])
                       + raw["docker"].get("worker_run_options", []))
    env = dict(re.findall(r"(?:^|\s)-e\s+(\w+)=(\S+)", options))
    assert env.get("RAY_AUTH_MODE") == "token"
    # The token is a file the launcher copies to every node (file_mounts, bind-mounted at the
    # same path in the container, whose home is /home/ray): not a value in this file.
    token_path = env["RAY_AUTH_TOKEN_PATH"]
    mounts = [m.replace("~", "/home/ray", 1) for m in raw["file_mounts"]]
    assert any(token_path.startswith(m.rstrip("/") + "/") for m in mounts), (token_path, mounts)
    assert "RAY_AUTH_TOKEN=" not in RAY_UP.read_text()
    commands = " ".join(c for k, v in raw.items() if k.endswith("_commands") for c in v)
    assert "RAY_AUTH_MODE=disabled" not in commands


def test_ray_dashboard_listens_on_every_interface_only_where_it_must():
    # `ray up`: the container shares the VM's network, so 0.0.0.0 would be every address of the
    # VM; `ray dashboard cluster.yaml` reaches loopback over SSH.
    raw = yaml.safe_load(RAY_UP.read_text())
    (start,) = [c for c in raw["head_start_ray_commands"] if "ray start --head" in c]
    hosts = re.findall(r"--dashboard-host[= ](\S+)", start)
    assert hosts and set(hosts) <= LOOPBACK, start
    # KubeRay: set, not left to KubeRay's default; the operator reaches the dashboard through the
    # head Service, so it may listen on the pod's address, but then only with the token and
    # with the NetworkPolicy admitting no one from outside the cluster's pods and the operator.
    rc = by_kind(KUBERAY / "raycluster.yaml", "RayCluster")
    host = rc["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"]
    if host not in LOOPBACK:
        assert rc["spec"]["authOptions"]["mode"] == "token"
        head = kuberay_pods()["RayCluster/pdcluster head"]
        for peer in (OUTSIDER, NEIGHBOUR, PROMETHEUS):
            assert not admitted(head, peer, 8265), f"{peer['what']} reaches the dashboard"


# A NetworkPolicy's ingress rules, evaluated for a few peers (Kubernetes' semantics: a pod that
# some policy selects takes only what the union of their rules admits; `from` absent admits
# every peer, `ports` absent every port; a podSelector alone means this namespace's pods).
NAMESPACE = "serving"
CLUSTER_POD = {"what": "a pod of the cluster", "ns": NAMESPACE, "ns_labels": {}, "labels": dict(NAME_LABEL)}
NEIGHBOUR = {"what": "another pod of the namespace", "ns": NAMESPACE, "ns_labels": {}, "labels": {"app": "other"}}
OUTSIDER = {"what": "a pod of another namespace", "ns": "elsewhere", "ns_labels": {}, "labels": {}}
OPERATOR = {"what": "the KubeRay operator", "ns": "kuberay-system", "ns_labels": {},
            "labels": {"app.kubernetes.io/name": "kuberay-operator"}}
PROMETHEUS = {"what": "Prometheus", "ns": "monitoring", "ns_labels": {}, "labels": {"app.kubernetes.io/name": "prometheus"}}


def selects(selector: dict, labels: dict) -> bool:
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def peer_matches(peer_rule: dict, peer: dict) -> bool:
    assert "ipBlock" not in peer_rule, "an ipBlock admits addresses, not pods: no pod selector to check"
    ns_labels = {"kubernetes.io/metadata.name": peer["ns"], **peer["ns_labels"]}
    if "namespaceSelector" in peer_rule:
        if not selects(peer_rule["namespaceSelector"], ns_labels):
            return False
    elif peer["ns"] != NAMESPACE:
        return False
    return selects(peer_rule.get("podSelector", {}), peer["labels"])


def network_policies() -> list[dict]:
    return [d for d in kuberay_docs() if d["kind"] == "NetworkPolicy"]


def admitted(pod: dict, peer: dict, port: int) -> bool:
    labels = pod["metadata"]["labels"]
    policies = [p for p in network_policies() if selects(p["spec"]["podSelector"], labels)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    assert policies, f"no NetworkPolicy selects the pod labelled {labels}: it admits everyone"
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            ports = [q["port"] for q in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            if "from" not in rule or any(peer_matches(f, peer) for f in rule["from"]):
                return True
    return False


def test_network_policy_admits_only_the_clusters_pods_and_the_router_port():
    assert network_policies(), "deploy/kuberay has no NetworkPolicy"
    for p in network_policies():
        assert p["apiVersion"] == "networking.k8s.io/v1"
        # Only the cluster's pods: a policy selecting others would restrict what is not ours.
        assert p["spec"]["podSelector"].get("matchLabels", {}).items() >= NAME_LABEL.items(), p["metadata"]["name"]
    pods = kuberay_pods()
    routers = {k for k, pod in pods.items()
               if pod["metadata"]["labels"].get("app.kubernetes.io/component") in ("head", "router")}
    assert len(routers) == 2, routers
    for where, pod in pods.items():
        assert pod["metadata"]["labels"].items() >= NAME_LABEL.items(), f"{where}: not labelled as the cluster's"
        for port in RAY_PORTS + (8000,):
            assert admitted(pod, CLUSTER_POD, port), f"{where}: the cluster's own pods are refused port {port}"
            for peer in (NEIGHBOUR, OUTSIDER):
                expected = port == 8000 and where in routers
                assert admitted(pod, peer, port) == expected, f"{where} port {port}: {peer['what']}"
            assert admitted(pod, OPERATOR, port) == (port == 8265 or (port == 8000 and where in routers)), \
                f"{where} port {port}: the operator"
            assert admitted(pod, PROMETHEUS, port) == (port == 8080 or (port == 8000 and where in routers)), \
                f"{where} port {port}: Prometheus"


def test_every_kuberay_container_runs_as_non_root_without_privileges():
    for where, pod in kuberay_pods().items():
        pod_ctx = pod["spec"].get("securityContext", {})
        assert pod_ctx.get("runAsNonRoot") is True, where
        assert pod_ctx.get("runAsUser", 1000) != 0, where
        assert pod_ctx.get("seccompProfile", {}).get("type") in ("RuntimeDefault", "Localhost"), where
        assert not pod["spec"].get("hostNetwork") and not pod["spec"].get("hostPID"), where
        for c in containers(pod):
            ctx = c.get("securityContext", {})
            assert ctx.get("allowPrivilegeEscalation") is False, f"{where} {c['name']}"
            assert "ALL" in ctx.get("capabilities", {}).get("drop", []), f"{where} {c['name']}"
            assert not ctx.get("privileged") and ctx.get("runAsUser", 1000) != 0, f"{where} {c['name']}"
            assert ctx.get("runAsNonRoot", True) is True, f"{where} {c['name']}"


def test_the_routers_api_key_comes_from_a_secret_never_a_command_line():
    from cluster.cli import build_parser
    pods = kuberay_pods()
    head = pods["RayCluster/pdcluster head"]
    serve = serve_args()
    # Each router that listens beyond loopback has the key: the head's container (the RayJob's
    # entrypoint runs there and inherits its environment) and every router pod.
    key_holders = [("the head, for the RayJob's entrypoint", head["spec"]["containers"][0], serve.host)]
    for where, pod in pods.items():
        for c in pod["spec"]["containers"]:
            if c.get("command", [])[:2] == ["pdcluster", "router"]:
                key_holders.append((where, c, build_parser().parse_args(c["command"][1:]).host))
    assert len(key_holders) == 2
    refs = {secret_ref(c, "PDCLUSTER_API_KEY") for _, c, _ in key_holders}
    assert len(refs) == 1, f"the routers read different Secrets: {refs}"
    for where, c, host in key_holders:
        if host not in LOOPBACK:
            ref = secret_ref(c, "PDCLUSTER_API_KEY")
            assert ref and all(ref), f"{where}: a router on {host} without PDCLUSTER_API_KEY from a Secret"
            assert "value" not in env_of(c)["PDCLUSTER_API_KEY"]
    # No key on any command line: RayJob entrypoints, container commands and args, ray up's
    # commands, the image's CMD.
    lines = [by_kind(KUBERAY / "serve-job.yaml", "RayJob")["spec"]["entrypoint"]]
    lines += [" ".join(c.get("command", []) + c.get("args", [])) for pod in pods.values() for c in containers(pod)]
    raw = yaml.safe_load(RAY_UP.read_text())
    lines += [c for k, v in raw.items() if k.endswith("_commands") for c in v]
    lines += re.findall(r"^(?:CMD|ENTRYPOINT) (.+)$", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE)
    for line in lines:
        assert "--api-key " not in f"{line} " and "--api-key=" not in line, line
        assert "Bearer" not in line, line


def test_ray_up_routers_get_the_key_from_a_file_on_the_node():
    raw = yaml.safe_load(RAY_UP.read_text())
    setup = " ".join(raw["setup_commands"] + raw["head_setup_commands"])
    exported = re.search(r'export PDCLUSTER_API_KEY="\$\(cat ([^)]+)\)"', setup)
    assert exported, "no shell on the nodes gets PDCLUSTER_API_KEY"
    key_file = exported.group(1)
    assert any(key_file.startswith(m.rstrip("/") + "/") for m in raw["file_mounts"]), key_file
    assert f"test -s {key_file} &&" in setup           # no file: no (empty) key exported


def test_grace_periods_outlast_the_routers_drain():
    from cluster.cli import build_parser
    pods = kuberay_pods()
    serve_drain = drain_timeout_s(serve_args())
    head = pods["RayCluster/pdcluster head"]
    assert head["spec"]["terminationGracePeriodSeconds"] > serve_drain
    # `kubectl delete rayjob` stops the entrypoint through Ray, which SIGKILLs it after
    # RAY_JOB_STOP_WAIT_TIME_S (3 s unless set): the drain must fit in it, and it in the grace.
    stop_wait = float(env_of(head["spec"]["containers"][0])["RAY_JOB_STOP_WAIT_TIME_S"]["value"])
    assert serve_drain < stop_wait < head["spec"]["terminationGracePeriodSeconds"]
    checked = 1
    for where, pod in pods.items():
        if "submitter" in where or pod is head:
            continue
        grace = pod["spec"].get("terminationGracePeriodSeconds", 30)      # Kubernetes' default
        drains = [drain_timeout_s(build_parser().parse_args(c["command"][1:]))
                  for c in pod["spec"]["containers"] if c.get("command", [])[:1] == ["pdcluster"]]
        assert grace > max(drains, default=serve_drain), f"{where}: grace {grace} s"
        checked += 1
    assert checked >= 3


def test_monitoring_listens_on_loopback_without_default_credentials():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    prom, graf = compose["services"]["prometheus"], compose["services"]["grafana"]
    flags = prom["command"]
    assert not any(f.startswith(("--web.enable-lifecycle", "--web.enable-admin-api")) for f in flags), flags
    for svc in (prom, graf):                      # published ports bind loopback only
        for port in svc.get("ports", []):
            assert str(port).split(":")[0] in LOOPBACK, port
    if prom.get("network_mode") == "host":
        listen = [f.split("=", 1)[1] for f in flags if f.startswith("--web.listen-address=")]
        assert listen and listen[0].rsplit(":", 1)[0] in LOOPBACK, listen
    env = graf["environment"]
    if graf.get("network_mode") == "host":
        assert env.get("GF_SERVER_HTTP_ADDR") in LOOPBACK
    # The admin password: a file or a variable compose insists on, never a value in this file
    # (Grafana's default is admin/admin).
    if "GF_SECURITY_ADMIN_PASSWORD__FILE" not in env:
        assert re.fullmatch(r"\$\{\w+:\?[^}]+\}", env.get("GF_SECURITY_ADMIN_PASSWORD", "")), \
            env.get("GF_SECURITY_ADMIN_PASSWORD")
    if str(env.get("GF_AUTH_ANONYMOUS_ENABLED", "false")).lower() == "true":
        assert env.get("GF_AUTH_ANONYMOUS_ORG_ROLE", "Viewer") == "Viewer"
    assert str(env.get("GF_AUTH_DISABLE_LOGIN_FORM", "false")).lower() == "false"
    assert str(env.get("GF_USERS_ALLOW_SIGN_UP", "false")).lower() == "false"


def test_grafana_refuses_to_start_without_a_password():
    """Compose's `${VAR:?message}` is the shell's: check the guard with sh."""
    import subprocess
    env = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())["services"]["grafana"]["environment"]
    guard = env.get("GF_SECURITY_ADMIN_PASSWORD")
    if guard is None:
        pytest.skip("the password comes from a file")
    var = re.match(r"\$\{(\w+):", guard).group(1)
    script = f'echo "{guard}"'
    for value in (None, ""):
        run_env = {"PATH": "/usr/bin:/bin"} | ({} if value is None else {var: value})
        r = subprocess.run(["sh", "-c", script], env=run_env, capture_output=True, text=True)
        assert r.returncode != 0 and var in r.stderr
    r = subprocess.run(["sh", "-c", script], env={"PATH": "/usr/bin:/bin", var: "s3cret"},
                       capture_output=True, text=True)
    assert r.stdout.strip() == "s3cret"


def test_dockerfile_runs_as_a_non_root_user_without_sudo(tmp_path):
    import subprocess
    text = (DEPLOY / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
    assert users, "no USER: the image runs as whatever the base image says"
    final = users[-1].split(":")[0]
    assert final not in ("root", "0"), users
    assert final.isdigit(), "a numeric USER lets Kubernetes check runAsNonRoot"
    # The pods' runAsUser is this user.
    for where, pod in kuberay_pods().items():
        assert str(pod["spec"]["securityContext"].get("runAsUser", final)) == final, where
    # Ray's base image appends `ray ALL=NOPASSWD: ALL` to /etc/sudoers: the Dockerfile's sed
    # takes that line out and leaves the others.
    (sed,) = re.findall(r"sed -i -E '([^']+)' /etc/sudoers\b", text)
    sudoers = tmp_path / "sudoers"
    sudoers.write_text("Defaults env_reset\nroot ALL=(ALL:ALL) ALL\n%sudo ALL=(ALL:ALL) ALL\nray ALL=NOPASSWD: ALL\n")
    subprocess.run(["sed", "-i", "-E", sed, str(sudoers)], check=True)
    assert "ray" not in sudoers.read_text() and "root ALL" in sudoers.read_text()
    assert re.search(r"gpasswd -d ray sudo", text), "ray stays in the sudo group"
    # And the build checks it, as the final user.
    check = text.index("sudo -n true")
    assert text.rindex("\nUSER ", 0, check) == text.rindex("\nUSER ")


def test_the_images_own_router_needs_a_key(tmp_path):
    """The image's CMD serves on 0.0.0.0: it starts only with PDCLUSTER_API_KEY set."""
    import subprocess
    text = (DEPLOY / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.+\])$", text, re.MULTILINE).group(1))
    assert "0.0.0.0" in " ".join(cmd)
    fake = tmp_path / "pdcluster"              # stands in for the CLI: prints what it was given
    fake.write_text('#!/bin/sh\necho "serving $* key=$PDCLUSTER_API_KEY"\n')
    fake.chmod(0o755)
    path = f"{tmp_path}:/usr/bin:/bin"
    for env in ({"PATH": path}, {"PATH": path, "PDCLUSTER_API_KEY": ""}):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        assert r.returncode != 0 and "PDCLUSTER_API_KEY" in r.stderr and "serving" not in r.stdout
    r = subprocess.run(cmd, env={"PATH": path, "PDCLUSTER_API_KEY": "k"}, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "serving serve --host 0.0.0.0 --port 8000 key=k"
