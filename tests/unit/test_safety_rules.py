"""The rule-based safety filters: PII detectors with their checksums, actions, and streams checked
across chunk boundaries (pure logic; the stage on the real stack is tests/integration/test_security.py)."""

from __future__ import annotations

import pytest

from server.dataplane.safety import SafetyPolicy
from server.dataplane.safety_rules import (
    BLOCK,
    FLAG,
    REDACT,
    PolicyError,
    StreamScanner,
    compile_screen,
    find_pii,
    iban_valid,
    luhn_valid,
)

CARD = "4111 1111 1111 1111"  # a test Visa number: passes Luhn
CARD_BAD = "4111 1111 1111 1112"  # one digit off: fails Luhn
IBAN = "GB82 WEST 1234 5698 7654 32"  # the ISO 13616 example
IBAN_BAD = "GB82 WEST 1234 5698 7654 33"


def test_luhn_and_mod97():
    assert luhn_valid(CARD.replace(" ", "")) and not luhn_valid(CARD_BAD.replace(" ", ""))
    assert luhn_valid("79927398713") and not luhn_valid("79927398710")
    assert iban_valid(IBAN) and iban_valid("DE89370400440532013000")
    assert not iban_valid(IBAN_BAD) and not iban_valid("DE8937040044053201300")  # wrong length for DE


@pytest.mark.parametrize(
    ("text", "kinds"),
    [
        ("write to jane.doe+news@example.co.uk today", ["email"]),
        (f"card {CARD} exp 12/29", ["card"]),
        (f"card {CARD_BAD} exp 12/29", []),  # not a card (Luhn fails), too long for a phone
        (f"pay to {IBAN} please", ["iban"]),
        (f"pay to {IBAN_BAD} please", []),
        ("call me at +44 20 7946 0958 or (555) 123-4567", ["phone", "phone"]),
        ("order 12345678901 shipped", []),  # a bare run of digits is an id, not a phone
        ("version 1.2.3 released", []),
    ],
)
def test_pii_detectors(text, kinds):
    assert [k for _, _, k in find_pii(text)] == kinds


def _screen(*rules, window=0):
    return compile_screen({"rules": list(rules), **({"window": window} if window else {})}, "input")


def test_actions_block_redact_flag():
    screen = _screen(
        {"name": "pii", "kind": "pii", "types": ["email", "card"], "action": "redact"},
        {"name": "deny", "kind": "keywords", "words": ["Project Zeus"], "action": "block"},
        {"name": "ticket", "kind": "regex", "pattern": r"TKT-\d+", "action": "flag"},
    )
    v = screen.check(f"mail bob@example.com, card {CARD}, about TKT-42")
    assert v.text == "mail [REDACTED:email], card [REDACTED:card], about TKT-42"
    assert v.action == REDACT and not v.blocked
    assert {f.rule for f in v.findings} == {"pii", "ticket"}
    assert screen.check("the PROJECT zeus plans").blocked  # whole words, any case
    assert not screen.check("projectzeus").findings  # not a whole word
    only_flag = screen.check("see TKT-7")
    assert only_flag.action == FLAG and only_flag.text == "see TKT-7"


def test_a_match_split_across_chunks_is_caught_before_any_of_it_leaves():
    screen = _screen({"name": "pii", "kind": "pii", "types": ["email"], "action": "redact"}, window=16)
    scanner = StreamScanner(screen)
    pieces = ["Contact: alice.sm", "ith@exam", "ple.org for details, or see the FAQ page for more."]
    out = [scanner.feed(p) for p in pieces]
    out.append(scanner.finish())
    joined = "".join(out)
    assert joined == "Contact: [REDACTED:email] for details, or see the FAQ page for more."
    assert "alice" not in "".join(out[:2])  # nothing of the address left before it was whole
    assert [f.kind for f in scanner.findings] == ["email"]


def test_a_blocked_stream_releases_nothing_of_the_match():
    screen = _screen({"name": "deny", "kind": "keywords", "words": ["launch codes"], "action": "block"})
    scanner = StreamScanner(screen)
    released = scanner.feed("Sure, here are the launch ") + scanner.feed("codes: 0000")
    assert scanner.blocked and "launch" not in released
    assert scanner.feed("more") == "" and scanner.finish() == ""


def test_the_joined_stream_equals_the_unary_check():
    screen = _screen({"name": "pii", "kind": "pii", "action": "redact"})
    text = f"a {CARD} b jane@x.org c {IBAN} d +1 415 555 0100 end" * 3
    for size in (1, 3, 7, 50):
        scanner = StreamScanner(screen)
        streamed = "".join(scanner.feed(text[i : i + size]) for i in range(0, len(text), size)) + scanner.finish()
        assert streamed == screen.check(text).text


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"input": {"rules": [{"kind": "nope"}]}}, "input.rules[0].kind"),
        ({"input": {"rules": [{"kind": "regex", "pattern": "("}]}}, "input.rules[0].pattern"),
        ({"output": {"rules": [{"kind": "keywords", "words": []}]}}, "output.rules[0].words"),
        ({"input": {"rules": [{"kind": "pii", "action": "delete"}]}}, "input.rules[0].action"),
        ({"input": {"classifier": {"threshold": 0.5}}}, "input.classifier.model"),
        ({"inptu": {}}, "unknown keys"),
    ],
)
def test_a_bad_policy_names_what_is_wrong(doc, message):
    with pytest.raises(PolicyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SafetyPolicy.from_doc(doc)


def test_policy_directions():
    policy = SafetyPolicy.from_doc({"output": {"rules": [{"kind": "pii", "action": BLOCK}]}})
    assert policy.input is None and policy.output is not None and policy.output.classifier is None
