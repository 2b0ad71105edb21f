"""The deployment files (deploy/) hold together: Kubernetes manifests that validate and whose
parts select, mount and reference each other; a compose stack whose services, volumes, files
and scrape targets exist; alert rules and a dashboard that query only the series ckpt
exports. Offline and fast: no cluster, no Docker, no Prometheus (promtool is not needed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support.deploy_names import ALERTS, DASHBOARD, DEPLOY, metric_names, metric_names_used

REPO = DEPLOY.parent
K8S = DEPLOY / "k8s"
COMPOSE_DIR = DEPLOY / "compose"
EXAMPLE = REPO / "examples" / "train_transformer.py"
NAMESPACE = "ckpt"
# Applied by hand, never by `kubectl apply -k`: it would overwrite real credentials.
EXAMPLE_SECRET = "secret-example.yaml"
# The oldest Kubernetes the manifests are written for (a Job's podFailurePolicy is GA from
# 1.31) and the newest one kubernetes-validate has schemas for.
KUBERNETES_VERSIONS = ("1.31", kubernetes_validate.utils.latest_version())
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
WORKLOADS = {"DaemonSet", "Deployment", "StatefulSet", "Job"}

# The series ckpt exports: each rank's (relayed by the node agent with `job` and `rank`
# labels) and the agent's own. The agent's live-scrape test checks that the code exports
# every name the deployment files use; this list keeps the files to the documented names.
EXPECTED_NAMES = frozenset({
    "ckpt_saves_total", "ckpt_save_failures_total", "ckpt_blocking_seconds",
    "ckpt_persist_seconds", "ckpt_written_bytes_total", "ckpt_read_bytes_total", "ckpt_received_bytes_total",
    "ckpt_last_committed_step", "ckpt_last_commit_timestamp_seconds",
    "ckpt_checkpoint_age_seconds", "ckpt_saves_in_flight", "ckpt_restores_total",
    "ckpt_restore_seconds", "ckpt_rank_meetings_total", "ckpt_coordinator_interval_seconds",
    "ckpt_coordinator_interval_steps", "ckpt_coordinator_step_seconds",
    "ckpt_coordinator_blocking_estimate_seconds", "ckpt_coordinator_persist_estimate_seconds",
    "ckpt_coordinator_slowdown_estimate_seconds", "ckpt_coordinator_cost_estimate_seconds",
    "ckpt_coordinator_expected_goodput_ratio",
    "ckpt_coordinator_mtbf_seconds", "ckpt_rank_info",
    "ckpt_agent_info", "ckpt_agent_upload_queue_depth", "ckpt_agent_upload_queue_bytes",
    "ckpt_agent_uploaded_bytes_total", "ckpt_agent_upload_seconds", "ckpt_agent_uploads_total",
    "ckpt_agent_upload_failures_total", "ckpt_agent_commits_total", "ckpt_agent_spool_bytes",
    "ckpt_agent_spool_budget_bytes", "ckpt_agent_preemptions_total",
})  # fmt: skip

# The alerts the platform team was promised, and the series each must watch.
REQUIRED_ALERTS = {
    "CkptCheckpointStale": {"ckpt_checkpoint_age_seconds", "ckpt_coordinator_interval_seconds"},
    # failed and committed outcomes, both at 0 from the start (the kinds' series begin at
    # their first failure, which increase() would miss)
    "CkptSaveFailing": {"ckpt_saves_total"},
    "CkptUploadBacklogGrowing": {"ckpt_agent_upload_queue_bytes", "ckpt_agent_upload_queue_depth"},
    "CkptSpoolNearlyFull": {"ckpt_agent_spool_bytes", "ckpt_agent_spool_budget_bytes"},
}


# -- hand-written schemas for the Prometheus Operator's kinds ------------------------------------
# kubernetes-validate ships schemas for Kubernetes' own kinds only: for a custom resource it
# raises SchemaNotFoundError. These schemas cover the fields our ServiceMonitor and
# PrometheusRule use, with the operator CRDs' types, and reject any other field, so a typo
# fails here as it would at `kubectl apply`.


def closed(required: tuple[str, ...] = (), **properties: Any) -> dict[str, Any]:
    """A JSON schema for an object with only these properties, `required` among them."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


