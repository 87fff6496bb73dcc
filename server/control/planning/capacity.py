"""Capacity planning: replicas, GPUs, memory, storage and monthly cost, with the arithmetic shown.

Pure functions over numbers (and the JSON results the load generator writes); no I/O besides
:func:`load_profiles` reading those files. Every function returns a ``Plan``: the figures plus the
lines of arithmetic that produced them, which ``inferplane plan capacity`` prints.

Units: GPU memory, weights and KV cache in GiB (1 GiB = 2**30 bytes: an "80 GB" H100 or A100 holds
80 GiB = 85.9e9 bytes, so counting it as 80e9 bytes would under-plan every GPU by 7 %); artifact
storage in decimal GB (1e9 bytes, as object stores bill it); throughput in requests per second;
money in USD. A month is 730 hours.

Failure domains (issue 29): a fleet spread over ``zones`` zones is sized N+1 — losing any one zone
leaves the others enough replicas at the throughput measured within the p99 SLO — instead of a flat
utilization factor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

HOURS_PER_MONTH = 730.0
GB = 1e9  # storage
GIB = float(1 << 30)  # GPU memory

DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


@dataclass
class Plan:
    title: str
    figures: dict = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.lines.append(line)

    def text(self) -> str:
        return "\n".join([self.title, "=" * len(self.title), *self.lines])


# ---- LLM memory: weights, KV cache, sequences that fit ------------------------------------------


@dataclass(frozen=True)
class LLMShape:
    """A decoder-only transformer's shape (Llama-2/3-70B by default: 80 layers, 8 KV heads with GQA,
    head_dim 128)."""

    name: str = "Llama-70B"
    params: float = 70e9
    layers: int = 80
    kv_heads: int = 8
    head_dim: int = 128

    def weight_bytes(self, dtype: str, group_size: int = 128) -> float:
        """Weights; INT4 adds one FP16 scale per ``group_size`` weights (AWQ/GPTQ style)."""
        per_param = DTYPE_BYTES[dtype]
        if dtype == "int4":
            per_param += 2.0 / group_size
        return self.params * per_param

    def kv_bytes_per_token(self, kv_dtype: str = "fp16") -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[kv_dtype]


def llm_memory(
    shape: LLMShape,
    *,
    dtype: str = "fp16",
    kv_dtype: str = "fp16",
    context: int = 4096,
    gpus: int = 2,
    gpu_memory_gib: float = 80.0,
    headroom: float = 0.10,
) -> Plan:
    """How many sequences of ``context`` tokens fit on ``gpus`` x ``gpu_memory_gib`` with tensor
    parallelism across them, keeping ``headroom`` of each GPU for activations, the CUDA context and
    allocator slack (vLLM's ``gpu_memory_utilization = 1 - headroom``)."""
    if dtype not in DTYPE_BYTES or kv_dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}")
    if gpus < 1 or context < 1 or not 0 <= headroom < 1:
        raise ValueError("gpus and context must be >= 1 and headroom in [0, 1)")
    plan = Plan(f"{shape.name} {dtype.upper()} on {gpus} x {gpu_memory_gib:g} GiB, context {context}")
    weights = shape.weight_bytes(dtype)
    per_token = shape.kv_bytes_per_token(kv_dtype)
    per_seq = per_token * context
    usable = gpus * gpu_memory_gib * GIB * (1 - headroom)
    kv_budget = usable - weights
    sequences = max(0, math.floor(kv_budget / per_seq)) if kv_budget > 0 else 0
    if dtype == "int4":
        plan.say(f"weights: {shape.params / 1e9:g}e9 params x (0.5 B + 2 B scale / 128) = {weights / GIB:.2f} GiB")
    else:
        plan.say(f"weights: {shape.params / 1e9:g}e9 params x {DTYPE_BYTES[dtype]:g} B = {weights / GIB:.2f} GiB")
    plan.say(
        f"KV per token: 2 (K,V) x {shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim} head_dim"
        f" x {DTYPE_BYTES[kv_dtype]:g} B = {per_token:,.0f} B ({per_token / 1024:.0f} KiB)"
    )
    plan.say(f"KV per sequence at {context} tokens: {per_token:,.0f} B x {context} = {per_seq / GIB:.3f} GiB")
    plan.say(
        f"usable: {gpus} x {gpu_memory_gib:g} GiB x (1 - {headroom:g} headroom for activations) = {usable / GIB:.1f} GiB"
    )
    if gpus > 1:
        kv_heads_per_gpu = shape.kv_heads / gpus
        plan.say(
            f"tensor parallel {gpus}: {weights / gpus / GIB:.2f} GiB weights and {kv_heads_per_gpu:g} KV heads per GPU"
            + ("" if shape.kv_heads % gpus == 0 else " (KV heads do not divide: each GPU holds a replicated share)")
        )
    if kv_budget <= 0:
        plan.say(f"KV budget: {usable / GIB:.1f} - {weights / GIB:.2f} = {kv_budget / GIB:.2f} GiB: does not fit")
    else:
        plan.say(
            f"KV budget: {usable / GIB:.1f} - {weights / GIB:.2f} = {kv_budget / GIB:.2f} GiB"
            f" / {per_seq / GIB:.3f} GiB = {sequences} sequences of {context} tokens at once"
        )
    plan.figures = {
        "weights_gib": weights / GIB,
        "kv_bytes_per_token": per_token,
        "kv_gib_per_sequence": per_seq / GIB,
        "usable_gib": usable / GIB,
        "kv_budget_gib": kv_budget / GIB,
        "sequences": sequences,
        "fits": kv_budget > 0 and sequences >= 1,
        "gpus": gpus,
    }
    return plan


