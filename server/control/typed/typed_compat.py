"""The compatibility check of typed-API schemas: what changes for a caller of the served schema
when a new one replaces it.

A removed field, a changed type or number (or element count), a removed, renumbered or re-valued
enum label, or a new required input field is breaking (the deploy serves the next major beside
the old one); other additions, ranges and optionality loosening are not.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.control.typed.typed_schema import Field, TypedSchema


@dataclass(frozen=True)
class Change:
    breaking: bool
    where: str  # "request.amount", "response.probability", "enum MerchantCategory"
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def compare(old: TypedSchema, new: TypedSchema) -> list[Change]:
    """What changes for a caller of ``old`` when ``new`` is served instead (breaking ones first)."""
    changes: list[Change] = []
    changes += _compare_fields("request", old.request_fields, new.request_fields, inputs=True)
    changes += _compare_fields("response", old.response_fields, new.response_fields, inputs=False)
    return sorted(changes, key=lambda c: (not c.breaking, c.where))


def _signature_of(f: Field) -> str:
    kind = f"repeated {f.type}" if f.repeated else f.type
    return kind + (f"[{f.count}]" if f.repeated and f.count is not None else "")


def _compare_fields(side: str, old: tuple[Field, ...], new: tuple[Field, ...], *, inputs: bool) -> list[Change]:
    out: list[Change] = []
    by_name = {f.name: f for f in new}
    old_names = {f.name for f in old}
    for f in old:
        where = f"{side}.{f.name}"
        g = by_name.get(f.name)
        if g is None:
            out.append(Change(True, where, f"field removed (was {_signature_of(f)} = {f.number})"))
            continue
        if g.number != f.number:
            out.append(Change(True, where, f"field number changed {f.number} -> {g.number}"))
        if _signature_of(g) != _signature_of(f) or bool(g.enum) != bool(f.enum):
            out.append(Change(True, where, f"type changed {_signature_of(f)} -> {_signature_of(g)}"))
        elif f.enum:
            out += _compare_enum(where, f, g)
        if inputs and g.required and not f.required:
            out.append(Change(True, where, "became required (callers that leave it out are refused)"))
        if inputs and not g.required and f.required:
            out.append(Change(False, where, "became optional"))
        if inputs and g.range != f.range:
            out.append(Change(False, where, f"declared range {_show_range(f.range)} -> {_show_range(g.range)}"))
    for g in new:
        if g.name in old_names:
            continue
        where = f"{side}.{g.name}"
        if inputs and g.required:
            out.append(Change(True, where, f"new required field ({_signature_of(g)} = {g.number}): callers of the old schema do not send it"))
        else:
            out.append(Change(False, where, f"field added ({_signature_of(g)} = {g.number})"))
    return out


def _compare_enum(where: str, f: Field, g: Field) -> list[Change]:
    out = []
    old = {label: (i + 1, value) for i, (label, value) in enumerate(f.enum)}
    new = {label: (i + 1, value) for i, (label, value) in enumerate(g.enum)}
    for label, (number, value) in old.items():
        if label not in new:
            out.append(Change(True, where, f"enum label {label} removed"))
        elif new[label][0] != number:
            out.append(Change(True, where, f"enum label {label} renumbered {number} -> {new[label][0]}"))
        elif new[label][1] != value:
            out.append(Change(True, where, f"enum label {label} now means tensor value {new[label][1]:g} (was {value:g})"))
    for label, (number, _) in new.items():
        if label not in old:
            out.append(Change(False, where, f"enum label {label} = {number} added"))
    return out


def _show_range(r) -> str:
    return "none" if r is None else f"[{r[0]:g}, {r[1]:g}]"


def is_breaking(changes: list[Change]) -> bool:
    return any(c.breaking for c in changes)
