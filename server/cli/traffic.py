"""CLI for traffic management, talking to the running frontend's ``inferplane.v1.Traffic`` gRPC.

```
inferplane canary NAME:VERSION --percent 5 [--step 5,25,50,100 --interval 60s --window 60s]
inferplane traffic status|promote|rollback NAME
inferplane bluegreen stage NAME:VERSION | switch NAME
inferplane ab start NAME --arm control=1:50 --arm treatment=2:50 --key-header x-user-id
inferplane ab report|stop NAME
inferplane shadow start NAME:VERSION [--percent 10] | report NAME | stop NAME
inferplane feedback NAME REQUEST_ID VALUE
```
Heavy imports happen inside the commands, so ``inferplane --help`` stays fast.
"""

from __future__ import annotations

import json
from typing import Optional

import typer

from server.cli.options import ACTOR, API_KEY, URL, frontend_call, parse_duration

traffic_app = typer.Typer(help="Traffic of a deployed endpoint: status, promote, rollback.", no_args_is_help=True)
bluegreen_app = typer.Typer(help="Blue-green: stage a version beside the live one, then switch at once.", no_args_is_help=True)
ab_app = typer.Typer(help="A/B experiments: sticky arms by caller key, outcomes, significance report.", no_args_is_help=True)
shadow_app = typer.Typer(help="Shadow traffic: copies to a version whose answers are compared, never returned.", no_args_is_help=True)


def mount(app: typer.Typer) -> None:
    app.command("canary")(canary)
    app.command("feedback")(feedback)
    app.add_typer(traffic_app, name="traffic")
    app.add_typer(bluegreen_app, name="bluegreen")
    app.add_typer(ab_app, name="ab")
    app.add_typer(shadow_app, name="shadow")


def parse_ref(ref: str) -> tuple[str, int]:
    name, sep, version = ref.rpartition(":")
    if not sep or not name or not version.isdigit():
        raise typer.BadParameter(f"expected NAME:VERSION, got {ref!r}")
    return name, int(version)


def parse_arm(text: str) -> tuple[str, int, float]:
    """``NAME=VERSION:WEIGHT`` (weight defaults to 1)."""
    arm, sep, rest = text.partition("=")
    version, _, weight = rest.partition(":")
    try:
        if not sep or not arm or not version.isdigit():
            raise ValueError
        return arm, int(version), float(weight or 1.0)
    except ValueError:
        raise typer.BadParameter(f"an arm is NAME=VERSION[:WEIGHT], got {text!r}") from None


def _call(url: str, actor: Optional[str], api_key: Optional[str], method: str, request, timeout: float = 300.0):
    from server.protogen.inferplane.v1 import traffic_pb2_grpc

    return frontend_call(traffic_pb2_grpc.TrafficStub, url, actor, api_key, method, request, timeout)


def _print_policy(response) -> None:
    p = response.policy
    typer.echo(f"{p.name}: live={p.live or '-'} kind={p.kind} status={p.status or '-'}" + (f" — {p.message}" if p.message else ""))
    if p.kind == "canary":
        typer.echo(f"  step {p.step + 1}/{len(p.steps)} of {list(p.steps)} every {p.interval_s:g}s")
    for a in p.arms:
        typer.echo(
            f"  arm {a.name}: {p.name}:{a.version} weight {a.weight:g}; window {a.window_requests} requests, "
            f"{a.window_errors} errors, p99 {a.window_p99_ms:.2f} ms"
        )
    if p.green:
        typer.echo(f"  green: {p.name}:{p.green}")
    if p.verdict:
        typer.echo(f"  verdict: {p.verdict}")
    if p.shadow_version:
        typer.echo(f"  shadow: {p.name}:{p.shadow_version} ({p.shadow_percent:g}% of requests)")


# ---- canary ----------------------------------------------------------------------------------