# ---- measured profiles ------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """One replica's measured capacity for one model (a loadtest result)."""

    model: str
    throughput_rps: float
    p99_ms: float | None = None
    tokens_per_s: float | None = None
    source: str = ""
    concurrency: int | None = None


def profiles_from_result(data: dict, source: str = "", *, slo_p99_ms: float | None = None) -> list[Profile]:
    """Profiles from a loadtest JSON result: ``python -m loadtest.bench_frontend`` (``models`` ->
    ``compare`` per concurrency; the frontend side), ``loadtest compare`` (``summary.b``),
    ``loadtest run`` (``throughput_rps``), or ``loadtest.llm_bench`` (``levels`` with tokens/s).
    Per model, the best throughput whose p99 meets ``slo_p99_ms`` (any, without an SLO)."""
    found: list[Profile] = []
    if "models" in data and isinstance(data["models"], dict):
        for model, entry in data["models"].items():
            for level, cmp in (entry.get("compare") or {}).items():
                found += _from_compare(cmp, model, f"{source} compare c={level}", int(level))
    elif "summary" in data and "b" in data.get("summary", {}):
        found += _from_compare(data, str(data.get("model", "")), source, (data.get("load") or {}).get("concurrency"))
    elif "levels" in data:
        for level in data["levels"]:
            if level.get("error_count"):
                continue
            requests_per_s = level["requests"] / level["wall_s"] if level.get("wall_s") else 0.0
            found.append(
                Profile(
                    level["model"], requests_per_s, (level.get("ttft_ms") or {}).get("p99"),
                    float(level["tokens_per_s"]), f"{source} c={level['concurrency']}", level.get("concurrency"),
                )
            )  # fmt: skip
    elif "throughput_rps" in data:
        found.append(
            Profile(
                str(data.get("model", "")), float(data["throughput_rps"]), (data.get("latency_ms") or {}).get("p99"),
                data.get("tokens_per_s"), source, data.get("concurrency"),
            )
        )  # fmt: skip
    else:
        raise ValueError(f"{source or 'result'}: not a loadtest result (no models/summary/levels/throughput_rps)")
    best: dict[str, Profile] = {}
    for p in found:
        if slo_p99_ms is not None and (p.p99_ms is None or p.p99_ms > slo_p99_ms):
            continue
        key = p.model
        metric = p.tokens_per_s if p.tokens_per_s is not None else p.throughput_rps
        other = best.get(key)
        if other is None or metric > (other.tokens_per_s if other.tokens_per_s is not None else other.throughput_rps):
            best[key] = p
    return list(best.values())


def _from_compare(cmp: dict, model: str, source: str, concurrency) -> list[Profile]:
    b = cmp["summary"]["b"]
    return [Profile(model or cmp.get("model", ""), b["throughput_rps"]["median"], b["p99_ms"]["median"], None, source, concurrency)]


def load_profiles(paths: list[Path], *, slo_p99_ms: float | None = None) -> dict[str, Profile]:
    out: dict[str, Profile] = {}
    for path in paths:
        for p in profiles_from_result(json.loads(Path(path).read_text()), str(path), slo_p99_ms=slo_p99_ms):
            out[p.model] = p
    return out


# ---- fleet sizing -----------------------------------------------------------------------------


