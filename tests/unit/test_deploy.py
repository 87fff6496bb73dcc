"""deploy/: every overlay renders with ``kubectl kustomize``; every rendered object validates
(Kubernetes kinds with ``kubernetes-validate`` against KUBERNETES_VERSION, strict; KEDA's ScaledObject
and the ServiceMonitor with the vendored JSON schemas); every container has requests and limits;
the NetworkPolicies allow and deny what they claim; the GPU packing overlay is what the packer writes."""

from __future__ import annotations

import ipaddress
import json
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

from tests.services import require

pytestmark = pytest.mark.service("kubectl")  # kubectl kustomize renders the overlays
import yaml  # noqa: E402
import jsonschema  # noqa: E402
import kubernetes_validate  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu", "dev")
KUBERNETES_VERSION = "1.32"  # the API version the manifests target (kubernetes-validate's schema set)
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): DEPLOY / "schemas" / "scaledobject-keda-v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): DEPLOY / "schemas" / "servicemonitor-monitoring-v1.json",
}


@lru_cache(maxsize=None)
def _render(target: str) -> tuple[dict, ...]:
    out = subprocess.run([require("kubectl"), "kustomize", str(DEPLOY / target)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {target} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def objects(overlay: str) -> list[dict]:
    return list(_render(f"overlays/{overlay}"))


def _kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def _pod_specs(objs):
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield o, o["spec"]["template"]


# ---- rendering and schemas --------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_the_platform(overlay):
    objs = objects(overlay)
    kinds = {o["kind"] for o in objs}
    assert {
        "Namespace", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ScaledObject",
        "ServiceMonitor", "NetworkPolicy", "Secret", "ConfigMap", "ServiceAccount", "Role", "RoleBinding",
    } <= kinds  # fmt: skip
    names = {o["metadata"]["name"] for o in _kind(objs, "Deployment")}
    assert {"frontend", "control-plane", "triton-general"} <= names
    namespace = "inferplane-dev" if overlay == "dev" else "inferplane"
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    assert {o["metadata"].get("namespace") for o in objs if o["kind"] not in cluster_scoped} == {namespace}
    assert [o["metadata"]["name"] for o in _kind(objs, "Namespace")] == [namespace]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_its_schema(overlay):
    validated = 0
    for obj in objects(overlay):
        key = (obj["apiVersion"], obj["kind"])
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if key in CRD_SCHEMAS:
            schema = json.loads(CRD_SCHEMAS[key].read_text())
            errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(obj), key=str)
            assert not errors, f"{name}: " + "; ".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)
        else:
            try:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(f"{name}: {'.'.join(map(str, err.path))}: {err.message}")
            # SchemaNotFoundError propagates: an object no schema covers fails the test
        validated += 1
    assert validated == len(objects(overlay))


def test_vendored_schemas_reject_what_the_api_server_would():
    so = next(o for o in objects("cpu") if o["kind"] == "ScaledObject")
    validator = jsonschema.Draft202012Validator(json.loads(CRD_SCHEMAS[("keda.sh/v1alpha1", "ScaledObject")].read_text()))
    assert validator.is_valid(so)
    typo = json.loads(json.dumps(so))
    typo["spec"]["minReplicas"] = typo["spec"].pop("minReplicaCount")  # the HPA's field name, not KEDA's
    assert not validator.is_valid(typo)
    no_target = json.loads(json.dumps(so))
    del no_target["spec"]["scaleTargetRef"]
    assert not validator.is_valid(no_target)
    sm = next(o for o in objects("cpu") if o["kind"] == "ServiceMonitor")
    sm_validator = jsonschema.Draft202012Validator(json.loads(CRD_SCHEMAS[("monitoring.coreos.com/v1", "ServiceMonitor")].read_text()))
    assert sm_validator.is_valid(sm)
    sm_bad = json.loads(json.dumps(sm))
    sm_bad["spec"]["endpoints"][0]["interval"] = 15  # a duration string, not a number
    assert not sm_validator.is_valid(sm_bad)


