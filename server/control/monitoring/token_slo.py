"""Token-level SLOs of generations (issue 31) and their Prometheus rules (pure).

The requirements: time to first token p50 <= 200 ms and p99 <= 500 ms, inter-token latency p50 <=
30 ms and p99 <= 80 ms. Each percentile objective is a share of good events: "p99 <= 500 ms" is
"at least 99 % of generations see their first token within 500 ms" (error budget 1 %), "p50 <= 200
ms" is "at least half within 200 ms" (budget 50 %). The thresholds are bucket bounds of
``inferplane_time_to_first_token_seconds`` / ``inferplane_inter_token_latency_seconds``
(server.dataplane.metrics), so the recorded ratios are exact.

Alerts: the p99 objectives burn their budget like the request SLOs (server.control.monitoring.slo: 14.4x over
1 h and 5 min, 6x over 6 h and 30 min, 1x over 3 d and 6 h); a 50 % budget cannot burn 6x, so a p50
objective alerts when its median is over the threshold in both the 1 h and the 5 min window.
``deploy/prometheus/inferplane-token-rules.yaml`` is this module's output (``rules_yaml()``), tested
with promtool by ``deploy/prometheus/inferplane-token-rules.test.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from server.control.monitoring.slo import ALERTS, _le, _number
from server.dataplane.metrics import ITL_BUCKETS, TTFT_BUCKETS

RATIO = "inferplane:token_slo_errors:ratio_rate{window}"
BUDGET = "inferplane:token_slo_error_budget"
WINDOWS = ("5m", "30m", "1h", "6h", "3d")
MEDIAN_ALERT = ("InferplaneTokenMedianSlow", "ticket", "1h", "5m", "10m")


@dataclass(frozen=True)
class TokenObjective:
    slo: str  # the label value: ttft_p50 | ttft_p99 | itl_p50 | itl_p99
    metric: str  # the histogram, without _bucket / _count
    threshold_s: float  # a bucket bound of that histogram
    target: float  # the share of events at or under the threshold

    @property
    def budget(self) -> float:
        return 1.0 - self.target


TTFT = "inferplane_time_to_first_token_seconds"
ITL = "inferplane_inter_token_latency_seconds"
OBJECTIVES = (
    TokenObjective("ttft_p50", TTFT, 0.2, 0.5),
    TokenObjective("ttft_p99", TTFT, 0.5, 0.99),
    TokenObjective("itl_p50", ITL, 0.03, 0.5),
    TokenObjective("itl_p99", ITL, 0.08, 0.99),
)
_BOUNDS = {TTFT: TTFT_BUCKETS, ITL: ITL_BUCKETS}


def rules(objectives: tuple[TokenObjective, ...] = OBJECTIVES) -> dict:
    """The rules document (``promtool check rules`` format): per-model error ratios of each token
    objective over each window, their budgets, burn-rate alerts (p99) and median alerts (p50)."""
    for o in objectives:
        if o.threshold_s not in _BOUNDS[o.metric]:
            raise ValueError(f"{o.slo}: {o.threshold_s}s is not a bucket bound of {o.metric}")
    ratios = []
    for w in WINDOWS:
        for o in objectives:
            ratios.append({
                "record": RATIO.format(window=w),
                "expr": (
                    f'1 - sum by (model) (rate({o.metric}_bucket{{le="{_le(o.threshold_s)}"}}[{w}])) '
                    f"/ sum by (model) (rate({o.metric}_count[{w}]))"
                ),
                "labels": {"slo": o.slo},
            })  # fmt: skip
    budgets = [{"record": BUDGET, "expr": _number(o.budget), "labels": {"slo": o.slo}} for o in objectives]
    burnable = "|".join(o.slo for o in objectives if o.budget < 0.1)
    medians = "|".join(o.slo for o in objectives if o.budget >= 0.1)
    alerts = []
    for name, severity, rate, long_w, short_w, hold in ALERTS:
        threshold = f"on (slo) group_left () ({_number(rate)} * {BUDGET})"
        alerts.append({
            "alert": name.replace("InferplaneSLO", "InferplaneTokenSLO"),
            "expr": (
                f'({RATIO.format(window=long_w)}{{slo=~"{burnable}"}} > {threshold})\nand\n'
                f'({RATIO.format(window=short_w)}{{slo=~"{burnable}"}} > {threshold})'
            ),
            "for": hold,
            "labels": {"severity": severity},
            "annotations": {
                "summary": f"{{{{ $labels.model }}}}: {{{{ $labels.slo }}}} error budget burning over {_number(rate)}x ({long_w} and {short_w} windows)",
            },
        })  # fmt: skip
    name, severity, long_w, short_w, hold = MEDIAN_ALERT
    alerts.append({
        "alert": name,
        "expr": (
            f'({RATIO.format(window=long_w)}{{slo=~"{medians}"}} > on (slo) group_left () {BUDGET})\nand\n'
            f'({RATIO.format(window=short_w)}{{slo=~"{medians}"}} > on (slo) group_left () {BUDGET})'
        ),
        "for": hold,
        "labels": {"severity": severity},
        "annotations": {"summary": f"{{{{ $labels.model }}}}: {{{{ $labels.slo }}}} median over its threshold ({long_w} and {short_w} windows)"},
    })  # fmt: skip
    return {
        "groups": [
            {"name": "inferplane-token-slo-ratios", "interval": "30s", "rules": ratios},
            {"name": "inferplane-token-slo-budget", "interval": "30s", "rules": budgets},
            {"name": "inferplane-token-slo-alerts", "rules": alerts},
        ]
    }


def rules_yaml(objectives: tuple[TokenObjective, ...] = OBJECTIVES) -> str:
    header = (
        "# Generated by server/control/monitoring/token_slo.py (rules_yaml); do not edit.\n"
        "# Token objectives: " + "; ".join(f"{o.slo} {o.threshold_s * 1000:g} ms at {o.target:g}" for o in objectives) + "\n"
    )
    return header + yaml.safe_dump(rules(objectives), sort_keys=False, width=200)