STRING = {"type": "string"}
STRINGS = {"type": "array", "items": STRING}
LABELS = {"type": "object", "additionalProperties": STRING}
# The operator's Duration type.
DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}


def custom_resource(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return closed(
        ("apiVersion", "kind", "metadata", "spec"),
        apiVersion={"const": "monitoring.coreos.com/v1"},
        kind={"const": kind},
        metadata=closed(
            ("name",), name=STRING, namespace=STRING, labels=LABELS, annotations=LABELS
        ),
        spec=spec,
    )


RULE = closed(
    ("expr",), alert=STRING, record=STRING, expr=STRING, labels=LABELS, annotations=LABELS,
    **{"for": DURATION, "keep_firing_for": DURATION},
)  # fmt: skip
CUSTOM_RESOURCE_SCHEMAS = {
    "ServiceMonitor": custom_resource("ServiceMonitor", closed(
        ("selector", "endpoints"),
        selector=closed(("matchLabels",), matchLabels=LABELS),
        namespaceSelector=closed(matchNames=STRINGS, any={"type": "boolean"}),
        jobLabel=STRING,
        endpoints={"type": "array", "minItems": 1, "items": closed(
            ("port",), port=STRING, path={"type": "string", "pattern": "^/"}, interval=DURATION,
            scrapeTimeout=DURATION, scheme={"enum": ["http", "https"]}, honorLabels={"type": "boolean"},
            relabelings={"type": "array", "items": closed(
                sourceLabels=STRINGS, targetLabel=STRING, regex=STRING, replacement=STRING,
                separator=STRING, action=STRING,
            )},
        )},
    )),
    "PrometheusRule": custom_resource("PrometheusRule", closed(
        ("groups",),
        groups={"type": "array", "minItems": 1, "items": closed(
            ("name", "rules"), name=STRING, interval=DURATION,
            rules={"type": "array", "minItems": 1, "items": RULE},
        )},
    )),
}  # fmt: skip


# -- loading ------------------------------------------------------------------------------------


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


MANIFEST_FILES = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
MANIFESTS = [(path.name, doc) for path in MANIFEST_FILES for doc in load_all(path)]


def docs(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in MANIFESTS if doc["kind"] == kind]


def one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs(kind) if d["metadata"]["name"] == name]
    return doc


def pod_templates() -> list[tuple[str, dict[str, Any]]]:
    """(workload name, pod template) of every workload."""
    return [
        (doc["metadata"]["name"], doc["spec"]["template"])
        for _, doc in MANIFESTS
        if doc["kind"] in WORKLOADS
    ]


def containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def flag(args: list[str], name: str, default: str | None = None) -> str:
    """The value of `--name VALUE` or `--name=VALUE` in an argument list."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    assert default is not None, f"{name} not in {args}"
    return default


def agent_container() -> dict[str, Any]:
    (container,) = one("DaemonSet", "ckpt-agent")["spec"]["template"]["spec"]["containers"]
    return container


def trainer_pod() -> dict[str, Any]:
    return one("Job", "ckpt-train")["spec"]["template"]["spec"]


def compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())


def alert_rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel but the rows, which only group them."""
    dash = json.loads(DASHBOARD.read_text())
    flat = [p for top in dash["panels"] for p in [top, *top.get("panels", [])]]
    return [p for p in flat if p["type"] != "row"]


def queries() -> dict[str, str]:
    """Every PromQL expression of the alerts and the dashboard, by where it is."""
    alerts = {f"alert {rule['alert']}": rule["expr"] for rule in alert_rules()}
    panels = {
        f"panel {p['title']} {t['refId']}": t["expr"]
        for p in dashboard_panels()
        for t in p["targets"]
    }
    return alerts | panels


# -- Kubernetes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "doc",
    [doc for _, doc in MANIFESTS],
    ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in MANIFESTS],
)
def test_every_manifest_validates_against_its_schema(doc: dict[str, Any]) -> None:
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert doc["kind"] in CUSTOM_RESOURCE_SCHEMAS, f"no schema at all for {doc['kind']}"
            jsonschema.validate(doc, CUSTOM_RESOURCE_SCHEMAS[doc["kind"]])


