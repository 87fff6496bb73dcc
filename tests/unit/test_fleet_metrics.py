"""Every metric the manifests query (KEDA ScaledObjects, the HPA, the prometheus-adapter rule in
deploy/README.md, the control plane's Prometheus queries) is one the frontend exports, with the
labels the query uses — read from every YAML file under deploy/ (kustomize patches included) and
from the README, against the families a real frontend registry carries after one sampling round and the
cost report's series (server.control.planning.cost_reports)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from batching.fair_queue import FairQueue
from prometheus_client.parser import text_string_to_metric_families

from server.control.planning.budgets import Assessment
from server.control.scaling.cluster import SIGNAL_QUERIES
from server.control.planning.cost_reports import exposition
from server.control.planning.cost_store import Budget
from server.control.scaling.signals import SignalSampler
from server.dataplane.fleet_hooks import FleetHooks
from server.dataplane.metrics import Metrics
from server.dataplane.replicas import Member, ReplicaSet
from server.errors import BackendUnavailable

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SELECTOR = re.compile(r"(?<![/\w])(inferplane_[a-z0-9_]+)\s*(\{[^}]*\})?")
LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!=|!~|=)")


class _Client:
    target = "127.0.0.1:1"

    async def unary_raw(self, method, request, timeout=None):
        raise BackendUnavailable("no Triton in this test")


def exported() -> dict[str, set[str]]:
    """Sample name -> label names, from a frontend's registry after one signal round."""
    metrics = Metrics()
    hooks = FleetHooks()
    hooks.queues["fraud"] = FairQueue("fraud")
    replicas = ReplicaSet([Member("local-0", _Client(), local=True)])
    sampler = SignalSampler(hooks, replicas, registry=metrics.registry, group_of=lambda m: "general")
    asyncio.run(sampler.sample())
    metrics.count("fraud", "1", "OK")
    metrics.queue_depth.labels("fraud").set(0)
    metrics.model("fraud")
    metrics.admitted("fraud", "direct")  # labelled families export samples once a child exists
    metrics.drift_psi.labels("fraud", "amount").set(0)
    metrics.drift_ks.labels("fraud", "amount").set(0)
    for histogram in (metrics.time_to_first_token, metrics.inter_token_latency, metrics.tokens_per_second):
        histogram.labels("chat", "1", "acme").observe(0.1)  # the token SLIs (issue 31)
    out: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    # the cost and budget series, exported by `inferplane cost|budget --format prom` (a textfile collector)
    owner = [{"team": "t", "endpoint": "fraud", "prices": "v", "cost_usd": 1.0}]
    caller = [{"team": "t", "endpoint": "fraud", "cost_usd": 1.0, "compute_s": 1.0, "tokens": 0}]
    cost = exposition(owner, caller, [Assessment(Budget("team", "t", 10.0), 1.0, 2.0)]).decode()
    for family in text_string_to_metric_families(cost):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def queried() -> list[tuple[str, set[str], str]]:
    """(metric, labels used, where) for every selector in deploy/ and the control plane's queries."""
    found = []
    texts = [(p, p.read_text()) for p in sorted(DEPLOY.rglob("*.yaml"))] + [(DEPLOY / "README.md", (DEPLOY / "README.md").read_text())]
    texts += [(Path("server/control/scaling/cluster.py"), " ".join(q.format(m="fraud") for q in SIGNAL_QUERIES.values()))]
    for path, text in texts:
        for match in SELECTOR.finditer(text):
            labels = {m.group(1) for m in LABEL.finditer(match.group(2) or "")}
            found.append((match.group(1), labels - {"namespace", "pod"}, str(path.relative_to(ROOT) if path.is_absolute() else path)))
    return found


def adapter_derived() -> set[str]:
    """Names the prometheus-adapter rule in deploy/README.md defines (``name: {as: X}``)."""
    return set(re.findall(r"name:\s*\{as:\s*(inferplane_[a-z0-9_]+)\}", (DEPLOY / "README.md").read_text()))


def test_the_manifests_query_metrics_the_frontend_exports():
    have = exported()
    derived = adapter_derived()
    uses = queried()
    assert any(name == "inferplane_group_queue_depth" for name, _, _ in uses)  # the ScaledObjects' query was found
    missing = []
    for name, labels, where in uses:
        if name in derived:
            continue
        if name not in have:
            missing.append(f"{where}: {name} is not exported")
        elif not labels <= have[name]:
            missing.append(f"{where}: {name} has labels {sorted(have[name])}, the query uses {sorted(labels)}")
    assert not missing, "\n".join(missing)


def test_the_adapter_rule_builds_on_an_exported_counter():
    readme = (DEPLOY / "README.md").read_text()
    series = re.findall(r"seriesQuery:\s*'(inferplane_[a-z_]+)", readme)
    assert series == ["inferplane_requests_total"] and series[0] in exported()
    hpa = (DEPLOY / "base" / "frontend" / "hpa.yaml").read_text()
    assert set(re.findall(r"name:\s*(inferplane_[a-z_]+)", hpa)) <= adapter_derived()


# a group's warm pool (model-groups/GROUP-warm) is built from the group with its ScaledObject deleted
WARM_POOL = re.compile(r"\$patch:\s*delete\s*\n\s*apiVersion:\s*keda\.sh/\S+\s*\n\s*kind:\s*ScaledObject")


def test_every_group_scaledobject_queries_its_own_group():
    """A group's ScaledObject sums the gauges of *its* model_group label (the packer writes one per group);
    a spot pool (``-spot``) sums those of the on-demand group whose models it serves."""
    for kustomization in sorted(DEPLOY.rglob("kustomization.yaml")):
        text = kustomization.read_text()
        match = re.search(r"^nameSuffix:\s*-(\S+)", text, re.MULTILINE)
        if match is None or "ScaledObject" not in text or WARM_POOL.search(text):
            continue  # not a group's, or a warm pool (it deletes the group's ScaledObject: nothing scales it by load)
        groups = set(re.findall(r'model_group=\\?"([^"\\]+)\\?"', text))
        assert groups == {match.group(1).removesuffix("-spot")}, (kustomization, groups)