def zone_spread(needed: int, zones: int) -> tuple[int, int]:
    """(replicas per zone, total) so that any ``zones - 1`` zones hold ``needed``: N+1 over zones
    (one zone: no spread, ``needed``)."""
    if needed < 0 or zones < 1:
        raise ValueError("needed must be >= 0 and zones >= 1")
    if zones == 1:
        return needed, needed
    per_zone = math.ceil(needed / (zones - 1))
    return per_zone, per_zone * zones


def replicas_for(
    target_rps: float,
    profile: Profile,
    *,
    utilization: float = 1.0,
    zones: int = 1,
    cores_per_replica: float = 2.0,
    price_per_core_hour: float = 0.04,
    name: str | None = None,
) -> Plan:
    """Replicas for ``target_rps``: each replica runs at ``utilization`` of its measured throughput
    (measured within the p99 SLO: ``load_profiles(slo_p99_ms=...)``), rounded up; over ``zones``
    zones, N+1: enough per zone that losing one zone leaves the rest serving ``target_rps``."""
    if not 0 < utilization <= 1 or target_rps <= 0 or profile.throughput_rps <= 0:
        raise ValueError("target_rps and the measured throughput must be > 0 and utilization in (0, 1]")
    per_replica = profile.throughput_rps * utilization
    needed = math.ceil(target_rps / per_replica - 1e-9)
    per_zone, replicas = zone_spread(needed, zones)
    cores = replicas * cores_per_replica
    monthly = cores * price_per_core_hour * HOURS_PER_MONTH
    plan = Plan(f"{name or profile.model}: {target_rps:,.0f} requests/s")
    plan.say(
        f"measured: {profile.throughput_rps:,.1f} requests/s per replica ({cores_per_replica:g} cores)"
        + (f", p99 {profile.p99_ms:.1f} ms" if profile.p99_ms is not None else "")
        + (f" [{profile.source}]" if profile.source else "")
    )
    plan.say(f"planned per replica: {profile.throughput_rps:,.1f} x {utilization:g} utilization = {per_replica:,.1f} requests/s")
    plan.say(f"replicas: ceil({target_rps:,.0f} / {per_replica:,.1f}) = {needed}")
    if zones > 1:
        plan.say(f"{zones} zones, N+1 (any {zones - 1} carry the load): ceil({needed} / {zones - 1}) = {per_zone} per zone x {zones} = {replicas}")
    plan.say(
        f"cores: {replicas} x {cores_per_replica:g} = {cores:,.0f}; monthly: {cores:,.0f} x ${price_per_core_hour:g}/core-h"
        f" x {HOURS_PER_MONTH:g} h = ${monthly:,.0f}"
    )
    plan.figures = {"per_replica_rps": per_replica, "needed": needed, "per_zone": per_zone, "zones": zones, "replicas": replicas,
                    "cores": cores, "monthly_usd": monthly}  # fmt: skip
    return plan


def llm_streams(
    streams: int,
    shape: LLMShape = LLMShape(),
    *,
    context: int = 4096,
    gpus_per_replica: int = 4,
    gpu_memory_gib: float = 80.0,
    headroom: float = 0.10,
    dtype: str = "fp16",
    zones: int = 1,
    tokens_per_s_per_stream: float | None = None,
    replica_tokens_per_s: float | None = None,
    price_per_gpu_hour: float = 6.98,
) -> Plan:
    """Replicas (each ``gpus_per_replica`` GPUs, tensor parallel) for ``streams`` concurrent streams of
    ``context`` tokens: the larger of the KV-cache bound (sequences that fit, ``llm_memory``) and,
    when given, the decode bound (streams x tokens/s each over one replica's measured tokens/s);
    then N+1 over ``zones``."""
    memory = llm_memory(shape, dtype=dtype, context=context, gpus=gpus_per_replica, gpu_memory_gib=gpu_memory_gib, headroom=headroom)
    per_replica = memory.figures["sequences"]
    if per_replica < 1:
        raise ValueError(f"{shape.name} {dtype} does not fit {gpus_per_replica} x {gpu_memory_gib:g} GiB at context {context}")
    plan = Plan(f"{shape.name}: {streams:,} concurrent streams at {context} tokens")
    plan.lines += memory.lines
    by_memory = math.ceil(streams / per_replica)
    plan.say(f"replicas by KV cache: ceil({streams:,} / {per_replica}) = {by_memory}")
    needed = by_memory
    if tokens_per_s_per_stream is not None and replica_tokens_per_s:
        by_decode = math.ceil(streams * tokens_per_s_per_stream / replica_tokens_per_s - 1e-9)
        plan.say(f"replicas by decode: ceil({streams:,} x {tokens_per_s_per_stream:g} tokens/s / {replica_tokens_per_s:,.0f} tokens/s) = {by_decode}")
        needed = max(needed, by_decode)
    per_zone, replicas = zone_spread(needed, zones)
    if zones > 1:
        plan.say(f"{zones} zones, N+1 (any {zones - 1} carry the load): ceil({needed} / {zones - 1}) = {per_zone} per zone x {zones} = {replicas}")
    gpus = replicas * gpus_per_replica
    monthly = gpus * price_per_gpu_hour * HOURS_PER_MONTH
    plan.say(f"GPUs: {replicas} x {gpus_per_replica} = {gpus:,}; monthly: {gpus:,} x ${price_per_gpu_hour:g}/h x {HOURS_PER_MONTH:g} h = ${monthly:,.0f}")
    plan.figures = {"sequences_per_replica": per_replica, "needed": needed, "per_zone": per_zone, "zones": zones, "replicas": replicas,
                    "gpus": gpus, "monthly_usd": monthly}  # fmt: skip
    return plan