def test_kubernetes_validate_rejects_a_misspelled_field():
    deployment = json.loads(json.dumps(next(o for o in objects("cpu") if o["metadata"]["name"] == "frontend" and o["kind"] == "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


# ---- resources, probes, security ----------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_and_limits(overlay):
    count = 0
    for obj, template in _pod_specs(objects(overlay)):
        spec = template["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            where = f"{obj['metadata']['name']}/{c['name']}"
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(part, {})), f"{where} lacks {part} cpu/memory"
            count += 1
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], where
        assert spec["securityContext"]["runAsNonRoot"] is True
    assert count >= 4  # frontend, control plane, its migrate Job, each Triton group


def test_frontend_is_ready_on_the_grpc_health_service_and_sizes_workers_from_its_cpu_request():
    frontend = next(o for o in objects("cpu") if o["kind"] == "Deployment" and o["metadata"]["name"] == "frontend")
    c = frontend["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["grpc"] == {"port": 8003}  # the plaintext health port: kubelet's probes speak no TLS
    assert {"name": "INFERPLANE_HEALTH_PORT", "value": "8003"} in c["env"]
    assert "--workers=$(INFERPLANE_WORKERS)" in c["args"]
    workers = next(e for e in c["env"] if e["name"] == "INFERPLANE_WORKERS")
    assert workers["valueFrom"]["resourceFieldRef"] == {"containerName": "frontend", "resource": "requests.cpu", "divisor": "1"}
    secrets = {e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert {"key-pepper", "redis-url", "tenancy-url", "encryption-key"} == secrets  # not the registry's URL


def test_frontend_drains_after_a_prestop_sleep_that_runs_on_kubernetes_1_27():
    # the endpoints controllers drop the pod before SIGTERM starts the drain, and the grace period covers both;
    # the hook runs `sleep` in the container (the lifecycle `sleep` action would need 1.30: see the next test)
    frontend = next(o for o in objects("cpu") if o["kind"] == "Deployment" and o["metadata"]["name"] == "frontend")
    pod = frontend["spec"]["template"]["spec"]
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]
    assert "sleep" not in pre_stop, "the preStop sleep action needs Kubernetes 1.30"
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and 0 < int(command[1]) < pod.get("terminationGracePeriodSeconds", 30)


def test_pdb_hpa_and_scaledobjects_point_at_deployments_that_exist():
    for overlay in OVERLAYS:
        objs = objects(overlay)
        deployments = {o["metadata"]["name"]: o for o in _kind(objs, "Deployment")}
        for hpa in _kind(objs, "HorizontalPodAutoscaler"):
            assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
            assert {m["type"] for m in hpa["spec"]["metrics"]} == {"Resource", "Pods"}
        for so in _kind(objs, "ScaledObject"):
            target = so["spec"]["scaleTargetRef"]["name"]
            assert target in deployments and target.startswith("triton-"), (overlay, target)
            group = deployments[target]["metadata"]["labels"]["inferplane.io/model-group"]
            # a spot pool scales on the load of the on-demand group whose models it serves (its own signal is that group's)
            assert f'model_group="{group.removesuffix("-spot")}"' in so["spec"]["triggers"][0]["metadata"]["query"]
        for pdb in _kind(objs, "PodDisruptionBudget"):
            sel = pdb["spec"]["selector"]["matchLabels"]
            assert any(_matches(sel, d["spec"]["template"]["metadata"]["labels"]) for d in deployments.values())


def test_every_triton_group_has_a_headless_service_and_a_scaledobject():
    for overlay in OVERLAYS:
        objs = objects(overlay)
        services = {o["metadata"]["name"]: o for o in _kind(objs, "Service")}
        scaled = {o["spec"]["scaleTargetRef"]["name"] for o in _kind(objs, "ScaledObject")}
        groups = [d for d in _kind(objs, "Deployment") if d["metadata"]["labels"].get("app.kubernetes.io/component") == "triton"]
        assert groups
        for d in groups:
            name = d["metadata"]["name"]
            svc = services[name]
            assert svc["spec"]["clusterIP"] == "None"
            pods = d["spec"]["template"]["metadata"]["labels"]
            assert _matches(svc["spec"]["selector"], pods)
            # a group's Service selects its own pods only
            others = [g for g in groups if g is not d]
            assert not any(_matches(svc["spec"]["selector"], g["spec"]["template"]["metadata"]["labels"]) for g in others)
            assert name in scaled


def test_gpu_overlay_requests_gpus_and_mig_slices_and_the_general_group_none():
    objs = objects("gpu")
    requested = {}
    for d in _kind(objs, "Deployment"):
        res = d["spec"]["template"]["spec"]["containers"][0]["resources"]
        requested[d["metadata"]["name"]] = {k: v for k, v in res["limits"].items() if k.startswith("nvidia.com/")}
        if requested[d["metadata"]["name"]]:
            assert {k: v for k, v in res["requests"].items() if k.startswith("nvidia.com/")} == requested[d["metadata"]["name"]]
    assert requested["triton-general"] == {} and requested["frontend"] == {}
    kinds = {k for r in requested.values() for k in r}
    assert "nvidia.com/gpu" in kinds and any(k.startswith("nvidia.com/mig-") for k in kinds)
    assert {"nvidia.com/gpu": "2"} in requested.values()  # the tensor-parallel 70B group
    config = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "inferplane-config")
    routing = json.loads(config["data"]["model-groups.json"])
    gpu_groups = {d["metadata"]["labels"]["inferplane.io/model-group"] for d in _kind(objs, "Deployment") if d["metadata"]["name"].startswith("triton-gpu-")}
    assert set(routing) == {"general", "general-spot"} | gpu_groups
    assert all(routing[g]["service"] == f"triton-{g}" for g in routing)


def test_packing_overlay_is_what_plan_gpus_writes():
    from server.control.planning.gpu_packing import Model, Node, overlay_files, pack

    spec = json.loads((DEPLOY / "overlays" / "gpu" / "inventory.json").read_text())
    files = overlay_files(pack([Node.from_dict(n) for n in spec["nodes"]], [Model.from_dict(m) for m in spec["models"]]))
    folder = DEPLOY / "overlays" / "gpu" / "packing"
    on_disk = {p.relative_to(folder).as_posix(): p.read_text() for p in folder.rglob("*") if p.is_file()}
    assert on_disk == files, "stale: run `inferplane plan gpus deploy/overlays/gpu/inventory.json --out deploy/overlays/gpu/packing`"


def test_control_plane_role_grants_deployments_scale_warm_pods_its_leader_lease_and_nothing_more():
    objs = objects("cpu")
    roles = {r["metadata"]["name"]: r["rules"] for r in _kind(objs, "Role")}
    assert roles == {
        "inferplane-scale-deployments": [{"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch", "update"]}],
        "inferplane-leader-lease": [
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["inferplane-control-plane"], "verbs": ["get", "watch", "update", "patch"]},
        ],
        # the frontends' discovery of Triton pods and their zones (server/runtime/kube_api.py)
        "inferplane-read-endpointslices": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}],
        # a warm pool's pods: listed, the one taken relabelled, an adopted one deleted (server/control/scaling/kube_warm_pool.py)
        "inferplane-warm-pods": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch", "delete"]}],
    }  # fmt: skip
    control = next(o for o in _kind(objs, "Deployment") if o["metadata"]["name"] == "control-plane")
    sa = control["spec"]["template"]["spec"]["serviceAccountName"]
    bindings = _kind(objs, "RoleBinding")
    assert sorted(b["roleRef"]["name"] for b in bindings) == sorted(roles)
    for binding in bindings:
        assert binding["roleRef"]["apiGroup"] == "rbac.authorization.k8s.io" and binding["roleRef"]["kind"] == "Role"
        holder = "inferplane-frontend" if binding["roleRef"]["name"] == "inferplane-read-endpointslices" else sa
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": holder, "namespace": "inferplane"}]
    # the one cluster-wide grant: the frontend pod's zone init step reads nodes (get), nothing more
    (cluster_role,) = _kind(objs, "ClusterRole")
    assert cluster_role["metadata"]["name"] == "inferplane-read-nodes"
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    (cluster_binding,) = _kind(objs, "ClusterRoleBinding")
    assert cluster_binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "inferplane-read-nodes"}
    assert cluster_binding["subjects"] == [{"kind": "ServiceAccount", "name": "inferplane-frontend", "namespace": "inferplane"}]
    # nobody else gets the automounted token; in the frontend pod the zone init step has one projected token
    # (nodes: get) and the frontend container another (endpointslices: list), each mounted there alone
    for d in _kind(objs, "Deployment"):
        if d is not control:
            assert d["spec"]["template"]["spec"].get("automountServiceAccountToken") is False
    frontend = _deployment(objs, "frontend")["spec"]["template"]["spec"]
    readers = {v["name"]: v for v in frontend["volumes"] if "projected" in v}
    assert set(readers) == {"node-reader", "endpoint-reader"}
    for reader in readers.values():
        assert any("serviceAccountToken" in src for src in reader["projected"]["sources"])
    (zone_step,) = frontend["initContainers"]
    (container,) = frontend["containers"]
    assert {m["name"] for m in zone_step["volumeMounts"]} & set(readers) == {"node-reader"}
    assert {m["name"] for m in container["volumeMounts"]} & set(readers) == {"endpoint-reader"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "endpoint-reader")
    assert env["INFERPLANE_REPLICA_DISCOVERY"] == "endpointslices" and env["INFERPLANE_KUBERNETES_TOKEN_DIR"] == mount
    assert {p["path"] for src in readers["endpoint-reader"]["projected"]["sources"] for p in next(iter(src.values())).get("items", [{"path": "token"}])} == {"token", "ca.crt", "namespace"}
    (dev_cluster_binding,) = _kind(objects("dev"), "ClusterRoleBinding")
    assert dev_cluster_binding["metadata"]["name"] != cluster_binding["metadata"]["name"]
    assert dev_cluster_binding["subjects"][0]["namespace"] == "inferplane-dev"
    dev_binding = _kind(objects("dev"), "RoleBinding")[0]
    assert dev_binding["subjects"][0]["namespace"] == "inferplane-dev"