def test_custom_resource_schemas_reject_a_misspelt_field() -> None:
    monitor = one("ServiceMonitor", "ckpt-agent")
    endpoint = monitor["spec"]["endpoints"][0]
    misspelt = {
        **monitor,
        "spec": {**monitor["spec"], "endpoints": [{**endpoint, "honourLabels": True}]},
    }
    with pytest.raises(jsonschema.ValidationError, match="honourLabels"):
        jsonschema.validate(misspelt, CUSTOM_RESOURCE_SCHEMAS["ServiceMonitor"])


def test_every_document_is_named_and_namespaced_in_ckpt() -> None:
    for filename, doc in MANIFESTS:
        where = f"{filename}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        assert doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name"), (
            where
        )
        if doc["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in doc["metadata"], where
        else:
            assert doc["metadata"].get("namespace") == NAMESPACE, where
    assert one("Namespace", NAMESPACE)


def test_kustomization_lists_every_manifest_but_the_example_secret() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == NAMESPACE
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in MANIFEST_FILES if p.name != EXAMPLE_SECRET
    )


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is not installed: kustomize is not run"
)
def test_kustomize_builds_the_manifests() -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    )
    built = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.stdout) if d}
    expected = {(d["kind"], d["metadata"]["name"]) for f, d in MANIFESTS if f != EXAMPLE_SECRET}
    assert built == expected


def test_workload_selectors_match_their_pod_labels() -> None:
    for _, doc in MANIFESTS:
        if doc["kind"] not in WORKLOADS:
            continue
        labels = doc["spec"]["template"]["metadata"]["labels"]
        if doc["kind"] == "Job":  # the Job controller writes a Job's selector
            assert "selector" not in doc["spec"] and not doc["spec"].get("manualSelector")
        else:
            assert selects(doc["spec"]["selector"]["matchLabels"], labels), doc["metadata"]["name"]


def test_services_select_pods_that_declare_their_target_ports() -> None:
    for service in docs("Service"):
        name = service["metadata"]["name"]
        pods = [
            t
            for _, t in pod_templates()
            if selects(service["spec"]["selector"], t["metadata"]["labels"])
        ]
        assert pods, f"Service {name} selects no pod"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for pod in pods:
                declared = [p for c in pod["spec"]["containers"] for p in c.get("ports", [])]
                key = "name" if isinstance(target, str) else "containerPort"
                assert target in [p.get(key) for p in declared], (
                    f"Service {name}: no container port {target!r}"
                )


def test_service_monitor_scrapes_a_named_port_of_the_agent_service() -> None:
    for monitor in docs("ServiceMonitor"):
        assert NAMESPACE in monitor["spec"]["namespaceSelector"]["matchNames"]
        selector = monitor["spec"]["selector"]["matchLabels"]
        services = [s for s in docs("Service") if selects(selector, s["metadata"]["labels"])]
        assert [s["metadata"]["name"] for s in services] == ["ckpt-agent"]
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in [p["name"] for p in services[0]["spec"]["ports"]]
            assert endpoint["honorLabels"] is True  # the relayed ranks' `job` label survives


def test_mounted_volumes_are_declared_and_declared_volumes_mounted() -> None:
    for workload, template in pod_templates():
        spec = template["spec"]
        declared = {v["name"] for v in spec.get("volumes", [])}
        mounted = {m["name"] for c in containers(spec) for m in c.get("volumeMounts", [])}
        assert mounted <= declared, f"{workload} mounts undeclared volumes {mounted - declared}"
        assert declared <= mounted, f"{workload} declares unmounted volumes {declared - mounted}"


def test_pods_run_as_their_own_service_account_without_an_api_token() -> None:
    # Neither the agent nor the trainer calls the Kubernetes API (see rbac.yaml): no Role grants
    # anything, and no pod gets a token.
    accounts = {sa["metadata"]["name"]: sa for sa in docs("ServiceAccount")}
    assert all(sa["automountServiceAccountToken"] is False for sa in accounts.values())
    assert not [d["kind"] for _, d in MANIFESTS if d["kind"].endswith(("Role", "RoleBinding"))]
    used = []
    for workload, template in pod_templates():
        spec = template["spec"]
        assert spec["serviceAccountName"] in accounts, workload
        assert spec["automountServiceAccountToken"] is False, workload
        used.append(spec["serviceAccountName"])
    assert len(set(used)) == len(used) == len(accounts), "one service account per workload"


