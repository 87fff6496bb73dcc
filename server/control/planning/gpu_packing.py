"""GPU packing: place models onto a GPU inventory (whole GPUs, MIG slices, MPS shares).

Pure arithmetic, no I/O. An inventory is a list of nodes, each with GPUs of one type in one mode:

- ``whole``: each GPU is one slot (Kubernetes resource ``nvidia.com/gpu``);
- ``mig``: each GPU is cut into the listed MIG profiles (``nvidia.com/mig-<profile>``, the GPU
  operator's *mixed* strategy); the layout is the node's ``nvidia.com/mig.config``, so the packer
  takes it as given and checks it fits the GPU (compute slices <= 7, memory <= the GPU's);
- ``mps``: each GPU is shared by ``mps_replicas`` MPS clients (the device plugin's
  ``sharing.mps`` with that many replicas): equal shares of memory and compute.

A slot holds one Triton pod, which may load several models. A model needs ``memory_gb`` (weights +
its KV/activation budget) and ``compute`` (the fraction of one whole GPU's SMs it keeps busy at
its target load). Models that fit no slot but fit several whole GPUs of one node run with tensor
parallelism on ``tp`` whole GPUs (a power of two); ``dedicated`` models always get whole GPUs.

Placement is *best-fit decreasing*: models largest first; each goes to the open slot where it
leaves the least memory free; failing that, to the smallest free slot it fits (so a 3 GB model opens
a 1g.10gb slice, not an H100). Copies of one model (``replicas``) never share a slot. A model that
fits nowhere is reported unplaceable with the reason; nothing is ever overcommitted.

Zones (issue 29): a node may name its ``zone`` (``topology.kubernetes.io/zone``); each copy of a
model goes first to the zones holding the fewest of its copies so far, then by best fit within
them, so a model's replicas spread over zones (three copies over three zones: one each) and losing
a zone loses at most its share.

Memory is in GiB, as ``nvidia-smi`` reports it: an "80 GB" H100 or A100 holds 80 GiB (85.9e9 bytes).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import yaml

# GPU types: memory (GiB; the field keeps its historical name) and the MIG profiles each supports:
# name -> (compute slices, memory as the profile names it); an 80 GB A100 and an H100 80GB have the same ones
MIG_80GB = {"1g.10gb": (1, 10.0), "1g.20gb": (1, 20.0), "2g.20gb": (2, 20.0), "3g.40gb": (3, 40.0), "4g.40gb": (4, 40.0), "7g.80gb": (7, 80.0)}
GPU_TYPES: dict[str, dict] = {
    "A100-40": {
        "memory_gb": 40.0,
        "product": "NVIDIA-A100-SXM4-40GB",
        "mig": {"1g.5gb": (1, 5.0), "2g.10gb": (2, 10.0), "3g.20gb": (3, 20.0), "4g.20gb": (4, 20.0), "7g.40gb": (7, 40.0)},
    },
    "A100-80": {"memory_gb": 80.0, "product": "NVIDIA-A100-SXM4-80GB", "mig": MIG_80GB},
    "H100-80": {"memory_gb": 80.0, "product": "NVIDIA-H100-80GB-HBM3", "mig": MIG_80GB},
}  # fmt: skip
MIG_COMPUTE_SLICES = 7
MODES = ("whole", "mig", "mps")


class PackingError(ValueError):
    """The inventory or the model list is not well formed (names what is wrong)."""


@dataclass(frozen=True)
class Node:
    name: str
    gpu: str
    count: int
    mode: str = "whole"
    mig: tuple[str, ...] = ()  # the profiles each GPU is cut into (mode "mig")
    mps_replicas: int = 1  # clients sharing each GPU (mode "mps")
    zone: str = ""  # its failure domain (topology.kubernetes.io/zone)

    def __post_init__(self) -> None:
        if self.gpu not in GPU_TYPES:
            raise PackingError(f"node {self.name}: unknown GPU type {self.gpu!r} (known: {', '.join(GPU_TYPES)})")
        if self.count < 1:
            raise PackingError(f"node {self.name}: count must be >= 1, got {self.count}")
        if self.mode not in MODES:
            raise PackingError(f"node {self.name}: mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "mig":
            profiles = GPU_TYPES[self.gpu]["mig"]
            unknown = [p for p in self.mig if p not in profiles]
            if not self.mig or unknown:
                raise PackingError(
                    f"node {self.name}: mig needs profiles of {self.gpu} ({', '.join(profiles)}); got {list(self.mig)}"
                )
            slices = sum(profiles[p][0] for p in self.mig)
            memory = sum(profiles[p][1] for p in self.mig)
            if slices > MIG_COMPUTE_SLICES or memory > GPU_TYPES[self.gpu]["memory_gb"]:
                raise PackingError(
                    f"node {self.name}: MIG layout {list(self.mig)} uses {slices} compute slices and {memory:g} GB; "
                    f"a {self.gpu} has {MIG_COMPUTE_SLICES} and {GPU_TYPES[self.gpu]['memory_gb']:g} GB"
                )
        if self.mode == "mps" and self.mps_replicas < 2:
            raise PackingError(f"node {self.name}: mps needs mps_replicas >= 2, got {self.mps_replicas}")

    @classmethod
    def from_dict(cls, d: dict) -> "Node":
        try:
            return cls(
                name=str(d["name"]), gpu=str(d["gpu"]), count=int(d.get("count", 1)), mode=str(d.get("mode", "whole")),
                mig=tuple(d.get("mig", ())), mps_replicas=int(d.get("mps_replicas", 1)), zone=str(d.get("zone", "")),
            )  # fmt: skip
        except KeyError as err:
            raise PackingError(f"inventory node {d!r} lacks {err.args[0]!r}") from None


@dataclass(frozen=True)
class Model:
    name: str
    memory_gb: float
    compute: float = 0.0  # fraction of one whole GPU's SMs
    replicas: int = 1
    dedicated: bool = False
    tier: int = 2  # availability tier (server.control.scaling.isolation): a tier-1 model's group spreads over zones strictly

    def __post_init__(self) -> None:
        if not self.name:
            raise PackingError("a model needs a name")
        if self.tier not in (1, 2, 3):
            raise PackingError(f"model {self.name}: tier must be 1, 2 or 3, got {self.tier}")
        if not (self.memory_gb > 0 and math.isfinite(self.memory_gb)):
            raise PackingError(f"model {self.name}: memory_gb must be > 0, got {self.memory_gb}")
        if not (0 <= self.compute and math.isfinite(self.compute)):
            raise PackingError(f"model {self.name}: compute must be >= 0, got {self.compute}")
        if self.replicas < 1:
            raise PackingError(f"model {self.name}: replicas must be >= 1, got {self.replicas}")

    @classmethod
    def from_dict(cls, d: dict) -> "Model":
        try:
            return cls(
                name=str(d["name"]), memory_gb=float(d["memory_gb"]), compute=float(d.get("compute", 0.0)),
                replicas=int(d.get("replicas", 1)), dedicated=bool(d.get("dedicated", False)), tier=int(d.get("tier", 2)),
            )  # fmt: skip
        except KeyError as err:
            raise PackingError(f"model {d!r} lacks {err.args[0]!r}") from None


@dataclass
class Slot:
    """One schedulable GPU unit: a whole GPU, a MIG slice or an MPS share."""

    node: str
    gpu: str
    gpu_index: int
    kind: str  # whole | mig | mps
    profile: str  # "" for whole GPUs, the MIG profile, or "mps/N"
    memory_gb: float
    compute: float  # fraction of a whole GPU
    nth: int = 0  # which slot of this profile on its GPU
    models: list[str] = field(default_factory=list)
    used_gb: float = 0.0
    used_compute: float = 0.0
    dedicated: bool = False  # whole GPU given to one model (alone or tensor parallel)
    zone: str = ""  # its node's

    @property
    def id(self) -> str:
        suffix = f"-{self.profile.replace('/', '').replace('.', '-')}-{self.nth}" if self.profile else ""
        return f"{self.node}-gpu{self.gpu_index}{suffix}"

    @property
    def resource(self) -> str:
        """The extended resource a pod requests for this slot."""
        return f"nvidia.com/mig-{self.profile}" if self.kind == "mig" else "nvidia.com/gpu"

    @property
    def free_gb(self) -> float:
        return self.memory_gb - self.used_gb

    def fits(self, model: Model, reserve_gb: float) -> bool:
        return (
            not self.dedicated
            and model.name not in self.models
            and self.used_gb + model.memory_gb <= self.memory_gb - reserve_gb + 1e-9
            and self.used_compute + model.compute <= self.compute + 1e-9
        )


@dataclass
class Placement:
    model: str
    replica: int
    slots: list[str]  # one slot, or tp whole GPUs
    dedicated: bool


@dataclass
class Packing:
    slots: list[Slot]
    placements: list[Placement]
    unplaceable: list[tuple[str, str]]  # (model, reason)
    gpus_used: int  # physical GPUs with at least one used slot
    gpus_total: int
    memory_used_gb: float  # model memory placed
    memory_of_used_gpus_gb: float
    baseline: dict  # one model (copy) per whole GPU
    dedicated: list[str]
    tier_one: list[str] = field(default_factory=list)  # tier-1 models: their groups' pods never share a zone while one is free

    @property
    def utilization(self) -> float:
        return self.memory_used_gb / self.memory_of_used_gpus_gb if self.memory_of_used_gpus_gb else 0.0

    def used_slots(self) -> list[Slot]:
        return [s for s in self.slots if s.models]

    def report(self) -> dict:
        return {
            "gpus_total": self.gpus_total,
            "gpus_used": self.gpus_used,
            "memory_placed_gb": round(self.memory_used_gb, 3),
            "memory_of_used_gpus_gb": round(self.memory_of_used_gpus_gb, 3),
            "utilization": round(self.utilization, 4),
            "one_model_per_gpu": self.baseline,
            "dedicated": self.dedicated,
            "unplaceable": [{"model": m, "reason": r} for m, r in self.unplaceable],
            "slots": [
                {
                    "slot": s.id, "node": s.node, "zone": s.zone, "gpu": s.gpu, "gpu_index": s.gpu_index, "kind": s.kind,
                    "profile": s.profile, "resource": s.resource, "memory_gb": s.memory_gb,
                    "used_gb": round(s.used_gb, 3), "compute": round(s.compute, 4),
                    "used_compute": round(s.used_compute, 4), "models": list(s.models),
                }
                for s in self.used_slots()
            ],  # fmt: skip
            "placements": [
                {"model": p.model, "replica": p.replica, "slots": p.slots, "dedicated": p.dedicated} for p in self.placements
            ],
        }


def slots_of(nodes: list[Node]) -> list[Slot]:
    slots: list[Slot] = []
    for node in nodes:
        spec = GPU_TYPES[node.gpu]
        for i in range(node.count):
            if node.mode == "whole":
                slots.append(Slot(node.name, node.gpu, i, "whole", "", spec["memory_gb"], 1.0, zone=node.zone))
            elif node.mode == "mig":
                seen: dict[str, int] = {}
                for profile in node.mig:
                    slices, memory = spec["mig"][profile]
                    nth = seen.get(profile, 0)
                    seen[profile] = nth + 1
                    slots.append(Slot(node.name, node.gpu, i, "mig", profile, memory, slices / MIG_COMPUTE_SLICES, nth, zone=node.zone))
            else:
                n = node.mps_replicas
                for k in range(n):
                    slots.append(Slot(node.name, node.gpu, i, "mps", f"mps/{n}", spec["memory_gb"] / n, 1.0 / n, k, zone=node.zone))
    return slots


def _tp_for(model: Model, gpu_memory: float, reserve_gb: float) -> int:
    """Smallest power-of-two tensor-parallel degree whose per-GPU share fits (memory and compute)."""
    tp = 1
    while model.memory_gb / tp > gpu_memory - reserve_gb + 1e-9 or model.compute / tp > 1.0 + 1e-9:
        tp *= 2
        if tp > 64:
            break
    return tp


def pack(nodes: list[Node], models: list[Model], *, reserve_gb: float = 0.5) -> Packing:
    """Best-fit decreasing placement of ``models`` (each ``replicas`` times) onto ``nodes``.

    ``reserve_gb`` is kept free in every slot for the CUDA context and allocator slack.
    """
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise PackingError(f"model names must be unique: {sorted({n for n in names if names.count(n) > 1})}")
    slots = slots_of(nodes)
    whole_by_node: dict[str, list[Slot]] = {}
    for s in slots:
        if s.kind == "whole":
            whole_by_node.setdefault(s.node, []).append(s)
    largest_slot = max((s.memory_gb for s in slots), default=0.0)
    placements: list[Placement] = []
    unplaceable: list[tuple[str, str]] = []
    dedicated: list[str] = []

    copies = sorted(
        ((m, r) for m in models for r in range(m.replicas)),
        key=lambda mr: (-(mr[0].memory_gb), -(mr[0].compute), mr[0].name, mr[1]),
    )
    for model, replica in copies:
        spread = _copies_by_zone(slots, model.name)
        shareable_fit = not model.dedicated and model.memory_gb <= largest_slot - reserve_gb + 1e-9 and model.compute <= 1.0
        if shareable_fit:
            slot = _best_fit(slots, model, reserve_gb, spread)
            if slot is not None:
                slot.models.append(model.name)
                slot.used_gb += model.memory_gb
                slot.used_compute += model.compute
                placements.append(Placement(model.name, replica, [slot.id], False))
                continue
        # whole GPUs of one node: dedicated, or tensor parallel when it fits no slot
        chosen = _whole_gpus(whole_by_node, model, reserve_gb, spread)
        if chosen is None:
            reason = (
                f"needs {model.memory_gb:g} GB and {model.compute:g} GPU of compute; no free slot fits it"
                + ("" if whole_by_node else " and the inventory has no whole GPUs for tensor parallelism")
                + (" (dedicated)" if model.dedicated else "")
            )
            unplaceable.append((model.name if model.replicas == 1 else f"{model.name}#{replica}", reason))
            continue
        per_gpu = model.memory_gb / len(chosen)
        for s in chosen:
            s.models.append(model.name)
            s.used_gb += per_gpu
            s.used_compute = 1.0
            s.dedicated = True
        placements.append(Placement(model.name, replica, [s.id for s in chosen], True))
        if model.name not in dedicated:
            dedicated.append(model.name)

    used_gpus = {(s.node, s.gpu_index) for s in slots if s.models}
    gpu_memory = {(s.node, s.gpu_index): GPU_TYPES[s.gpu]["memory_gb"] for s in slots}
    placed_names = {p.model for p in placements}
    memory_placed = sum(m.memory_gb * sum(1 for p in placements if p.model == m.name) for m in models if m.name in placed_names)
    return Packing(
        slots=slots,
        placements=placements,
        unplaceable=unplaceable,
        gpus_used=len(used_gpus),
        gpus_total=len(gpu_memory),
        memory_used_gb=memory_placed,
        memory_of_used_gpus_gb=sum(gpu_memory[g] for g in used_gpus),
        baseline=one_model_per_gpu(nodes, models, reserve_gb=reserve_gb),
        dedicated=dedicated,
        tier_one=sorted(m.name for m in models if m.tier == 1),
    )


def _copies_by_zone(slots: list[Slot], model: str) -> dict[str, int]:
    """Copies of ``model`` placed so far per zone (a tensor-parallel copy counts once)."""
    out: dict[str, int] = {}
    for zone, node, gpu in {(s.zone, s.node, s.gpu_index) for s in slots if model in s.models}:
        out[zone] = out.get(zone, 0) + 1
    return out


def _best_fit(slots: list[Slot], model: Model, reserve_gb: float, spread: dict[str, int]) -> Slot | None:
    """The emptiest zone first (fewest copies of the model); in it, the open slot the model fills
    most, else the smallest free slot it fits."""
    fitting = [s for s in slots if s.fits(model, reserve_gb)]
    if not fitting:
        return None
    least = min(spread.get(s.zone, 0) for s in fitting)
    fitting = [s for s in fitting if spread.get(s.zone, 0) == least]
    candidates = [s for s in fitting if s.models]
    if candidates:
        return min(candidates, key=lambda s: (s.free_gb - model.memory_gb, s.id))
    return min(fitting, key=lambda s: (s.memory_gb, s.compute, s.id))


def _whole_gpus(whole_by_node: dict[str, list[Slot]], model: Model, reserve_gb: float, spread: dict[str, int]) -> list[Slot] | None:
    best: list[Slot] | None = None
    best_key = None
    for node, gpus in sorted(whole_by_node.items()):
        free = [s for s in gpus if not s.models]
        tp = _tp_for(model, gpus[0].memory_gb, reserve_gb)
        if tp <= len(free):
            key = (spread.get(gpus[0].zone, 0), tp * free[0].memory_gb)  # the emptiest zone, then the least memory
            if best_key is None or key < best_key:
                best, best_key = free[:tp], key
    return best


def one_model_per_gpu(nodes: list[Node], models: list[Model], *, reserve_gb: float = 0.5) -> dict:
    """The baseline: every model copy on whole GPUs of its own (the smallest GPU type that fits,
    tensor parallel where one is not enough), as if no GPU were cut or shared."""
    types = sorted({n.gpu for n in nodes}, key=lambda t: GPU_TYPES[t]["memory_gb"]) or sorted(GPU_TYPES)
    gpus = 0
    memory = 0.0
    placed = 0.0
    for m in models:
        best = None
        for t in types:
            tp = _tp_for(m, GPU_TYPES[t]["memory_gb"], reserve_gb)
            cost = tp * GPU_TYPES[t]["memory_gb"]
            if best is None or cost < best[0]:
                best = (cost, tp)
        assert best is not None
        gpus += best[1] * m.replicas
        memory += best[0] * m.replicas
        placed += m.memory_gb * m.replicas
    return {
        "gpus": gpus,
        "memory_gb": round(memory, 3),
        "utilization": round(placed / memory, 4) if memory else 0.0,
        "fits_inventory": gpus <= sum(n.count for n in nodes),
    }


# ---- the kustomize overlay the manifests consume -----------------------------------------------

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@dataclass(frozen=True)
class Group:
    """Slots with the same resource, GPU product and models become one Triton model group."""

    name: str
    resource: str  # the extended resource each pod requests ...
    count: int  # ... this many of (tensor-parallel groups: several whole GPUs)
    pool: str  # the inventory node (pool) whose GPUs it uses: node label inferplane.io/gpu-pool
    gpu: str
    models: tuple[str, ...]
    replicas: int
    slots: tuple[str, ...]


def groups_of(packing: Packing) -> list[Group]:
    tensor_parallel = {s for p in packing.placements if len(p.slots) > 1 for s in p.slots}
    merged: dict[tuple, list[Slot]] = {}
    for slot in packing.used_slots():
        if slot.id in tensor_parallel:
            continue  # one group per tensor-parallel placement, below
        merged.setdefault((slot.resource, slot.node, slot.gpu, tuple(sorted(slot.models))), []).append(slot)
    groups: list[Group] = []
    for (resource, pool, gpu, models), slots in sorted(merged.items(), key=lambda kv: kv[1][0].id):
        groups.append(Group("", resource, 1, pool, gpu, models, len(slots), tuple(s.id for s in slots)))
    # tensor-parallel placements: a pod with tp GPUs; identical ones (replicas of one model) merge
    tp: dict[tuple, list[Placement]] = {}
    by_id = {s.id: s for s in packing.slots}
    for p in packing.placements:
        if len(p.slots) > 1:
            first = by_id[p.slots[0]]
            tp.setdefault((p.model, first.node, first.gpu, len(p.slots)), []).append(p)
    for (model, pool, gpu, n), ps in sorted(tp.items()):
        groups.append(Group("", "nvidia.com/gpu", n, pool, gpu, (model,), len(ps), tuple(s for p in ps for s in p.slots)))
    return [
        Group(f"gpu-{i:02d}", g.resource, g.count, g.pool, g.gpu, g.models, g.replicas, g.slots) for i, g in enumerate(groups, 1)
    ]


def _strict_spread(group: Group, packing: Packing) -> list[dict]:
    """A group serving a tier-1 model spreads its pods over zones with ``DoNotSchedule`` (a pod waits
    rather than doubling up in one zone); the others keep the template's ``ScheduleAnyway``."""
    if not set(group.models) & set(packing.tier_one):
        return []
    op = {"op": "replace", "path": "/spec/template/spec/topologySpreadConstraints/0/whenUnsatisfiable", "value": "DoNotSchedule"}
    return [{"target": {"kind": "Deployment"}, "patch": json.dumps([op])}]