def test_secrets_hold_the_pepper_the_database_urls_and_tls():
    secrets = {o["metadata"]["name"]: o for o in _kind(objects("cpu"), "Secret")}
    assert set(secrets["inferplane-keys"]["stringData"]) == {"key-pepper"}
    assert {"registry-url", "tenancy-url", "redis-url"} <= set(secrets["inferplane-databases"]["stringData"])
    assert secrets["inferplane-tls"]["type"] == "kubernetes.io/tls"
    assert {"tls.crt", "tls.key", "ca.crt"} == set(secrets["inferplane-tls"]["stringData"])
    assert set(secrets["inferplane-encryption"]["stringData"]) == {"encryption-key"}


def test_the_frontends_serve_tls_from_the_secret_and_the_control_plane_trusts_it():
    objs = objects("cpu")
    deployments = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in _kind(objs, "Deployment")}
    frontend = deployments["frontend"]
    c = frontend["containers"][0]
    assert {"--tls-cert=/etc/inferplane-tls/tls.crt", "--tls-key=/etc/inferplane-tls/tls.key"} <= set(c["args"])
    tls_volume = next(v for v in frontend["volumes"] if v.get("secret", {}).get("secretName") == "inferplane-tls")
    assert {"name": tls_volume["name"], "mountPath": "/etc/inferplane-tls", "readOnly": True} in c["volumeMounts"]
    control = deployments["control-plane"]
    env = {e["name"]: e for e in control["containers"][0]["env"]}
    assert env["INFERPLANE_CLIENT_TLS_CA"]["value"] == "/etc/inferplane-tls/ca.crt"
    assert any(v.get("secret", {}).get("secretName") == "inferplane-tls" for v in control["volumes"])