def mix_profile(profiles: list[Profile], name: str = "mix") -> Profile:
    """An even traffic mix over ``profiles``: a replica serving a request of each in turn spends the
    mean of their per-request times, so its throughput is the harmonic mean."""
    if not profiles:
        raise ValueError("no profiles to mix")
    harmonic = len(profiles) / sum(1.0 / p.throughput_rps for p in profiles)
    return Profile(name, harmonic, None, None, "harmonic mean of " + ", ".join(f"{p.model} {p.throughput_rps:,.1f}" for p in profiles))


# ---- storage ----------------------------------------------------------------------------------


def storage(
    versions: int = 500,
    mean_artifact_gb: float = 0.1,
    *,
    variants_per_version: float = 2.0,
    variant_ratio: float = 0.5,
    replication: float = 1.0,
    price_per_gb_month: float = 0.023,
) -> Plan:
    """Artifact store size for ``versions`` registered versions of ``mean_artifact_gb`` each, with
    the optimizer's accepted variants (FP16/INT8 candidates, ``variant_ratio`` of the parent's size)."""
    base = versions * mean_artifact_gb
    variants = versions * variants_per_version * mean_artifact_gb * variant_ratio
    total = (base + variants) * replication
    monthly = total * price_per_gb_month
    plan = Plan(f"storage for {versions} model versions")
    plan.say(f"artifacts: {versions} x {mean_artifact_gb:g} GB = {base:,.1f} GB")
    plan.say(
        f"optimized variants: {versions} x {variants_per_version:g} x {mean_artifact_gb:g} GB x {variant_ratio:g} = {variants:,.1f} GB"
    )
    plan.say(
        f"total: ({base:,.1f} + {variants:,.1f}) x {replication:g} replication = {total:,.1f} GB;"
        f" monthly: x ${price_per_gb_month:g}/GB-month = ${monthly:,.2f}"
    )
    plan.figures = {"artifacts_gb": base, "variants_gb": variants, "total_gb": total, "monthly_usd": monthly}
    return plan


# ---- cost from metering -----------------------------------------------------------------------