def _dump(obj) -> str:
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, width=120)


def overlay_files(packing: Packing, *, template: str = "../../../../base/triton") -> dict[str, str]:
    """The files of ``deploy/overlays/gpu/packing/``: one kustomization per model group (the Triton
    template with the group's name, models, GPU resource and replica count), a kustomization that
    lists them, and ``model-groups.json`` (the frontends' routing table, merged into the base's
    ConfigMap by the gpu overlay). ``template`` is the Triton template relative to a group folder."""
    groups = groups_of(packing)
    files: dict[str, str] = {}
    header = "# Written by `inferplane plan gpus`; edit the inventory or the models and run it again.\n"
    files["kustomization.yaml"] = header + _dump(
        {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [g.name for g in groups],
        }
    )
    # the frontends' routing table: the base's general group takes every model no GPU group names
    routing: dict[str, dict] = {
        "general": {"service": "triton-general", "grpc_port": 8001, "models": ["*"]},
        "general-spot": {"service": "triton-general-spot", "grpc_port": 8001, "models": ["*"], "capacity": "spot"},  # the base's spot pool
    }
    for g in groups:
        resource, count = g.resource, g.count
        # no `replicas:` (the ScaledObject below holds the group at its packed count) and no model list:
        # the reconciler loads on this group's pods the models model-groups.json gives it
        patch = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "triton", "annotations": {"inferplane.io/slots": " ".join(g.slots)}},
            "spec": {
                "template": {
                    "spec": {
                        "nodeSelector": {"nvidia.com/gpu.product": GPU_TYPES[g.gpu]["product"], "inferplane.io/gpu-pool": g.pool},
                        "tolerations": [GPU_TOLERATION],
                        "containers": [
                            {
                                "name": "triton",
                                "resources": {
                                    "requests": {resource: str(count)},
                                    "limits": {resource: str(count)},
                                },
                            }
                        ],
                    }
                },
            },
        }
        query = (
            f'sum(inferplane_group_queue_depth{{model_group="{g.name}"}}) + '
            f'sum(inferplane_group_inflight_requests{{model_group="{g.name}"}})'
        )
        files[f"{g.name}/kustomization.yaml"] = header + _dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [template],
                "nameSuffix": f"-{g.name}",
                "labels": [{"pairs": {"inferplane.io/model-group": g.name}, "includeSelectors": True, "includeTemplates": True}],
                "patches": [
                    {"path": "group.yaml"},
                    {
                        "target": {"kind": "ScaledObject"},
                        # the packing fixes each group's replica count: KEDA keeps it there
                        "patch": json.dumps(
                            [
                                {"op": "replace", "path": "/spec/triggers/0/metadata/query", "value": query},
                                {"op": "replace", "path": "/spec/minReplicaCount", "value": g.replicas},
                                {"op": "replace", "path": "/spec/maxReplicaCount", "value": g.replicas},
                            ]
                        ),
                    },
                    *_strict_spread(g, packing),
                ],
            }
        )
        files[f"{g.name}/group.yaml"] = header + _dump(patch)
        routing[g.name] = {"service": f"triton-{g.name}", "grpc_port": 8001, "models": list(g.models)}
    files["model-groups.json"] = json.dumps(routing, indent=1, sort_keys=True) + "\n"
    return files