def canary(
    ref: str = typer.Argument(..., help="NAME:VERSION of the canary (registered; the endpoint has a live version)."),
    percent: float = typer.Option(5.0, help="Share of requests to the canary at the first step."),
    step: Optional[str] = typer.Option(None, "--step", help="Percent steps, e.g. 5,25,50,100; promotion follows the last."),
    interval: str = typer.Option("60s", help="How long each step must pass before the next (30s, 2m)."),
    window: str = typer.Option("60s", help="The analysis window."),
    min_samples: Optional[int] = typer.Option(None, help="Canary requests in the window before any verdict (default 50)."),
    max_error_rate: Optional[float] = typer.Option(None, help="Absolute error-rate limit, 0..1 (default 0.05)."),
    max_error_increase: Optional[float] = typer.Option(None, help="Limit of canary minus stable error rate (default 0.02)."),
    max_p99_ms: Optional[float] = typer.Option(None, help="Absolute p99 limit in ms (default 1000)."),
    max_p99_ratio: Optional[float] = typer.Option(None, help="Limit of canary p99 / stable p99 (default 2)."),
    key_header: str = typer.Option("", help="Sticky on this caller header (e.g. x-user-id)."),
    url: str = URL,
    actor: Optional[str] = ACTOR,
    api_key: Optional[str] = API_KEY,
) -> None:
    """Start a canary: load and warm VERSION beside the live one, then split traffic with analysis."""
    from server.protogen.inferplane.v1 import traffic_pb2 as tpb

    name, version = parse_ref(ref)
    try:
        steps = [float(s) for s in step.split(",") if s.strip()] if step else []
    except ValueError:
        raise typer.BadParameter(f"--step: expected percentages like 5,25,50,100, got {step!r}") from None
    thresholds = tpb.CanaryThresholds()
    for field, value in (("min_samples", min_samples), ("max_error_rate", max_error_rate), ("max_error_increase", max_error_increase),
                         ("max_p99_ms", max_p99_ms), ("max_p99_ratio", max_p99_ratio)):  # fmt: skip
        if value is not None:
            setattr(thresholds, field, value)
    request = tpb.SetCanaryRequest(
        name=name, version=version, percent=percent, steps=steps, interval_s=parse_duration(interval),
        window_s=parse_duration(window), thresholds=thresholds, key_header=key_header,
    )  # fmt: skip
    _print_policy(_call(url, actor, api_key, "SetCanary", request))


@traffic_app.command("status")
def traffic_status(name: str = typer.Argument(...), url: str = URL, actor: Optional[str] = ACTOR, api_key: Optional[str] = API_KEY) -> None:
    """The endpoint's split, arms with their window figures, the latest verdict, the shadow."""
    from server.protogen.inferplane.v1 import traffic_pb2 as tpb

    _print_policy(_call(url, actor, api_key, "GetPolicy", tpb.GetPolicyRequest(name=name), 30))


@traffic_app.command("promote")
def traffic_promote(name: str = typer.Argument(...), url: str = URL, actor: Optional[str] = ACTOR, api_key: Optional[str] = API_KEY) -> None:
    """Make the canary (or blue-green green) live now."""
    from server.protogen.inferplane.v1 import traffic_pb2 as tpb

    _print_policy(_call(url, actor, api_key, "Promote", tpb.PromoteRequest(name=name)))


@traffic_app.command("rollback")
def traffic_rollback(name: str = typer.Argument(...), url: str = URL, actor: Optional[str] = ACTOR, api_key: Optional[str] = API_KEY) -> None:
    """End the endpoint's canary / blue-green / experiment: all traffic to the live version."""
    from server.protogen.inferplane.v1 import traffic_pb2 as tpb

    _print_policy(_call(url, actor, api_key, "Rollback", tpb.TrafficRollbackRequest(name=name)))


# ---- blue-green ------------------------------------------------------------------------------


@bluegreen_app.command("stage")
def bluegreen_stage(ref: str = typer.Argument(..., help="NAME:VERSION of green."), url: str = URL, actor: Optional[str] = ACTOR, api_key: Optional[str] = API_KEY) -> None:
    """Load and warm green beside the live (blue) version; no traffic moves."""
    from server.protogen.inferplane.v1 import traffic_pb2 as tpb

    name, version = parse_ref(ref)
    _print_policy(_call(url, actor, api_key, "SetBlueGreen", tpb.SetBlueGreenRequest(name=name, version=version)))


@bluegreen_app.command("switch")
def bluegreen_switch(name: str = typer.Argument(...), url: str = URL, actor: Optional[str] = ACTOR, api_key: Optional[str] = API_KEY) -> None:
    """Health-check green, then move all traffic to it at once (blue stays warm for the grace period)."""
    from server.protogen.inferplane.v1 import traffic_pb2 as tpb

    _print_policy(_call(url, actor, api_key, "Switch", tpb.SwitchRequest(name=name)))


# ---- A/B -------------------------------------------------------------------------------------


@ab_app.command("start")
def ab_start(
    name: str = typer.Argument(...),
    arm: list[str] = typer.Option(..., "--arm", help="NAME=VERSION[:WEIGHT]; the first arm is the control."),
    key_header: str = typer.Option("x-user-id", help="The caller key header arms stick to."),
    experiment: str = typer.Option("", help="The experiment's name (default: the endpoint's)."),
    url: str = URL,
    actor: Optional[str] = ACTOR,
    api_key: Optional[str] = API_KEY,
) -> None:
    """Start an experiment: two or more weighted arms, sticky by caller key."""
    from server.protogen.inferplane.v1 import traffic_pb2 as tpb

    arms = [tpb.ExperimentArm(name=a, version=v, weight=w) for a, v, w in (parse_arm(x) for x in arm)]
    request = tpb.SetExperimentRequest(name=name, experiment=experiment, arms=arms, key_header=key_header)
    _print_policy(_call(url, actor, api_key, "SetExperiment", request))


