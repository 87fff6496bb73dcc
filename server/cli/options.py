"""What the ``inferplane`` commands share: the options that reach the running frontend (``URL``,
``ACTOR``, ``API_KEY``), who acts (``actor_name``), durations (``parse_duration``), a listing's
``--json`` or table (``table_wanted``), the one way a command calls the frontend's gRPC
(``frontend``, ``frontend_call``) and the autoscaling options of ``autoscale set`` and ``deploy``
(``MinReplicas`` … ``Tier``, read by ``scaling_options``). Every CLI module takes these
from here; none takes them from another command's module.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import re
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Optional

import typer

DEFAULT_URL = "127.0.0.1:8001"
URL = typer.Option(DEFAULT_URL, "--url", help="The frontend's gRPC address (admin API).")
ACTOR = typer.Option(None, "--actor", help="Who is acting, for the audit log (default: the OS user).")
API_KEY = typer.Option(None, "--api-key", help="Admin API key (with --auth on) [env INFERPLANE_API_KEY].")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


def actor_name(actor: Optional[str]) -> str:
    if actor:
        return actor
    try:
        return getpass.getuser()
    except Exception:  # no user name in this environment
        return "unknown"


def parse_duration(text: str) -> float:
    """``500ms``, ``60s``, ``60``, ``2m``, ``1h`` -> seconds."""
    match = _DURATION.match(text or "")
    if not match:
        raise typer.BadParameter(f"expected a duration like 30s, 2m or 500ms, got {text!r}")
    return float(match.group(1)) * {"ms": 0.001, "s": 1.0, None: 1.0, "m": 60.0, "h": 3600.0}[match.group(2)]


def table_wanted(rows: list, as_json: bool, empty: str) -> bool:
    """Whether a listing command prints ``rows`` as its table: with ``--json`` they are printed as
    JSON, and no rows say ``empty``, instead."""
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return False
    if not rows:
        typer.echo(empty)
        return False
    return True


def call_metadata(actor: Optional[str], api_key: Optional[str]) -> tuple[tuple[str, str], ...]:
    """What every call to the frontend sends: who acts (the audit log) and, with auth on, the API key."""
    metadata = [("x-inferplane-actor", actor_name(actor))]
    if not api_key:
        from server.settings import Settings

        api_key = Settings().api_key.get_secret_value()  # INFERPLANE_API_KEY
    if api_key:
        metadata.append(("authorization", f"Bearer {api_key}"))
    return tuple(metadata)


@contextlib.contextmanager
def frontend(stub_type: Callable[[Any], Any], url: str, actor: Optional[str], api_key: Optional[str]) -> Iterator[Callable[..., Any]]:
    """``call(method, request, timeout)`` on a ``stub_type`` of the running frontend (TLS / mTLS with
    INFERPLANE_CLIENT_TLS_*, ``server.tenancy.tls``), sending ``call_metadata``; a gRPC error ends
    the command with its code and details. The channel closes when the block ends."""
    import grpc

    from server.tenancy.tls import frontend_channel

    channel = frontend_channel(url)
    stub, metadata = stub_type(channel), call_metadata(actor, api_key)

    def call(method: str, request, timeout: float):
        try:
            return getattr(stub, method)(request, metadata=metadata, timeout=timeout)
        except grpc.RpcError as err:
            typer.secho(f"error: {err.code().name}: {err.details()}", err=True, fg="red")
            raise typer.Exit(1) from None

    with channel:
        yield call


def frontend_call(stub_type: Callable[[Any], Any], url: str, actor: Optional[str], api_key: Optional[str], method: str, request, timeout: float):
    """One call through ``frontend``."""
    with frontend(stub_type, url, actor, api_key) as call:
        return call(method, request, timeout)


# ---- autoscaling: `inferplane autoscale set` and `inferplane deploy` -------------------------------


MinReplicas = Annotated[Optional[int], typer.Option(help="Autoscaling: fewest replicas while in use.")]
MaxReplicas = Annotated[Optional[int], typer.Option(help="Autoscaling: most replicas.")]
TargetInflight = Annotated[Optional[float], typer.Option(help="Autoscaling: requests in flight (queue included) per replica to aim at.")]
ScaleToZeroAfter = Annotated[Optional[str], typer.Option(help="Autoscaling: idle time before zero replicas (300s, 5m; never).")]
ColdStartBudget = Annotated[Optional[str], typer.Option(help="Autoscaling: how long a request waits for a load from zero (30s).")]
Tier = Annotated[
    Optional[int], typer.Option(min=1, max=3, help="Availability tier 1|2|3: tier 1 gets >= 2 replicas, spread over zones, on Tritons of its own; 2 and 3 share.")
]


def scaling_options(
    min_replicas: Optional[int] = None,
    max_replicas: Optional[int] = None,
    target_inflight: Optional[float] = None,
    scale_to_zero_after: Optional[str] = None,
    cold_start_budget: Optional[str] = None,
    signal: Optional[str] = None,
    target: Optional[float] = None,
    tier: Optional[int] = None,
) -> dict:
    """The autoscaling fields the flags set (the rest keep the endpoint's or the defaults)."""
    if target_inflight is not None and target is not None:
        raise typer.BadParameter("give --target-inflight or --target, not both")
    out: dict = {}
    if min_replicas is not None:
        out["min_replicas"] = min_replicas
    if max_replicas is not None:
        out["max_replicas"] = max_replicas
    if target_inflight is not None:
        out["target"], out["signal"] = target_inflight, "inflight"
    if target is not None:
        out["target"] = target
    if signal is not None:
        out["signal"] = signal
    if scale_to_zero_after is not None:  # "never" (or 0) turns it off
        out["scale_to_zero_after_s"] = 0.0 if scale_to_zero_after.strip().lower() in ("never", "off") else parse_duration(scale_to_zero_after)
    if cold_start_budget is not None:
        out["cold_start_budget_s"] = parse_duration(cold_start_budget)
    if tier is not None:
        out["tier"] = tier
    return out
