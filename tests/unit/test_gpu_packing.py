"""The GPU packer: never overcommits a slot (hypothesis), places every model or says why not,
beats one-model-per-GPU on a mixed inventory, and writes an overlay kustomize renders."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.services import require
from server.control.planning.gpu_packing import GPU_TYPES, Model, Node, PackingError, groups_of, one_model_per_gpu, overlay_files, pack

ROOT = Path(__file__).resolve().parents[2]

MIG_LAYOUTS = {
    "A100-80": [("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"), ("1g.10gb",) * 7, ("4g.40gb", "3g.40gb"), ("7g.80gb",)],
    "A100-40": [("3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"), ("1g.5gb",) * 7],
    "H100-80": [("2g.20gb", "2g.20gb", "3g.40gb"), ("1g.10gb",) * 7],
}


@st.composite
def nodes(draw):
    out = []
    for i in range(draw(st.integers(1, 4))):
        gpu = draw(st.sampled_from(sorted(GPU_TYPES)))
        mode = draw(st.sampled_from(["whole", "mig", "mps"]))
        kw = {}
        if mode == "mig":
            kw["mig"] = draw(st.sampled_from(MIG_LAYOUTS[gpu]))
        if mode == "mps":
            kw["mps_replicas"] = draw(st.integers(2, 8))
        out.append(Node(f"n{i}", gpu, draw(st.integers(1, 4)), mode, **kw))
    return out


@st.composite
def models(draw):
    n = draw(st.integers(1, 14))
    return [
        Model(
            f"m{i}",
            draw(st.floats(0.1, 200.0, allow_nan=False)),
            draw(st.floats(0.0, 1.5, allow_nan=False)),
            draw(st.integers(1, 3)),
            draw(st.booleans()) and draw(st.booleans()),
        )
        for i in range(n)
    ]


@settings(max_examples=300, deadline=None)
@given(nodes(), models(), st.floats(0.0, 2.0))
def test_never_overcommits_and_accounts_for_every_model_copy(inventory, wanted, reserve):
    packing = pack(inventory, wanted, reserve_gb=reserve)
    by_model = {m.name: m for m in wanted}
    for slot in packing.slots:
        assert slot.used_gb <= slot.memory_gb + 1e-6
        if not slot.dedicated:
            assert slot.used_gb <= slot.memory_gb - reserve + 1e-6 or not slot.models
            assert slot.used_compute <= slot.compute + 1e-6
            assert sum(by_model[m].memory_gb for m in slot.models) == pytest.approx(slot.used_gb)
        else:
            assert len(set(slot.models)) == 1  # a dedicated GPU holds one model
        assert len(slot.models) == len(set(slot.models))  # copies of one model never share a slot
    # every copy is placed exactly once, or reported unplaceable
    placed = {}
    for p in packing.placements:
        placed[p.model] = placed.get(p.model, 0) + 1
    unplaced = {}
    for name, _reason in packing.unplaceable:
        base = name.split("#")[0]
        unplaced[base] = unplaced.get(base, 0) + 1
    for m in wanted:
        assert placed.get(m.name, 0) + unplaced.get(m.name, 0) == m.replicas
    # physical GPUs: no slot memory beyond the GPU's
    per_gpu = {}
    for s in packing.slots:
        per_gpu.setdefault((s.node, s.gpu_index), []).append(s)
    for slots in per_gpu.values():
        assert sum(s.used_gb for s in slots) <= GPU_TYPES[slots[0].gpu]["memory_gb"] + 1e-6
    # groups cover every used slot once
    covered = [slot for g in groups_of(packing) for slot in g.slots]
    assert sorted(covered) == sorted(s.id for s in packing.used_slots())


def test_mixed_inventory_beats_one_model_per_gpu():
    inventory = [
        Node("mig", "A100-80", 2, "mig", ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")),
        Node("h100", "H100-80", 2),
        Node("mps", "A100-40", 1, "mps", mps_replicas=4),
    ]
    wanted = [
        Model("llm-8b", 30, 0.4, replicas=2),
        Model("resnet", 2.5, 0.1, replicas=2),
        Model("bert", 4, 0.15),
        Model("minilm", 1.2, 0.05, replicas=2),
        Model("whisper", 6, 0.2),
        Model("trees", 1.5, 0.05, replicas=3),
    ]
    packing = pack(inventory, wanted)
    assert packing.unplaceable == []
    baseline = one_model_per_gpu(inventory, wanted)
    # one model per GPU: 11 copies -> 11 GPUs (the 30 GB ones on A100-40s would not fit: 40 - 0.5 reserve holds 30)
    assert baseline["gpus"] == 11 and baseline["fits_inventory"] is False  # the inventory has 5 GPUs
    model_gb = 30 * 2 + 2.5 * 2 + 4 + 1.2 * 2 + 6 + 1.5 * 3
    assert packing.memory_used_gb == pytest.approx(model_gb)
    assert packing.gpus_used <= 3 < baseline["gpus"]
    assert packing.utilization > 2 * baseline["utilization"]
    assert packing.dedicated == []


def test_small_models_open_small_slices_and_big_ones_get_tensor_parallel_gpus():
    inventory = [Node("mig", "A100-80", 1, "mig", ("1g.10gb",) * 7), Node("h100", "H100-80", 4)]
    packing = pack(inventory, [Model("tiny", 3), Model("huge", 150, 1.6, dedicated=True)])
    slots = {p.model: p.slots for p in packing.placements}
    assert slots["tiny"] == ["mig-gpu0-1g-10gb-0"]  # not an H100
    assert slots["huge"] == ["h100-gpu0", "h100-gpu1"] and packing.dedicated == ["huge"]
    groups = {g.models: g for g in groups_of(packing)}
    assert groups[("huge",)].resource == "nvidia.com/gpu" and groups[("huge",)].count == 2
    assert groups[("tiny",)].resource == "nvidia.com/mig-1g.10gb"


def test_what_fits_nowhere_is_reported_with_the_reason():
    packing = pack([Node("mps", "A100-40", 1, "mps", mps_replicas=4)], [Model("big", 35), Model("ok", 5)])
    assert [m for m, _ in packing.unplaceable] == ["big"]
    assert "needs 35 GB" in packing.unplaceable[0][1] and "no whole GPUs" in packing.unplaceable[0][1]
    assert [p.model for p in packing.placements] == ["ok"]


@pytest.mark.parametrize(
    ("node", "message"),
    [
        (dict(name="x", gpu="V100", count=1), "unknown GPU type 'V100'"),
        (dict(name="x", gpu="A100-80", count=1, mode="mig", mig=("7g.80gb", "1g.10gb")), "uses 8 compute slices"),
        (dict(name="x", gpu="A100-40", count=1, mode="mig", mig=("1g.10gb",)), "mig needs profiles of A100-40"),
        (dict(name="x", gpu="H100-80", count=1, mode="mps", mps_replicas=1), "mps_replicas >= 2"),
        (dict(name="x", gpu="H100-80", count=0), "count must be >= 1"),
    ],
)
def test_bad_inventory_is_named(node, message):
    with pytest.raises(PackingError, match=message):
        Node(**node)


def test_bad_models_are_named():
    with pytest.raises(PackingError, match="memory_gb must be > 0"):
        Model("m", 0)
    with pytest.raises(PackingError, match="lacks 'memory_gb'"):
        Model.from_dict({"name": "m"})
    with pytest.raises(PackingError, match="unique"):
        pack([Node("n", "H100-80", 1)], [Model("a", 1), Model("a", 2)])


@pytest.mark.service("kubectl")
def test_cli_writes_an_overlay_kustomize_renders(tmp_path):
    from typer.testing import CliRunner
    import typer

    from server.cli import plan

    app = typer.Typer()
    plan.mount(app)

    @app.callback()
    def _root():
        pass

    # a copy of the deploy tree, so the overlay is written where the gpu overlay reads it
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    inventory = {"nodes": [{"name": "pool-a", "gpu": "H100-80", "count": 2, "mode": "mig", "mig": ["3g.40gb", "2g.20gb", "2g.20gb"]}],
                 "models": [{"name": "a", "memory_gb": 12, "compute": 0.2}, {"name": "b", "memory_gb": 30}, {"name": "c", "memory_gb": 5, "replicas": 2}]}  # fmt: skip
    (tmp_path / "inv.json").write_text(json.dumps(inventory))
    out_dir = tmp_path / "deploy" / "overlays" / "gpu" / "packing"
    result = CliRunner().invoke(app, ["plan", "gpus", str(tmp_path / "inv.json"), "--out", str(out_dir)])
    assert result.exit_code == 0, result.output
    assert "utilization" in result.output and "one model per GPU: 4 GPUs" in result.output
    assert not (out_dir / "gpu-06").exists()  # the old overlay's groups are gone
    kubectl = require("kubectl")
    rendered = subprocess.run([kubectl, "kustomize", str(tmp_path / "deploy" / "overlays" / "gpu")], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    assert "nvidia.com/mig-2g.20gb" in rendered.stdout and "nvidia.com/mig-3g.40gb" in rendered.stdout
    bad = CliRunner().invoke(app, ["plan", "gpus", str(tmp_path / "inv.json"), "--reserve-gb", "39"])
    assert bad.exit_code == 3 and "unplaceable: b" in bad.output


def test_overlay_files_name_groups_and_routing():
    packing = pack([Node("p", "A100-80", 1, "mig", ("3g.40gb", "3g.40gb"))], [Model("x", 10, replicas=2)])
    files = overlay_files(packing)
    assert sorted(files) == ["gpu-01/group.yaml", "gpu-01/kustomization.yaml", "kustomization.yaml", "model-groups.json"]
    routing = json.loads(files["model-groups.json"])
    assert routing["gpu-01"] == {"grpc_port": 8001, "models": ["x"], "service": "triton-gpu-01"}
    assert routing["general"]["models"] == ["*"]
    # two identical slots: one group of two replicas, held there by its ScaledObject (the Deployment
    # sets no `replicas:`, which would fight KEDA on every apply)
    assert '"/spec/minReplicaCount", "value": 2' in files["gpu-01/kustomization.yaml"].replace("\n", " ").replace("    ", "")
    assert "replicas:" not in files["gpu-01/group.yaml"] and "initContainers" not in files["gpu-01/group.yaml"]


def test_a_models_replicas_spread_over_zones():
    """Three zones, one node of 8 H100-80 each. The 70B at 150 GiB needs tensor parallel 2 (75 GiB
    per GPU <= 80 - 0.5); its 3 copies go one per zone (before zones counted, all three took node a,
    whose 8 GPUs hold four). A 10 GiB model's 3 copies: one whole GPU per zone as well."""
    nodes = [Node(f"n-{z}", "H100-80", 8, zone=z) for z in "abc"]
    packing = pack(nodes, [Model("llama-70b", 150.0, compute=1.0, replicas=3), Model("small", 10.0, replicas=3)])
    zone_of = {s.id: s.zone for s in packing.slots}
    for model in ("llama-70b", "small"):
        zones = sorted(zone_of[p.slots[0]] for p in packing.placements if p.model == model)
        assert zones == ["a", "b", "c"], (model, zones)
    assert all(len(p.slots) == 2 for p in packing.placements if p.model == "llama-70b")
    assert {s["zone"] for s in packing.report()["slots"]} == {"a", "b", "c"}
    assert Node.from_dict({"name": "x", "gpu": "H100-80", "zone": "eu-1a"}).zone == "eu-1a"