@ab_app.command("report")
def ab_report(
    name: str = typer.Argument(...),
    alpha: float = typer.Option(0.05, help="Significance level."),
    as_json: bool = typer.Option(False, "--json", help="The report as JSON."),
    url: str = URL,
    actor: Optional[str] = ACTOR,
    api_key: Optional[str] = API_KEY,
) -> None:
    """Each arm's figures and significance tests against the control (the first arm)."""
    from google.protobuf.json_format import MessageToDict

    from server.protogen.inferplane.v1 import traffic_pb2 as tpb

    report = _call(url, actor, api_key, "AbReport", tpb.AbReportRequest(name=name, alpha=alpha), 60)
    if as_json:
        typer.echo(json.dumps(MessageToDict(report, preserving_proto_field_name=True, always_print_fields_with_no_presence=True), indent=2))
        return
    typer.echo(f"experiment {report.experiment} on {report.name}")
    typer.echo("arm\tversion\tweight\trequests\terrors\terror_rate\tp50_ms\tp99_ms\toutcomes\toutcome_mean")
    for a in report.arms:
        typer.echo(
            f"{a.name}\t{a.version}\t{a.weight:g}\t{a.requests}\t{a.errors}\t{a.error_rate:.4f}\t{a.latency_p50_ms:.2f}\t"
            f"{a.latency_p99_ms:.2f}\t{a.outcomes}\t{a.outcome_mean:.4f}"
        )
    for c in report.comparisons:
        verdict = "SIGNIFICANT" if c.significant else "not significant"
        typer.echo(
            f"{c.arm} vs {c.control} [{c.metric}, {c.test}]: effect {c.effect:+.4g} "
            f"({c.confidence:.0%} CI {c.ci_low:+.4g} .. {c.ci_high:+.4g}), p={c.p_value:.4g}: {verdict}"
        )


@ab_app.command("stop")
def ab_stop(name: str = typer.Argument(...), url: str = URL, actor: Optional[str] = ACTOR, api_key: Optional[str] = API_KEY) -> None:
    """End the experiment (its report stays available): all traffic to the live version."""
    traffic_rollback(name, url, actor, api_key)


def feedback(
    name: str = typer.Argument(..., help="Endpoint name."),
    request_id: str = typer.Argument(..., help="The request's id (ModelInferRequest.id or its x-request-id header)."),
    value: float = typer.Argument(..., help="The outcome: 0/1 for conversions, any number for continuous metrics."),
    url: str = URL,
    actor: Optional[str] = ACTOR,
    api_key: Optional[str] = API_KEY,
) -> None:
    """Record an experiment outcome for one request."""
    from server.protogen.inferplane.v1 import traffic_pb2 as tpb

    response = _call(url, actor, api_key, "Feedback", tpb.FeedbackRequest(name=name, request_id=request_id, value=value), 30)
    typer.echo(f"{name} request {request_id}: outcome {value:g} recorded for arm {response.arm}")


# ---- shadow ----------------------------------------------------------------------------------


@shadow_app.command("start")
def shadow_start(
    ref: str = typer.Argument(..., help="NAME:VERSION of the shadow."),
    percent: float = typer.Option(100.0, help="Share of requests copied."),
    url: str = URL,
    actor: Optional[str] = ACTOR,
    api_key: Optional[str] = API_KEY,
) -> None:
    """Copy requests to a shadow version; its answers are compared with the primary's, never returned."""
    from server.protogen.inferplane.v1 import traffic_pb2 as tpb

    name, version = parse_ref(ref)
    _print_policy(_call(url, actor, api_key, "SetShadow", tpb.SetShadowRequest(name=name, version=version, percent=percent)))


@shadow_app.command("stop")
def shadow_stop(name: str = typer.Argument(...), url: str = URL, actor: Optional[str] = ACTOR, api_key: Optional[str] = API_KEY) -> None:
    from server.protogen.inferplane.v1 import traffic_pb2 as tpb

    _print_policy(_call(url, actor, api_key, "SetShadow", tpb.SetShadowRequest(name=name, percent=0)))


@shadow_app.command("report")
def shadow_report(name: str = typer.Argument(...), url: str = URL, actor: Optional[str] = ACTOR, api_key: Optional[str] = API_KEY) -> None:
    """Copies sent, dropped and failed; agreement, mean abs diff and latency delta against the primary."""
    from server.protogen.inferplane.v1 import traffic_pb2 as tpb

    r = _call(url, actor, api_key, "ShadowReport", tpb.ShadowReportRequest(name=name), 30)
    typer.echo(
        f"shadow {r.name}:{r.version} ({r.percent:g}%): sent {r.sent}, dropped {r.dropped}, errors {r.errors}, compared {r.compared}; "
        f"agreement {r.agreement:.2%}, mean abs diff {r.mean_abs_diff:.4g}, latency delta mean {r.latency_delta_mean_ms:+.2f} ms "
        f"(p50 {r.latency_delta_p50_ms:+.2f}, p99 {r.latency_delta_p99_ms:+.2f})" + (f"; last error: {r.last_error}" if r.last_error else "")
    )