def endpoint_costs(
    rows: list[dict],
    *,
    hardware: dict[str, str],
    prices: dict[str, float],
    default_hardware: str = "cpu",
    spot_discount: dict[str, float] | None = None,
    interruptible: set[str] | frozenset[str] = frozenset(),
) -> Plan:
    """GPU-hours and dollars per endpoint (model) and team from metered usage rows
    (``TenancyStore.usage("team_model", ...)``: ``team``, ``model``, ``compute_us``), and what
    running the ``interruptible`` endpoints (batch, shadow) on spot capacity would save:
    ``spot_discount[hardware]`` is the fraction of the on-demand price a spot hour saves."""
    spot_discount = spot_discount or {}
    plan = Plan("cost by endpoint and team")
    by_endpoint: dict[str, dict] = {}
    by_team: dict[str, dict] = {}
    savings = 0.0
    for row in rows:
        model, team = row["model"], row.get("team", "")
        hw = hardware.get(model, default_hardware)
        if hw not in prices:
            raise ValueError(f"no price for hardware {hw!r} of {model} (prices: {', '.join(sorted(prices))})")
        hours = row["compute_us"] / 3.6e9
        usd = hours * prices[hw]
        e = by_endpoint.setdefault(model, {"model": model, "hardware": hw, "device_hours": 0.0, "usd": 0.0, "spot_usd": None})
        e["device_hours"] += hours
        e["usd"] += usd
        t = by_team.setdefault(team, {"team": team, "device_hours": 0.0, "usd": 0.0})
        t["device_hours"] += hours
        t["usd"] += usd
        if model in interruptible:
            saved = usd * spot_discount.get(hw, 0.0)
            savings += saved
            e["spot_usd"] = (e["spot_usd"] or 0.0) + usd - saved
    for e in sorted(by_endpoint.values(), key=lambda e: e["model"]):
        spot = "" if e["spot_usd"] is None else f"; on spot ${e['spot_usd']:,.4f}"
        plan.say(
            f"{e['model']:<24} {e['hardware']:<6} {e['device_hours']:>12.6f} device-h x ${prices[e['hardware']]:g}"
            f" = ${e['usd']:,.4f}{spot}"
        )
    for t in sorted(by_team.values(), key=lambda t: t["team"]):
        plan.say(f"team {t['team'] or '-':<19} {t['device_hours']:>12.6f} device-h = ${t['usd']:,.4f}")
    plan.say(f"spot for {', '.join(sorted(interruptible)) or 'no endpoint'}: saves ${savings:,.4f}")
    plan.figures = {
        "endpoints": sorted(by_endpoint.values(), key=lambda e: e["model"]),
        "teams": sorted(by_team.values(), key=lambda t: t["team"]),
        "spot_savings_usd": savings,
    }
    return plan


# ---- the worked examples ----------------------------------------------------------------------


def example_70b(
    *, context: int = 4096, headroom: float = 0.10, gpu_memory_gib: float = 80.0, price_per_gpu_hour: float = 6.98,
    streams: int = 10_000, zones: int = 3,
) -> list[Plan]:  # fmt: skip
    """The requirement documents' 70B example: FP16 on 2 and 4 GPUs, INT4 on one; then ``streams``
    concurrent streams of it on 4-GPU FP16 replicas over ``zones`` zones (N+1)."""
    shape = LLMShape()
    plans = [
        llm_memory(shape, dtype="fp16", context=context, gpus=2, gpu_memory_gib=gpu_memory_gib, headroom=headroom),
        llm_memory(shape, dtype="fp16", context=context, gpus=4, gpu_memory_gib=gpu_memory_gib, headroom=headroom),
        llm_memory(shape, dtype="fp16", context=context, gpus=1, gpu_memory_gib=gpu_memory_gib, headroom=headroom),
        llm_memory(shape, dtype="int4", context=context, gpus=1, gpu_memory_gib=gpu_memory_gib, headroom=headroom),
    ]
    for p in plans:
        monthly = p.figures["gpus"] * price_per_gpu_hour * HOURS_PER_MONTH
        p.figures["monthly_usd"] = monthly
        p.say(f"monthly: {p.figures['gpus']} GPU x ${price_per_gpu_hour:g}/h x {HOURS_PER_MONTH:g} h = ${monthly:,.0f}")
    plans.append(
        llm_streams(streams, shape, context=context, gpus_per_replica=4, gpu_memory_gib=gpu_memory_gib, headroom=headroom, zones=zones,
                    price_per_gpu_hour=price_per_gpu_hour)  # fmt: skip
    )
    return plans


def example_fleet(
    profiles: dict[str, Profile],
    *,
    aggregate_rps: float = 2_000_000,
    tree_rps: float = 50_000,
    tree_model: str = "fraud_xgboost",
    utilization: float = 1.0,
    zones: int = 3,
    cores_per_replica: float = 2.0,
    price_per_core_hour: float = 0.04,
    versions: int = 500,
) -> list[Plan]:
    """2,000,000 requests/s across the fleet (an even mix of the measured models), a 50,000
    requests/s tree endpoint, over ``zones`` zones N+1, and storage for 500 model versions."""
    if tree_model not in profiles:
        raise ValueError(f"no measured profile for {tree_model} (have: {', '.join(sorted(profiles)) or 'none'})")
    kw = dict(utilization=utilization, zones=zones, cores_per_replica=cores_per_replica, price_per_core_hour=price_per_core_hour)
    mix = mix_profile(sorted(profiles.values(), key=lambda p: p.model))
    return [
        replicas_for(aggregate_rps, mix, name="fleet (even mix of the measured models)", **kw),
        replicas_for(tree_rps, profiles[tree_model], name=f"tree endpoint {tree_model}", **kw),
        storage(versions),
    ]