def test_pods_read_only_keys_the_example_secret_has() -> None:
    secret = one("Secret", "ckpt-s3")
    refs = [
        env["valueFrom"]["secretKeyRef"]
        for _, template in pod_templates()
        for c in containers(template["spec"])
        for env in c.get("env", [])
        if "secretKeyRef" in env.get("valueFrom", {})
    ]
    assert {r["key"] for r in refs if not r.get("optional")} >= {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
    }
    for ref in refs:
        assert ref["name"] == "ckpt-s3" and ref["key"] in secret["stringData"], ref
    for value in secret["stringData"].values():
        assert "REPLACE-ME" in value, "the example Secret holds placeholders only"


def test_agent_probes_and_metrics_port_agree_with_its_flags() -> None:
    agent = agent_container()
    (port,) = [p for p in agent["ports"] if p["name"] == "metrics"]
    assert port["containerPort"] == int(flag(agent["args"], "--metrics-port")) == 9400
    # The default address is loopback, which neither the kubelet nor Prometheus reaches.
    assert flag(agent["args"], "--metrics-addr") == "0.0.0.0"
    for probe in ("livenessProbe", "readinessProbe"):
        assert agent[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert agent["resources"]["requests"] and agent["resources"]["limits"]


def test_trainer_and_agent_share_the_node_spool() -> None:
    agent_pod = one("DaemonSet", "ckpt-agent")["spec"]["template"]["spec"]
    agent, trainer = agent_container(), trainer_pod()["containers"][0]
    spool = flag(agent["args"], "--spool")
    for pod, container in ((agent_pod, agent), (trainer_pod(), trainer)):
        (volume,) = [v for v in pod["volumes"] if "hostPath" in v]
        assert volume["hostPath"]["path"] == "/var/lib/ckpt-spool"
        assert {"name": volume["name"], "mountPath": spool} in container["volumeMounts"]
    assert {"name": "CKPT_SPOOL", "value": spool} in trainer["env"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to drop to the container's capabilities")
def test_spool_owner_init_container_hands_the_spool_over_with_only_its_capabilities(tmp_path) -> None:
    """The init container's own command, run as root with only the capabilities it adds, on
    a root-owned directory standing for the hostPath: the first start and a restart."""
    pod = one("DaemonSet", "ckpt-agent")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    caps = init["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"]
    (mount,) = [m["mountPath"] for m in init["volumeMounts"]]
    spool = tmp_path / "hostpath"
    spool.mkdir(mode=0o755)
    shell, flag_c, script = init["command"]
    assert (shell, flag_c) == ("sh", "-c") and mount in script
    bounding = ",".join(["-all", *(f"+{c.lower()}" for c in caps["add"])])
    for start in ("first", "restart"):
        r = subprocess.run(
            ["setpriv", f"--bounding-set={bounding}", "--inh-caps=-all", "--", shell, flag_c, script.replace(mount, str(spool))],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert r.returncode == 0, f"{start}: {r.stderr}"
        st = spool.stat()
        uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, 0o770), start


def test_grace_periods_outlast_the_shutdowns_they_wait_for() -> None:
    agent_pod = one("DaemonSet", "ckpt-agent")["spec"]["template"]["spec"]
    assert agent_pod["terminationGracePeriodSeconds"] > int(
        flag(agent_container()["args"], "--shutdown-grace")
    )
    trainer = trainer_pod()
    assert trainer["terminationGracePeriodSeconds"] >= 180
    # A node going away stops both at once: a save handed off as the trainer's grace ends
    # still has two minutes of the agent's to upload.
    grace = int(flag(agent_container()["args"], "--shutdown-grace"))
    assert grace >= trainer["terminationGracePeriodSeconds"] + 120
    torchrun = trainer["containers"][0]["command"]
    assert trainer["terminationGracePeriodSeconds"] > int(flag(torchrun, "--shutdown-timeout"))


def example_defaults() -> dict[str, str]:
    """The example trainer's flags and their defaults (its argparse calls)."""
    calls = re.findall(r'add_argument\("(--[a-z-]+)"(.*)\)', EXAMPLE.read_text())
    return {name: (re.findall(r"default=([^,]+)", rest) or [""])[0] for name, rest in calls}


def check_trainer_command(argv: list[str], nnodes: str) -> None:
    """torchrun runs the example with flags it accepts and a global batch it can keep on
    every world size the job may have."""
    script = argv.index("examples/train_transformer.py")
    assert (REPO / argv[script]).is_file()
    args, defaults = argv[script + 1 :], example_defaults()
    assert {a.split("=")[0] for a in args if a.startswith("--")} <= defaults.keys()
    assert flag(args, "--root").startswith("s3://")
    low, _, high = nnodes.partition(":")
    nproc = int(flag(argv[:script], "--nproc_per_node"))
    global_batch = int(flag(args, "--global-batch", defaults["--global-batch"]))
    micro = int(flag(args, "--micro-batch", defaults["--micro-batch"]))
    for nodes in range(int(low), int(high or low) + 1):
        assert global_batch % (micro * nodes * nproc) == 0, (
            f"{nodes} node(s) cannot keep the global batch"
        )


def test_training_job_runs_the_example_elastically() -> None:
    job = one("Job", "ckpt-train")
    command = trainer_pod()["containers"][0]["command"]
    assert command[0] == "torchrun"
    check_trainer_command(command, flag(command, "--nnodes"))
    assert flag(command, "--nnodes") == "1:4" == f"1:{job['spec']['parallelism']}"
    # Pod 0 hosts the rendezvous, named through the headless Service and the pods' subdomain.
    host, port = flag(command, "--rdzv-endpoint").split(":")
    assert host == f"ckpt-train-0.{trainer_pod()['subdomain']}"
    service = one("Service", trainer_pod()["subdomain"])
    assert service["spec"]["clusterIP"] == "None"
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]


# -- docker compose -----------------------------------------------------------------------------


def test_compose_depends_on_names_services_it_defines() -> None:
    services = compose()["services"]
    for name, service in services.items():
        assert set(service.get("depends_on", [])) <= set(services), name


def bind_mounts(service: dict[str, Any]) -> list[tuple[Path, str]]:
    """(host path, container path) of each bind mount of a compose service."""
    mounts = [v.split(":") for v in service.get("volumes", [])]
    return [((COMPOSE_DIR / m[0]).resolve(), m[1]) for m in mounts if m[0].startswith((".", "/"))]


def test_compose_named_volumes_are_declared() -> None:
    stack = compose()
    declared = set(stack.get("volumes", {}))
    used = {v.split(":")[0] for s in stack["services"].values() for v in s.get("volumes", [])}
    named = {v for v in used if not v.startswith((".", "/"))}
    assert named == declared


def test_compose_mounts_files_that_exist_in_the_repo() -> None:
    for name, service in compose()["services"].items():
        for host, _ in bind_mounts(service):
            assert host.exists(), f"{name} mounts {host}, which does not exist"
            assert REPO in host.parents, f"{name} mounts {host}, outside the repository"
    build = compose()["services"]["agent"]["build"]
    assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"


def listens_on(service: dict[str, Any]) -> set[int]:
    """The container ports a compose service exposes or publishes."""
    ports = {int(str(p).split(":")[-1].split("/")[0]) for p in service.get("ports", [])}
    return ports | {int(p) for p in service.get("expose", [])}


def test_prometheus_scrapes_ports_compose_services_listen_on() -> None:
    services = compose()["services"]
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    targets = [
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    ]
    assert targets
    for target in targets:
        host, port = target.split(":")
        assert host in services and int(port) in listens_on(services[host]), target
    agent = services["agent"]
    assert int(flag(agent["command"], "--metrics-port")) in listens_on(agent)
    assert flag(agent["command"], "--metrics-addr") == "0.0.0.0"


def test_prometheus_and_grafana_load_the_repo_rules_and_dashboard() -> None:
    services = compose()["services"]
    rules = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())["rule_files"]
    mounted = {container: host for host, container in bind_mounts(services["prometheus"])}
    assert [mounted[r] for r in rules] == [ALERTS]
    grafana = {container: host for host, container in bind_mounts(services["grafana"])}
    provisioning = grafana["/etc/grafana/provisioning"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "ckpt.yml").read_text())[
        "providers"
    ]
    dashboards = [c for c, h in grafana.items() if h == DASHBOARD]
    assert [Path(c).parent for c in dashboards] == [Path(provider["options"]["path"])]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    host, port = source["url"].removeprefix("http://").split(":")
    assert host in services and int(port) in listens_on(services[host])


