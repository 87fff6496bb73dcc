"""``loadtest.hop_floor``'s pure parts: the bare servers' commands and options, and the report's ratios."""

from __future__ import annotations

import argparse
import sys

import pytest

from loadtest.hop_floor import VARIANTS, report, variant_command
from loadtest.naive_proxy import parse_option


def test_an_option_is_a_grpc_channel_argument_integer_when_it_reads_as_one():
    assert parse_option("grpc.so_reuseport=0") == ("grpc.so_reuseport", 0)
    assert parse_option("grpc.optimization_target=latency") == ("grpc.optimization_target", "latency")
    assert parse_option("k=-3") == ("k", -3)
    for bad in ("novalue", "=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_option(bad)


def test_a_variant_runs_the_naive_proxy_in_its_labels_mode_with_its_arguments():
    cmd = variant_command("proxy-latency", "127.0.0.1:9")
    assert cmd[:3] == [sys.executable, "-m", "loadtest.naive_proxy"]
    assert cmd[cmd.index("--mode") + 1] == "proxy" and cmd[cmd.index("--triton") + 1] == "127.0.0.1:9"
    assert cmd[-2:] == ["--option", "grpc.optimization_target=latency"]
    assert variant_command("canned", "t")[variant_command("canned", "t").index("--mode") + 1] == "canned"
    assert {label.split("-", 1)[0] for label in VARIANTS} == {"canned", "proxy"}


def _summary(p50: float) -> dict:
    return {"p50": p50, "p99": 2 * p50, "mean": p50}


def test_the_report_gives_each_variant_against_its_default_and_what_each_target_adds_over_direct():
    targets = {"direct": 1.0, "canned": 0.5, "canned-latency": 0.4, "proxy": 2.0, "proxy-asyncio": 2.5, "frontend-untimed": 3.3, "frontend": 3.0}
    result = {
        "model": "m", "requests": 10,
        "targets": {label: _summary(v) for label, v in targets.items()},
        "added_ms": {label: {"p50": v - 1.0, "p99": 2 * (v - 1.0)} for label, v in targets.items() if label != "direct"},
        "stages": {"frontend": {"outside": _summary(1.25)}},
    }  # fmt: skip
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in report(result, "cmd", "load").splitlines() if line.startswith("| ")}
    assert rows["canned-latency"][-1].strip(" |") == "0.800" and rows["proxy-asyncio"][-1].strip(" |") == "1.250"
    assert rows["frontend-untimed"][-1].strip(" |") == "1.100"
    assert rows["canned"][-1].strip(" |") == "" and rows["direct"][4] == "—"
    assert rows["proxy"][4] == "1.000" and rows["proxy"][5] == "2.000"  # added over direct, p50 / p99
    assert rows["outside"][1:] == ["1.250", "1.250 |"]
