"""The built-in status page of the REST bridge: ``GET /status`` (HTML, refreshes itself) and
``GET /status.json`` (what it draws).

Per endpoint: request rate, error rate, p50 / p99 latency over the last minute, the versions and the
replicas serving it, the SLO budget left (availability and latency), and small inline charts (SVG
sparklines of rate and p99 over the last ten minutes). Numbers come from the same counters as
/metrics (all worker processes summed), sampled by ``server.control.monitoring.observability.History``.
"""

from __future__ import annotations

from aiohttp import web

from server.control.monitoring import slo
from server.errors import BackendUnavailable
from server.transports.rest.appkeys import DATAPLANE
from server.transports.rest.openapi import JSON, Body, Route, error_responses, json_body
from server.transports.rest import codec as rest_codec

STATUS: web.AppKey = web.AppKey("observability", object)


def status_document(observability, dataplane) -> dict:
    history = observability.history
    budgets: dict[str, dict] = {}
    for row in slo.statuses_from_metrics(observability.metrics.render().decode()):
        budgets.setdefault(row["model"], {})[row["slo"]] = row
    endpoints = []
    for name in dataplane.names():
        signature = dataplane.signature(name)
        summary = history.summary(name)
        endpoints.append({
            "model": name,
            "ready": signature is not None,
            "versions": sorted(signature.versions) if signature is not None else [],
            "live_version": dataplane.live_version(name) or (signature.latest_version if signature is not None else ""),
            "replicas": [dataplane.backend_target],
            "instances": signature.instances if signature is not None else 0,
            **summary,
            "error_ratio": (summary["errors_per_s"] / summary["rps"]) if summary["rps"] else None,
            "slo": budgets.get(name, {}),
            "series": history.series(name),
        })  # fmt: skip
    return {"endpoints": endpoints, "points": len(history.points)}


async def status_json(request: web.Request) -> web.Response:
    observability = request.app.get(STATUS)
    if observability is None:
        raise BackendUnavailable("the status page's history is not running in this process", retry_after_s=5.0)
    document = status_document(observability, request.app[DATAPLANE])
    return web.Response(body=rest_codec.dumps(document), content_type=JSON)


async def status_page(request: web.Request) -> web.Response:
    return web.Response(text=PAGE, content_type="text/html")


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>inferplane status</title>
<style>
 body{font:14px system-ui,sans-serif;margin:24px;color:#1d2330;background:#f7f8fa}
 h1{font-size:20px;margin:0 0 4px} .sub{color:#667;margin-bottom:16px}
 table{border-collapse:collapse;background:#fff;box-shadow:0 1px 3px #0002}
 th,td{padding:8px 12px;border-bottom:1px solid #e4e6eb;text-align:right;white-space:nowrap}
 th{background:#eef0f4;font-weight:600} td.name,th.name{text-align:left}
 .ok{color:#18794e} .warn{color:#b25e09} .bad{color:#c62a2f}
 svg{vertical-align:middle} .rate{stroke:#2f6fde} .p99{stroke:#d9480f}
</style></head>
<body>
<h1>inferplane status</h1>
<div class="sub" id="sub">loading&hellip;</div>
<table id="endpoints"><thead><tr>
 <th class="name">endpoint</th><th>version</th><th>replicas</th><th>rate /s</th><th>errors</th><th>p50 ms</th><th>p99 ms</th>
 <th>availability budget</th><th>latency budget</th><th>rate (10 min)</th><th>p99 (10 min)</th>
</tr></thead><tbody></tbody></table>
<script>
function fmt(v, d){ return (v === null || v === undefined) ? "&ndash;" : Number(v).toFixed(d); }
function budget(s){
  if(!s) return "&ndash;";
  var v = s.budget_remaining, cls = v > 0.5 ? "ok" : (v > 0 ? "warn" : "bad");
  return '<span class="' + cls + '" data-budget="' + v + '">' + (100 * v).toFixed(1) + "%</span>";
}
function spark(series, key, cls){
  var w = 160, h = 32, vals = series.map(function(p){ return p[key] === null ? 0 : p[key]; });
  if(vals.length < 2) return '<svg width="' + w + '" height="' + h + '"></svg>';
  var max = Math.max.apply(null, vals) || 1, step = w / (vals.length - 1);
  var pts = vals.map(function(v, i){ return (i * step).toFixed(1) + "," + (h - 2 - (h - 4) * v / max).toFixed(1); }).join(" ");
  return '<svg width="' + w + '" height="' + h + '" class="chart" data-points="' + vals.length + '"><polyline class="' + cls +
         '" fill="none" stroke-width="2" points="' + pts + '"/></svg>';
}
function render(doc){
  var rows = doc.endpoints.map(function(e){
    var errors = e.error_ratio === null ? "&ndash;" : (100 * e.error_ratio).toFixed(2) + "%";
    return '<tr data-model="' + e.model + '"><td class="name">' + e.model + '</td><td>' + (e.live_version || "&ndash;") +
      '</td><td title="' + e.replicas.join(", ") + '">' + e.replicas.length + ' &times; ' + e.instances + '</td><td class="rps">' + fmt(e.rps, 1) +
      '</td><td>' + errors + '</td><td>' + fmt(e.p50_ms, 2) + '</td><td class="p99">' + fmt(e.p99_ms, 2) + '</td><td>' + budget(e.slo.availability) +
      '</td><td>' + budget(e.slo.latency) + '</td><td>' + spark(e.series, "rps", "rate") + '</td><td>' + spark(e.series, "p99_ms", "p99") + '</td></tr>';
  });
  document.querySelector("#endpoints tbody").innerHTML = rows.join("");
  document.getElementById("sub").textContent = doc.endpoints.length + " endpoints, " + doc.points + " samples, updated " + new Date().toLocaleTimeString();
  document.body.setAttribute("data-rendered", "1");
}
function load(){ fetch("status.json").then(function(r){ return r.json(); }).then(render).catch(function(err){
  document.getElementById("sub").textContent = "cannot read status.json: " + err; }); }
load(); setInterval(load, 5000);
</script>
</body></html>
"""

_HTML = "text/html"
_SCHEMA = {"type": "object", "required": ["endpoints", "points"],
           "properties": {"endpoints": {"type": "array", "items": {"type": "object"}}, "points": {"type": "integer"}}}
ROUTES: list[Route] = [
    Route("GET", "/status", status_page, "status_page", "Status page: per endpoint rate, latency, errors, replicas, SLO budget, charts",
          "operations", {200: Body("HTML page", {_HTML: {"schema": {"type": "string"}}})} | error_responses()),
    Route("GET", "/status.json", status_json, "status_json", "What the status page draws", "operations",
          {200: json_body("Per endpoint status", _SCHEMA)} | error_responses(503)),
]  # fmt: skip