def test_compose_trainer_and_agent_share_the_spool_volume() -> None:
    services = compose()["services"]
    agent, trainer = services["agent"], services["trainer"]
    spool = flag(agent["command"], "--spool")
    assert trainer["environment"]["CKPT_SPOOL"] == spool
    shared = {v for v in agent["volumes"] if v.endswith(":" + spool)} & set(trainer["volumes"])
    assert shared and not next(iter(shared)).startswith((".", "/")), (
        "a named volume, mounted on both"
    )
    assert trainer["entrypoint"] == ["torchrun"]
    check_trainer_command(trainer["command"], "1")
    assert int(trainer["stop_grace_period"].removesuffix("s")) > int(
        flag(trainer["command"], "--shutdown-timeout")
    )


def test_agent_down_alert_names_the_scrape_job_in_both_stacks() -> None:
    (expr,) = [r["expr"] for r in alert_rules() if r["alert"] == "CkptAgentDown"]
    (job,) = re.findall(r'up\{job="([^"]+)"\}', expr)
    compose_jobs = [
        j["job_name"]
        for j in yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())["scrape_configs"]
    ]
    assert compose_jobs == [job]
    # The Prometheus Operator names a ServiceMonitor's job after the Service it scrapes.
    assert one("Service", job) and "jobLabel" not in one("ServiceMonitor", "ckpt-agent")["spec"]


