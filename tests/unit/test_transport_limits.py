"""The edge's field checks (``server.transports.limits``) and the timeout clamp, as pure functions."""

from __future__ import annotations

import json
import math

import pytest

from server.errors import InvalidRequest
from server.tenancy.identity import MAX_TIMEOUT_S, CallContext, clamp_timeout
from server.transports import limits


@pytest.mark.parametrize(
    ("value", "kind", "low", "high"),
    [
        (2**65, int, 1, limits.MAX_TOKENS),
        (int("9" * 400), int, 1, limits.MAX_TOKENS),
        (int("9" * 400), float, 0.0, 2.0),  # float() of it would overflow: compared exactly instead
        (float("nan"), float, 0.0, 2.0),
        (float("inf"), float, None, None),
        (1.5, int, None, None),
        (True, int, None, None),
        ("3", int, None, None),
        (-(2**63) - 1, int, *limits.SEED),
    ],
)
def test_numbers_out_of_their_field_are_invalid_naming_it(value, kind, low, high):
    with pytest.raises(InvalidRequest) as err:
        limits.number(value, "the_field", kind, low, high)
    assert err.value.violations[0].field == "the_field"
    assert len(err.value.message) < 120  # never the 400 digits


def test_numbers_in_range_convert():
    assert limits.number(None, "x") is None
    assert limits.number(3.0, "x", int, 1, 4) == 3 and isinstance(limits.number(3.0, "x", int), int)
    assert limits.number(2, "x", float, 0.0, 2.0) == 2.0
    assert limits.number(2**63 - 1, "seed", int, *limits.SEED) == 2**63 - 1


def test_lone_surrogates_are_named_by_their_path():
    doc = json.loads('{"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "a\\ud800"}]}')
    with pytest.raises(InvalidRequest) as err:
        limits.check_document(doc)
    assert err.value.violations[0].field == "messages[1].content"
    with pytest.raises(InvalidRequest):
        limits.check_document(json.loads('{"\\udfff": 1}'))
    deep: list = ["fine"]
    for _ in range(5000):  # deeper than Python's recursion limit: the walk is iterative
        deep = [deep]
    limits.check_document({"emoji": json.loads('"\\ud83d\\ude00"'), "deep": deep})  # a surrogate pair is fine


def test_the_raw_scan_skips_documents_without_surrogate_escapes():
    doc = {"data": ["\ud800"]}  # not from these bytes: the scan says there is nothing to walk
    limits.check_json(b'{"data": [1, 2, 3]}', doc)
    with pytest.raises(InvalidRequest):
        limits.check_json(b'{"data": ["\\ud800"]}', doc)


@pytest.mark.parametrize("value", ["1e10", "inf", "Infinity", "1e300", str(10**30)])
def test_huge_request_timeouts_are_clamped(value):
    assert CallContext.from_headers({"x-request-timeout": value}).timeout == MAX_TIMEOUT_S
    assert CallContext.from_headers({"x-request-timeout": value}, max_timeout_s=30.0).timeout == 30.0


@pytest.mark.parametrize("value", ["nan", "NaN", "0", "-1", "-inf", "abc", "", "\udcff"])
def test_request_timeouts_that_are_not_seconds_are_invalid(value):
    with pytest.raises(InvalidRequest) as err:
        CallContext.from_headers({"x-request-timeout": value})
    assert err.value.violations[0].field == "x-request-timeout"


def test_clamp_timeout():
    assert clamp_timeout(None) is None
    assert clamp_timeout(2.5) == 2.5
    assert clamp_timeout(math.inf) == MAX_TIMEOUT_S