# ---- NetworkPolicies: a small evaluator of what they allow ---------------------------------------


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _selects(sel: dict | None, labels: dict) -> bool:
    if sel is None:
        return True
    exprs = sel.get("matchExpressions", [])
    assert not exprs, "the evaluator reads matchLabels only"
    return _matches(sel.get("matchLabels", {}), labels)


class Peer:
    """A pod of this namespace (labels), a pod of another namespace, or an outside address."""

    def __init__(self, labels=None, namespace="inferplane", ns_labels=None, ip=None):
        self.labels = labels or {}
        self.namespace = namespace
        self.ns_labels = ns_labels or {"kubernetes.io/metadata.name": namespace}
        self.ip = ip


def _peer_matches(rule_peers, peer: Peer, own_namespace: str) -> bool:
    if not rule_peers:  # no from/to: every peer
        return True
    for p in rule_peers:
        if "ipBlock" in p:
            if peer.ip is None:
                continue
            block = p["ipBlock"]
            ip = ipaddress.ip_address(peer.ip)
            if ip in ipaddress.ip_network(block["cidr"]) and not any(ip in ipaddress.ip_network(e) for e in block.get("except", [])):
                return True
            continue
        if peer.ip is not None:
            continue
        if "namespaceSelector" in p:
            if _selects(p["namespaceSelector"], peer.ns_labels) and _selects(p.get("podSelector"), peer.labels):
                return True
        elif peer.namespace == own_namespace and _selects(p.get("podSelector"), peer.labels):
            return True
    return False


def _port_matches(rule_ports, port: int, protocol="TCP") -> bool:
    return not rule_ports or any(p.get("port") == port and p.get("protocol", "TCP") == protocol for p in rule_ports)


