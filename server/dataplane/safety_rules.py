"""Rule-based safety filters: pure functions of text (no I/O, no clock), compiled once per policy.

A rule finds spans: a keyword list (whole words, case-insensitive), a regular expression, or PII
detectors — e-mail addresses, phone numbers, payment card numbers (13-19 digits passing the Luhn
check) and IBANs (country code, check digits, passing the ISO 13616 mod-97 check). Each rule has an
action: ``block`` (refuse the input / end the output), ``redact`` (replace the span with
``[REDACTED:<type>]``) or ``flag`` (pass it unchanged; the decision is recorded).

:class:`Screen` runs a list of rules over a text; :class:`StreamScanner` runs one over text that
arrives in pieces, holding back the last ``window`` characters so that a match across a chunk
boundary is seen whole before any of it is released.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

BLOCK, REDACT, FLAG, ALLOW = "block", "redact", "flag", "allow"
ACTIONS = (BLOCK, REDACT, FLAG)
_SEVERITY = {ALLOW: 0, FLAG: 1, REDACT: 2, BLOCK: 3}
PII_TYPES = ("email", "phone", "card", "iban")
DEFAULT_WINDOW = 64  # characters held back on streams: longer than any PII match


class PolicyError(ValueError):
    """A safety policy that cannot be compiled; the message names the rule and field."""


# ---- checksums -----------------------------------------------------------------------------------


def luhn_valid(digits: str) -> bool:
    """The Luhn (mod 10) check of payment card numbers."""
    if not digits.isdigit():
        return False
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


# ISO 13616 IBAN lengths per country (the registry's list; a country not listed is checked by mod-97 alone)
IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BR": 29, "CH": 21,
    "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DK": 18, "DO": 28, "EE": 20, "EG": 29, "ES": 24, "FI": 18, "FO": 18,
    "FR": 27, "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "GT": 28, "HR": 21, "HU": 28, "IE": 22, "IL": 23,
    "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20, "LB": 28, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "MC": 27,
    "MD": 24, "ME": 22, "MK": 19, "MR": 27, "MT": 31, "MU": 30, "NL": 18, "NO": 15, "PK": 24, "PL": 28, "PS": 29,
    "PT": 25, "QA": 29, "RO": 24, "RS": 22, "SA": 24, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "TN": 24, "TR": 26,
    "UA": 29, "VG": 24, "XK": 20,
}  # fmt: skip


def iban_valid(text: str) -> bool:
    """An IBAN (spaces allowed): the country's length where known, and the mod-97 check equal to 1."""
    iban = text.replace(" ", "").upper()
    if len(iban) < 15 or len(iban) > 34 or not iban[:2].isalpha() or not iban[2:4].isdigit() or not iban.isalnum():
        return False
    expected = IBAN_LENGTHS.get(iban[:2])
    if expected is not None and len(iban) != expected:
        return False
    rearranged = iban[4:] + iban[:4]
    number = "".join(str(int(ch, 36)) for ch in rearranged)
    return int(number) % 97 == 1


# ---- detectors -----------------------------------------------------------------------------------

_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@(?:[A-Za-z0-9-]{1,63}\.)+[A-Za-z]{2,24}(?![\w-])")
_CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")
_IBAN = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}(?![A-Za-z0-9])")
# a phone number: optional +country, groups of digits with spaces, dots, dashes or parentheses; 8-15 digits
_PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]?\d{2,4}){1,4}(?![\w])")


def _digits(text: str) -> str:
    return "".join(ch for ch in text if ch.isdigit())


def find_pii(text: str, types: tuple[str, ...] = PII_TYPES) -> list[tuple[int, int, str]]:
    """(start, end, type) of each PII span, earliest first; a span is reported once (a card number
    is not also a phone number)."""
    found: list[tuple[int, int, str]] = []

    def free(start: int, end: int) -> bool:
        return all(end <= s or start >= e for s, e, _ in found)

    if "email" in types:
        found += [(m.start(), m.end(), "email") for m in _EMAIL.finditer(text)]
    if "iban" in types:
        found += [(m.start(), m.end(), "iban") for m in _IBAN.finditer(text) if iban_valid(m.group()) and free(m.start(), m.end())]
    if "card" in types:
        for m in _CARD.finditer(text):
            digits = _digits(m.group())
            if 13 <= len(digits) <= 19 and luhn_valid(digits) and free(m.start(), m.end()):
                found.append((m.start(), m.end(), "card"))
    if "phone" in types:
        for m in _PHONE.finditer(text):
            digits = _digits(m.group())
            if 8 <= len(digits) <= 15 and free(m.start(), m.end()) and _phone_like(m.group()):
                found.append((m.start(), m.end(), "phone"))
    return sorted(found)


def _phone_like(span: str) -> bool:
    """Grouped like a phone number: a +country code or an (area code) with 8-15 digits, or else two or
    three groups of 9-11 digits (``415-555-0100``, ``020 7946 0958``). A bare run of digits is an id,
    and four bare groups look like an account number more than a phone."""
    if span.startswith("+") or "(" in span:
        return True
    groups = [g for g in re.split(r"[ .-]", span) if g]
    return 2 <= len(groups) <= 3 and 9 <= len(_digits(span)) <= 11


# ---- rules ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    rule: str
    kind: str  # the detector: keyword | regex | email | phone | card | iban
    action: str
    start: int
    end: int


@dataclass(frozen=True)
class Rule:
    name: str
    kind: str  # keywords | regex | pii
    action: str
    pattern: re.Pattern | None = None
    types: tuple[str, ...] = ()
    span: int = DEFAULT_WINDOW  # the longest match it can make (the stream window's lower bound)

    def find(self, text: str) -> list[Finding]:
        if self.kind == "pii":
            return [Finding(self.name, kind, self.action, s, e) for s, e, kind in find_pii(text, self.types)]
        kind = "keyword" if self.kind == "keywords" else "regex"
        return [Finding(self.name, kind, self.action, m.start(), m.end()) for m in self.pattern.finditer(text) if m.end() > m.start()]