# -- alert rules and dashboard ------------------------------------------------------------------


def test_prometheus_rule_carries_the_alert_file_groups() -> None:
    (rule,) = docs("PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


def test_alert_rules_are_complete() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert rule["expr"].strip() and re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    for alert, series in REQUIRED_ALERTS.items():
        (expr,) = [r["expr"] for r in rules if r["alert"] == alert]
        assert series <= metric_names(expr), alert


def call_arguments(expr: str, function: str) -> list[str]:
    """The argument text of each call of `function` in `expr`."""
    found = []
    for match in re.finditer(rf"\b{function}\(", expr):
        depth, start = 1, match.end()
        for i in range(start, len(expr)):
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            if depth == 0:
                found.append(expr[start:i])
                break
    return found


@pytest.mark.parametrize("expr", queries().values(), ids=queries().keys())
def test_queries_are_well_formed(expr: str) -> None:
    """What can be checked without a PromQL parser: balanced brackets outside strings,
    range functions given a range, quantiles over buckets grouped by le."""
    unquoted = re.sub(r'"(\\.|[^"\\])*"', '""', expr)
    stack = []
    for char in unquoted:
        if char in "([{":
            stack.append(char)
        elif char in ")]}":
            assert stack and "([{"[")]}".index(char)] == stack.pop(), f"unbalanced {char!r}"
    assert not stack, f"unclosed {stack}"
    for function in ("rate", "increase", "deriv"):
        for argument in call_arguments(unquoted, function):
            assert re.search(r"\[(\$__rate_interval|\d+[smhd])\]$", argument), (
                f"{function}({argument}) needs a range"
            )
    for argument in call_arguments(unquoted, "histogram_quantile"):
        assert re.match(
            r"0?\.\d+, sum by \(([a-z_]+, )*le\) \(rate\(ckpt_\w+_bucket\b", argument
        ), argument


def test_dashboard_panels_have_a_datasource_and_a_query() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dash["templating"]["list"]}
    panels = dashboard_panels()
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["datasource"]["type"] == "prometheus", panel["title"]
        assert panel["datasource"]["uid"].strip("${}") in variables, panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]
        assert "gridPos" in panel, panel["title"]


def test_dashboard_and_alerts_use_only_exported_metric_names() -> None:
    used = metric_names_used()
    assert used, "no ckpt_* name found: the files moved?"
    assert used <= EXPECTED_NAMES, f"not exported by ckpt: {sorted(used - EXPECTED_NAMES)}"


def test_metric_names_are_normalised_to_the_scraped_families() -> None:
    expr = 'histogram_quantile(0.5, rate(ckpt_blocking_seconds_bucket[5m])) + ckpt_restore_seconds_sum / ckpt_restore_seconds_count + ckpt_saves_total{outcome="x"} + my_ckpt_other'
    assert metric_names(expr) == {
        "ckpt_blocking_seconds",
        "ckpt_restore_seconds",
        "ckpt_saves_total",
    }