def _allowed(policies, direction: str, pod: Peer, other: Peer, port: int) -> bool:
    """Whether ``pod``'s policies admit traffic in ``direction`` (Ingress: from other; Egress: to other)."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], pod.labels) and direction in p["spec"]["policyTypes"]]
    if not selecting:
        return True  # not isolated
    key, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    return any(
        _peer_matches(rule.get(peers), other, pod.namespace) and _port_matches(rule.get("ports"), port)
        for p in selecting
        for rule in p["spec"].get(key, [])
    )


def _connects(policies, src: Peer, dst: Peer, port: int) -> bool:
    """A connection needs the source's egress (when it is a pod here) and the destination's ingress."""
    out = src.ip is not None or src.namespace != "inferplane" or _allowed(policies, "Egress", src, dst, port)
    into = dst.ip is not None or dst.namespace != "inferplane" or _allowed(policies, "Ingress", dst, src, port)
    return out and into


def _pods(objs) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in _kind(objs, "Deployment")}


def test_network_policies_select_what_they_claim():
    objs = objects("gpu")
    policies = _kind(objs, "NetworkPolicy")
    pods = _pods(objs)
    by_name = {p["metadata"]["name"]: p for p in policies}
    selected = {name: sorted(d for d, labels in pods.items() if _selects(p["spec"]["podSelector"], labels)) for name, p in by_name.items()}
    assert selected["frontend"] == ["frontend"]
    assert selected["control-plane"] == ["control-plane"]
    assert selected["triton"] == sorted(d for d, labels in pods.items() if labels["app.kubernetes.io/component"] == "triton") and len(selected["triton"]) > 1
    assert selected["triton-warm"] == ["triton-general-warm"]  # a warm pool's idle Tritons: a policy of their own
    assert selected["default-deny"] == sorted(pods) and selected["dns"] == sorted(pods)
    assert by_name["default-deny"]["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in by_name["default-deny"]["spec"] and "egress" not in by_name["default-deny"]["spec"]


def test_only_frontends_reach_triton_and_only_the_control_plane_reaches_the_registry_database():
    objs = objects("gpu")
    policies = _kind(objs, "NetworkPolicy")
    pods = {name: Peer(labels) for name, labels in _pods(objs).items()}
    tritons = [p for p in pods.values() if p.labels["app.kubernetes.io/component"] == "triton"]
    frontend, control = pods["frontend"], pods["control-plane"]
    outside = Peer(ip="203.0.113.7")
    other_namespace = Peer({"app": "x"}, namespace="team-a")
    registry_db, tenancy_db, redis = Peer(ip="192.0.2.10"), Peer(ip="192.0.2.11"), Peer(ip="192.0.2.20")
    prometheus = Peer({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")

    for triton in tritons:
        assert _connects(policies, frontend, triton, 8001)
        assert _connects(policies, frontend, triton, 8000)
        assert _connects(policies, control, triton, 8001)  # the reconciler's model-control calls
        assert not _connects(policies, control, triton, 8000)
        for intruder in [outside, other_namespace, *[t for t in tritons if t is not triton]]:
            assert not _connects(policies, intruder, triton, 8001)
        assert _connects(policies, prometheus, triton, 8002)
        assert not _connects(policies, prometheus, triton, 8001)
        assert not _connects(policies, triton, registry_db, 5432) and not _connects(policies, triton, tenancy_db, 5432)
        assert not _connects(policies, triton, redis, 6379)
        assert _connects(policies, triton, Peer(ip="52.216.0.1"), 443)  # object storage: the model repository

    warm = pods["triton-general-warm"]  # idle, out of every Service: the control plane loads it before a scale-up takes it
    assert _connects(policies, control, warm, 8001) and not _connects(policies, control, warm, 8000)
    for intruder in [frontend, outside, other_namespace, *tritons]:
        assert not _connects(policies, intruder, warm, 8001) and not _connects(policies, intruder, warm, 8000)
    assert _connects(policies, warm, Peer(ip="52.216.0.1"), 443) and _connects(policies, prometheus, warm, 8002)
    assert not _connects(policies, warm, registry_db, 5432) and not _connects(policies, warm, redis, 6379)

    assert _connects(policies, control, registry_db, 5432)
    for other in [frontend, *tritons, warm]:
        assert not _connects(policies, other, registry_db, 5432)
    assert _connects(policies, frontend, tenancy_db, 5432) and _connects(policies, frontend, redis, 6379)
    assert _connects(policies, outside, frontend, 8001) and _connects(policies, outside, frontend, 8000)
    assert not _connects(policies, outside, frontend, 8002) and _connects(policies, prometheus, frontend, 8002)
    assert not _connects(policies, outside, control, 8002) and not _connects(policies, outside, control, 8001)
    assert _connects(policies, frontend, control, 8001)  # admin writes carried to the leader
    assert _connects(policies, control, frontend, 8001)  # the deployer's admin calls
    # an in-namespace PostgreSQL (labelled as the registry's) admits the control plane only
    in_cluster_db = Peer({"inferplane.io/database": "registry"})
    assert _connects(policies, control, in_cluster_db, 5432)
    assert not _connects(policies, frontend, in_cluster_db, 5432)
    assert _allowed(policies, "Ingress", in_cluster_db, control, 5432)
    assert not _allowed(policies, "Ingress", in_cluster_db, frontend, 5432)


# ---- issue 27: the walk-through's findings, one test each --------------------------------------


def _deployment(objs, name):
    return next(o for o in _kind(objs, "Deployment") if o["metadata"]["name"] == name)


def _quantity(q: str) -> float:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 1e3, "M": 1e6, "G": 1e9}
    for suffix, scale in units.items():
        if q.endswith(suffix):
            return float(q[: -len(suffix)]) * scale
    return float(q)


def test_the_servicemonitor_scrapes_https_as_the_frontends_serve_metrics_over_tls():
    objs = objects("cpu")
    args = _deployment(objs, "frontend")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert any(a.startswith("--tls-cert=") for a in args)  # TLS on every port, /metrics included
    (monitor,) = _kind(objs, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"ca": {"secret": {"name": "inferplane-tls", "key": "ca.crt"}}, "serverName": "frontend"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ephemeral_storage_limits_cover_every_disk_volume(overlay):
    """Disk-backed emptyDirs count against the pod's ephemeral-storage: a limit below them evicts the pod
    (Triton's was 2Gi beside a 20Gi model volume)."""
    for obj, template in _pod_specs(objects(overlay)):
        spec = template["spec"]
        disk = sum(_quantity(v["emptyDir"]["sizeLimit"]) for v in spec.get("volumes", []) if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory")
        limits = sum(_quantity(c["resources"]["limits"].get("ephemeral-storage", "0")) for c in spec["containers"])
        assert limits > disk, f"{overlay}: {obj['metadata']['name']}: ephemeral-storage {limits / 2**30:.1f}Gi <= volumes {disk / 2**30:.1f}Gi"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tritons_read_the_repository_url_and_load_nothing_at_start(overlay):
    """No init-container copy (it crash-looped on an empty bucket and never saw a later deploy) and no
    start-time model list (the general group's `*` loaded the GPU groups' models on the CPU pod): Triton
    reads the repository URL, the reconciler loads each group's models."""
    objs = objects(overlay)
    groups = [d for d in _kind(objs, "Deployment") if d["metadata"]["labels"].get("app.kubernetes.io/component") == "triton"]
    assert groups
    for d in groups:
        spec = d["spec"]["template"]["spec"]
        assert not spec.get("initContainers"), d["metadata"]["name"]
        (c,) = spec["containers"]
        env = {e["name"]: e for e in c.get("env", [])}
        assert env["INFERPLANE_MODEL_REPOSITORY"]["valueFrom"] == {"configMapKeyRef": {"name": "inferplane-config", "key": "model-repository-url"}}
        assert "INFERPLANE_GROUP_MODELS" not in env and not any("--load-model" in a for a in c.get("args", []))
        assert {"secretRef": {"name": "inferplane-artifacts"}} in c["envFrom"]  # object-storage credentials
        assert c["command"] == ["/opt/inferplane/triton-entrypoint.sh"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaled_deployments_set_no_replicas(overlay):
    objs = objects(overlay)
    scaled = {h["spec"]["scaleTargetRef"]["name"] for h in _kind(objs, "HorizontalPodAutoscaler") + _kind(objs, "ScaledObject")}
    assert {"frontend", "triton-general"} <= scaled
    for name in scaled:
        assert "replicas" not in _deployment(objs, name)["spec"], f"{overlay}: {name} sets replicas: its autoscaler owns them"


def test_the_control_plane_runs_two_replicas_with_probes_a_pdb_and_zone_spread():
    objs = objects("cpu")
    control = _deployment(objs, "control-plane")
    assert control["spec"]["replicas"] == 2 and control["spec"]["strategy"]["type"] == "RollingUpdate"
    spec = control["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["args"][:2] == ["control", "run"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["grpc"] == {"port": 8003}, probe
    assert {"name": "INFERPLANE_HEALTH_PORT", "value": "8003"} in c["env"]
    labels = spec.get("topologySpreadConstraints", [{}])[0]
    assert labels["topologyKey"] == "topology.kubernetes.io/zone"
    pdbs = [p for p in _kind(objs, "PodDisruptionBudget") if _matches(p["spec"]["selector"]["matchLabels"], control["spec"]["template"]["metadata"]["labels"])]
    assert [p["spec"].get("minAvailable") for p in pdbs] == [1]


def test_a_job_runs_control_migrate_against_the_registry_database():
    objs = objects("cpu")
    (job,) = _kind(objs, "Job")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["inferplane"] and c["args"] == ["control", "migrate"]
    assert c["env"] == [{"name": "INFERPLANE_DATABASE_URL", "valueFrom": {"secretKeyRef": {"name": "inferplane-databases", "key": "registry-url"}}}]
    assert job["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    registry_db = Peer(ip="192.0.2.10")
    assert _connects(_kind(objs, "NetworkPolicy"), Peer(job["spec"]["template"]["metadata"]["labels"]), registry_db, 5432)


def test_every_triton_group_has_a_pdb_of_its_own_and_spreads_over_zones():
    objs = objects("gpu")
    pdbs = _kind(objs, "PodDisruptionBudget")
    for d in _kind(objs, "Deployment"):
        if d["metadata"]["labels"].get("app.kubernetes.io/component") != "triton":
            continue
        pods = d["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in pdbs if _matches(p["spec"]["selector"]["matchLabels"], pods)]
        assert len(mine) == 1 and mine[0]["spec"]["maxUnavailable"] == 1, d["metadata"]["name"]
        assert mine[0]["spec"]["selector"]["matchLabels"]["inferplane.io/model-group"] == pods["inferplane.io/model-group"]
        (spread,) = d["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert spread["topologyKey"] == "topology.kubernetes.io/zone" and spread["matchLabelKeys"] == ["inferplane.io/model-group"]


def test_lifecycle_handlers_exist_in_the_oldest_kubernetes_the_readme_names():
    """``preStop.sleep`` needs Kubernetes 1.30; the README promises 1.27+."""
    import re

    minimum = re.search(r"a cluster \(1\.(\d+)\+\)", (DEPLOY / "README.md").read_text())
    assert minimum, "deploy/README.md names the oldest Kubernetes it supports"
    for overlay in OVERLAYS:
        for obj, template in _pod_specs(objects(overlay)):
            for c in template["spec"]["containers"]:
                for handler in c.get("lifecycle", {}).values():
                    if "sleep" in handler:
                        assert int(minimum.group(1)) >= 30, f"{overlay}: {obj['metadata']['name']}: preStop.sleep on 1.{minimum.group(1)}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_spot_pool_runs_only_on_spot_nodes_and_the_frontends_know_it_is_spot(overlay):
    from server.control.scaling.executors import ModelGroups

    objs = objects(overlay)
    spot = _deployment(objs, "triton-general-spot")
    spec = spot["spec"]["template"]["spec"]
    assert spec["nodeSelector"]["inferplane.io/capacity"] == "spot"
    assert {"key": "inferplane.io/capacity", "operator": "Equal", "value": "spot", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["terminationGracePeriodSeconds"] <= 30  # inside the shortest reclaim notice
    general = _deployment(objs, "triton-general")["spec"]["template"]["spec"]
    assert "inferplane.io/capacity" not in general.get("nodeSelector", {})  # the on-demand group stays off the spot pool
    (config,) = [c for c in _kind(objs, "ConfigMap") if "model-groups.json" in c.get("data", {})]
    groups = ModelGroups(json.loads(config["data"]["model-groups.json"]))
    assert groups.groups["general-spot"] == {"service": "triton-general-spot", "grpc_port": 8001, "models": ["*"], "capacity": "spot"}
    assert groups.groups["general"]["capacity"] == "on_demand" and groups.group_of("any_model") == "general"
    (scaled,) = [o for o in _kind(objs, "ScaledObject") if o["spec"]["scaleTargetRef"]["name"] == "triton-general-spot"]
    assert scaled["spec"]["minReplicaCount"] == 0 and 'model_group="general"' in scaled["spec"]["triggers"][0]["metadata"]["query"]


def test_a_tier_one_models_group_spreads_over_zones_strictly_and_the_others_leniently():
    """The inventory's tier-1 model (llama_8b, two replicas): its group's pods never share a zone
    while another has room (DoNotSchedule); every other Triton group keeps ScheduleAnyway."""
    spec = json.loads((DEPLOY / "overlays" / "gpu" / "inventory.json").read_text())
    tier_one = {m["name"] for m in spec["models"] if m.get("tier") == 1}
    assert tier_one == {"llama_8b"}
    objs = objects("gpu")
    (config,) = [c for c in _kind(objs, "ConfigMap") if "model-groups.json" in c.get("data", {})]
    routing = json.loads(config["data"]["model-groups.json"])
    strict = set()
    for d in _kind(objs, "Deployment"):
        if d["metadata"]["labels"].get("app.kubernetes.io/component") != "triton":
            continue
        group = d["metadata"]["labels"]["inferplane.io/model-group"]
        (spread,) = d["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert spread["topologyKey"] == "topology.kubernetes.io/zone"
        if set(routing[group]["models"]) & tier_one:
            assert spread["whenUnsatisfiable"] == "DoNotSchedule", group
            strict.add(group)
        else:
            assert spread["whenUnsatisfiable"] == "ScheduleAnyway", group
    assert strict  # the tier-1 model has a group


def test_the_frontend_reads_its_zone_from_its_nodes_label_through_the_init_step():
    objs = objects("cpu")
    spec = _deployment(objs, "frontend")["spec"]["template"]["spec"]
    (step,) = spec["initContainers"]
    assert step["command"] == ["python", "-m", "server.runtime.node_zone"]
    assert "--node=$(NODE_NAME)" in step["args"]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in step["env"]
    out = next(a.split("=", 1)[1] for a in step["args"] if a.startswith("--out="))
    (frontend,) = [c for c in spec["containers"] if c["name"] == "frontend"]
    assert {"name": "INFERPLANE_ZONE_FILE", "value": out} in frontend["env"]
    mounts = {m["name"]: m["mountPath"] for m in frontend["volumeMounts"]}
    assert out.startswith(mounts["zone"] + "/")
    assert step["resources"]["requests"] and step["resources"]["limits"]
    # the init step reaches the API server through the frontends' network policy
    (policy,) = [p for p in _kind(objs, "NetworkPolicy") if p["metadata"]["name"] == "frontend"]
    assert any({"protocol": "TCP", "port": 443} in rule.get("ports", []) for rule in policy["spec"]["egress"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_groups_warm_pool_is_its_pod_outside_its_service_until_the_executor_relabels_it(overlay):
    """The warm pool (issue 29): the group's own pod but for one label (so no overlay's patch leaves it behind),
    a size of its own, selected by no Service, PDB or Deployment of a group; the labels the executor gives the
    pod it takes (kube_warm_pool.ADOPTION) put it in the group's Service and PDB and out of the warm Deployment
    (its ReplicaSet then starts a replacement), and the executor's selectors find it before and after."""
    from server.control.scaling.kube_warm_pool import ADOPTION, COMPONENT, WARM, adopted_selector, warm_selector
    from tests.unit.test_kubernetes_executor import _selected

    objs = objects(overlay)
    policies = _kind(objs, "NetworkPolicy")
    scaled = {h["spec"]["scaleTargetRef"]["name"] for h in _kind(objs, "HorizontalPodAutoscaler") + _kind(objs, "ScaledObject")}
    warm = [d for d in _kind(objs, "Deployment") if d["metadata"]["labels"].get(COMPONENT) == WARM]
    assert [d["metadata"]["name"] for d in warm] == ["triton-general-warm"]
    for d in warm:
        group = d["metadata"]["labels"]["inferplane.io/model-group"]
        serving = _deployment(objs, f"triton-{group}")
        assert json.loads(json.dumps(d["spec"]["template"]).replace(f'"{WARM}"', '"triton"')) == serving["spec"]["template"]
        assert d["spec"]["replicas"] == 0 and d["metadata"]["name"] not in scaled  # off unless the group sets warm_pool; no autoscaler owns it
        pods = d["spec"]["template"]["metadata"]["labels"]
        assert _matches(d["spec"]["selector"]["matchLabels"], pods) and _selected(warm_selector(group), pods)
        for other in _kind(objs, "Service") + _kind(objs, "PodDisruptionBudget"):
            assert not _matches(other["spec"]["selector"].get("matchLabels", other["spec"]["selector"]), pods), other["metadata"]["name"]
        assert [o["metadata"]["name"] for o in _kind(objs, "Deployment") if _matches(o["spec"]["selector"]["matchLabels"], pods)] == [d["metadata"]["name"]]
        adopted = {**pods, **ADOPTION}
        assert _selected(adopted_selector(group), adopted) and not _selected(warm_selector(group), adopted)
        assert not _matches(d["spec"]["selector"]["matchLabels"], adopted)  # out of the warm ReplicaSet: it is refilled
        service = next(o for o in _kind(objs, "Service") if o["metadata"]["name"] == f"triton-{group}")
        assert _matches(service["spec"]["selector"], adopted)  # the frontends and the group's reconciler find it
        (pdb,) = [p for p in _kind(objs, "PodDisruptionBudget") if _matches(p["spec"]["selector"]["matchLabels"], adopted)]
        assert pdb["metadata"]["name"] == f"triton-{group}"
        assert _connects(policies, Peer(_pods(objs)["frontend"]), Peer(adopted), 8001)
        assert not _connects(policies, Peer(_pods(objs)["frontend"]), Peer(pods), 8001)