def compile_rule(doc: dict, index: int) -> Rule:
    if not isinstance(doc, dict):
        raise PolicyError(f"rules[{index}]: expected an object, got {type(doc).__name__}")
    kind = doc.get("kind")
    name = str(doc.get("name") or f"{kind}-{index}")
    if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", name):
        raise PolicyError(f"rules[{index}].name: letters, digits, _.:- only (it is a metrics label), got {name!r:.80}")
    action = doc.get("action", BLOCK)
    if action not in ACTIONS:
        raise PolicyError(f"rules[{index}].action: one of {', '.join(ACTIONS)}, got {action!r}")
    if kind == "keywords":
        words = doc.get("words")
        if not isinstance(words, list) or not words or not all(isinstance(w, str) and w.strip() for w in words):
            raise PolicyError(f"rules[{index}].words: a non-empty list of non-empty strings")
        alternatives = "|".join(re.escape(w.strip()) for w in sorted(words, key=len, reverse=True))
        return Rule(name, kind, action, re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE), span=max(len(w) for w in words))
    if kind == "regex":
        pattern = doc.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise PolicyError(f"rules[{index}].pattern: a regular expression")
        try:
            compiled = re.compile(pattern, re.IGNORECASE if doc.get("ignore_case") else 0)
        except re.error as err:
            raise PolicyError(f"rules[{index}].pattern: {err}") from None
        return Rule(name, kind, action, compiled, span=int(doc.get("max_length", DEFAULT_WINDOW)))
    if kind == "pii":
        types = tuple(doc.get("types") or PII_TYPES)
        unknown = [t for t in types if t not in PII_TYPES]
        if unknown:
            raise PolicyError(f"rules[{index}].types: unknown PII types {unknown} (known: {', '.join(PII_TYPES)})")
        return Rule(name, kind, action, types=types, span=DEFAULT_WINDOW)
    raise PolicyError(f"rules[{index}].kind: one of keywords, regex, pii, got {kind!r}")


@dataclass(frozen=True)
class Verdict:
    """What a screen decided about one text: the text to pass on (redacted), what was found, the action."""

    text: str
    findings: tuple[Finding, ...] = ()

    @property
    def action(self) -> str:
        return max((f.action for f in self.findings), key=_SEVERITY.__getitem__, default=ALLOW)

    @property
    def blocked(self) -> bool:
        return any(f.action == BLOCK for f in self.findings)


def redact(text: str, findings: list[Finding]) -> str:
    """Each redact finding's span replaced by ``[REDACTED:<kind>]`` (overlaps merged, earliest first)."""
    spans = sorted((f.start, f.end, f.kind) for f in findings if f.action == REDACT)
    if not spans:
        return text
    out, pos = [], 0
    for start, end, kind in spans:
        if start < pos:  # overlaps the previous one: extend it
            continue
        out.append(text[pos:start])
        out.append(f"[REDACTED:{kind}]")
        pos = end
    out.append(text[pos:])
    return "".join(out)


@dataclass(frozen=True)
class Screen:
    """The rules of one direction (input or output) of one endpoint."""

    rules: tuple[Rule, ...] = ()
    window: int = DEFAULT_WINDOW

    def find(self, text: str) -> list[Finding]:
        return [f for rule in self.rules for f in rule.find(text)]

    def check(self, text: str) -> Verdict:
        findings = self.find(text)
        if not findings:
            return Verdict(text)
        return Verdict(redact(text, findings), tuple(findings))


def compile_screen(doc: dict | None, where: str) -> Screen | None:
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise PolicyError(f"{where}: expected an object")
    rules = doc.get("rules", [])
    if not isinstance(rules, list):
        raise PolicyError(f"{where}.rules: expected a list")
    compiled = []
    for i, r in enumerate(rules):
        try:
            compiled.append(compile_rule(r, i))
        except PolicyError as err:
            raise PolicyError(f"{where}.{err}") from None
    window = int(doc.get("window", 0)) or max([DEFAULT_WINDOW, *(r.span for r in compiled)])
    return Screen(tuple(compiled), window)


# ---- streams -------------------------------------------------------------------------------------


@dataclass
class StreamScanner:
    """A screen over text arriving in pieces. ``feed`` returns what may be released now; the last
    ``window`` characters (and any match reaching into them) wait for the next piece or ``finish``.
    A block finding anywhere in the unreleased text blocks the stream at once."""

    screen: Screen
    pending: str = ""
    findings: list[Finding] = field(default_factory=list)  # released ones (each reported once)
    blocked: bool = False

    def feed(self, text: str) -> str:
        if self.blocked:
            return ""
        self.pending += text
        return self._release(final=False)

    def finish(self) -> str:
        if self.blocked:
            return ""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        found = self.screen.find(self.pending)
        if any(f.action == BLOCK for f in found):
            self.blocked = True
            self.findings.extend(f for f in found if f.action == BLOCK)
            self.pending = ""
            return ""
        cut = len(self.pending) if final else max(0, len(self.pending) - self.screen.window)
        moved = True
        while moved:  # a match across the cut waits whole (and so may one across the new cut)
            moved = False
            for f in found:
                if f.start < cut < f.end:
                    cut, moved = f.start, True
        released = [f for f in found if f.end <= cut]
        self.findings.extend(released)
        out = redact(self.pending[:cut], released)
        self.pending = self.pending[cut:]
        return out
