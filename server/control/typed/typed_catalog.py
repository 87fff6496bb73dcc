"""Which typed-API schemas this frontend serves, per model, and how they change at deploy.

Two kinds of entries:

* **deployed endpoints** (the registry): every schema major the endpoint has served and not
  retired, persisted in ``typed_schemas`` (``server.control.typed.typed_store``). At deploy the new
  version's schema is checked against the live one (``typed_compat.compare``): a breaking change
  adds the next major beside the old ones, which keep being served until
  ``inferplane endpoints retire-schema NAME v1``; a non-breaking one replaces the live major's
  schema (its revision goes up); no change only records the model version.
* **models loaded from the repository** (``inferplane serve`` on a demo repository): one schema,
  v1, derived from the model's ``inferplane.json`` signature when its tensors are the served
  ones (feature names kept), else from Triton's config; not persisted, re-derived when the model
  is reloaded with another signature.

Every process of the platform serves the same schemas: the leader's deploys and retirements write them,
and every catalog with a store (each frontend, worker and standby) reads them again every interval
(``follow``), so a typed client gets v2 from any process within one interval of the deploy.

Every schema of an endpoint calls the endpoint (no version pinned), so traffic splits and
rollbacks apply; a schema's fields map onto the endpoint's tensors by position (the deployer
serves one tensor signature per endpoint). ``revision`` goes up on every change: the typed
transport rebuilds its services when it moves.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from server.control.typed.typed_compat import compare, is_breaking
from server.control.typed.typed_schema import NoTypedApi, TypedSchema, from_model_signature, from_signature
from server.control.typed.typed_store import TypedSchemaStore
from server.errors import Conflict, InferplaneError, InvalidRequest, ModelNotFound, Unimplemented
from server.control.typed.declared_signature import check_signature

log = logging.getLogger(__name__)

METADATA_FILE = "inferplane.json"  # model_repository/layout.py writes it beside config.pbtxt


def parse_major(text: str) -> int:
    """``v2`` or ``2`` -> 2."""
    value = text.strip().lower().removeprefix("v")
    if not value.isdigit() or int(value) < 1:
        raise InvalidRequest(f"a schema major is v1, v2, ... (got {text!r})")
    return int(value)


class SchemaCatalog:
    def __init__(self, dataplane, registry=None, repository: Path | None = None, store: TypedSchemaStore | None = None):
        """``registry``: a leader-capable process's (deploys write through it); ``store``: where the
        schemas are read from without one (a frontend or worker that never leads: the leader's database)."""
        self.dp = dataplane
        self.registry = registry
        self.store = store if store is not None else TypedSchemaStore(registry.engine) if registry is not None else None
        self.repository = Path(repository) if repository is not None else None
        self._persisted: dict[str, dict[int, TypedSchema]] = {}  # endpoint -> major -> active schema
        self._retired: dict[str, set[int]] = {}
        self._derived: dict[str, TypedSchema] = {}
        self._derived_from: dict[str, object] = {}  # name -> the ModelSignature it was derived from
        self.unavailable: dict[str, str] = {}  # name -> why it has no typed API
        self.revision = 0
        self._lock = asyncio.Lock()

    # ---- reading ----------------------------------------------------------------------------

    def load(self) -> None:
        """The persisted schemas (start-up; synchronous, a few rows)."""
        if self.store is not None:
            self._adopt(self.store.rows())

    async def reload(self) -> bool:
        """The persisted schemas read again (what another process's deploys and retirements wrote); True
        when they changed. Under the lock of ``deployed`` and ``retire``: a read never undoes their write."""
        async with self._lock:
            return self._adopt(await asyncio.to_thread(self.store.rows))

    async def follow(self, interval_s: float) -> None:
        """``reload`` now and every ``interval_s`` (a task of every process with a store); a database that is
        away (or not migrated yet, before the leader's first start) is read again at the next interval."""
        while True:
            try:
                if await self.reload():
                    log.info("typed schemas read from the database (revision %d)", self.revision)
            except Exception as err:
                log.warning("reading the typed schemas failed: %s", err)
            await asyncio.sleep(interval_s)

    def _adopt(self, rows: list[dict]) -> bool:
        """The store's rows become the persisted and retired majors; True when anything changed."""
        persisted: dict[str, dict[int, TypedSchema]] = {}
        retired: dict[str, set[int]] = {}
        for row in rows:
            if row["state"] == "active":
                schema = TypedSchema.from_dict(row["schema"])
                persisted.setdefault(row["endpoint"], {})[schema.major] = schema
            else:
                retired.setdefault(row["endpoint"], set()).add(int(row["major"]))
        if persisted == self._persisted and retired == self._retired:
            return False
        for name in persisted:  # an endpoint's schemas are the registry's from now on
            self._derived.pop(name, None)
            self._derived_from.pop(name, None)
        for name in self._persisted.keys() - persisted.keys():  # derived from its loaded model again at the next sync
            self._derived_from.pop(name, None)
        self._persisted, self._retired = persisted, retired
        self.revision += 1
        return True

    def sync(self) -> bool:
        """Derive schemas for the models the data plane serves that have none yet (or whose
        signature changed); drop those of models it no longer serves. True when anything changed."""
        changed = False
        served = {name: sig for name in self.dp.names() if (sig := self.dp.signature(name)) is not None}
        for name, sig in served.items():
            if name in self._persisted or self._derived_from.get(name) is sig:
                continue
            self._derived_from[name] = sig
            try:
                schema = from_model_signature(sig, declared=self._declared(name))
            except (NoTypedApi, InferplaneError) as why:
                self.unavailable[name] = str(why)
                changed |= self._derived.pop(name, None) is not None
                continue
            self.unavailable.pop(name, None)
            old = self._derived.get(name)
            if old is None or old.as_dict() != schema.as_dict():
                self._derived[name] = schema
                changed = True
        for name in [n for n in self._derived if n not in served]:
            del self._derived[name]
            self._derived_from.pop(name, None)
            changed = True
        if changed:
            self.revision += 1
        return changed

    def _declared(self, name: str) -> dict | None:
        """The repository's richer signature (feature names) of a model, when it has one."""
        if self.repository is None:
            return None
        path = self.repository / name / METADATA_FILE
        try:
            signature = json.loads(path.read_text(encoding="utf-8")).get("signature")
        except (OSError, ValueError, AttributeError):
            return None
        if not signature:
            return None

        try:
            return check_signature(signature)
        except InferplaneError as err:
            log.warning("model %s: ignoring the signature in %s: %s", name, path, err.message)
            return None

    def served(self) -> list[TypedSchema]:
        """Every schema served now, by model then major."""
        out = [s for name in sorted(self._persisted) for _, s in sorted(self._persisted[name].items())]
        return out + [self._derived[n] for n in sorted(self._derived) if n not in self._persisted]

    def is_deployed(self, name: str) -> bool:
        """Its schemas are the registry's (not derived from the loaded model)."""
        return name in self._persisted

    def majors(self, name: str) -> dict[int, TypedSchema]:
        if name in self._persisted:
            return dict(self._persisted[name])
        return {1: self._derived[name]} if name in self._derived else {}

    def live(self, name: str) -> TypedSchema:
        """The newest served major of ``name``; NOT_FOUND / UNIMPLEMENTED when there is none."""
        majors = self.majors(name)
        if not majors:
            self.sync()
            majors = self.majors(name)
        if majors:
            return majors[max(majors)]
        if name in self.unavailable:
            raise Unimplemented(f"model '{name}' has no typed API: {self.unavailable[name]}")
        raise ModelNotFound(f"unknown model '{name}'")

    async def schema_for(self, name: str, version: str = "") -> TypedSchema:
        """What ``inferplane proto NAME --version V`` prints: the live schema (V empty), a served
        major (``v2``) or the schema model version V is served under (``3``)."""
        version = version.strip()
        live = self.live(name)
        if not version:
            return live
        if version.lower().startswith("v"):
            major = parse_major(version)
            majors = self.majors(name)
            if major in majors:
                return majors[major]
            if major in self._retired.get(name, ()):
                raise ModelNotFound(f"schema v{major} of '{name}' was retired")
            raise ModelNotFound(f"model '{name}' serves no typed schema v{major} (served: {', '.join(f'v{m}' for m in sorted(majors))})")
        if not version.isdigit():
            raise InvalidRequest(f"--version is a model version (3) or a schema major (v1), got {version!r}")
        for schema in sorted(self.majors(name).values(), key=lambda s: -s.major):
            if schema.model_version == version:
                return schema
        if name not in self._persisted:  # one signature serves every version of a repository model
            sig = self.dp.signature(name)
            if sig is not None and version in sig.versions:
                return live.with_version(live.major, live.revision, version)
            raise ModelNotFound(f"unknown version '{version}' of model '{name}'")
        if self.registry is None:
            raise ModelNotFound(f"version {version} of '{name}' is not one a served schema came from")
        record = await asyncio.to_thread(self.registry.get, name, int(version))
        try:
            schema = from_signature(name, record.signature, model_version=version)
        except NoTypedApi as why:
            raise Unimplemented(f"{record.ref} has no typed API: {why}") from None
        for served in sorted(self.majors(name).values(), key=lambda s: -s.major):
            changes = compare(served, schema)
            if not is_breaking(changes):
                return schema.with_version(served.major, served.revision + (1 if changes else 0))
        return schema.with_version(self._next_major(name))

    def _next_major(self, name: str) -> int:
        return max([*self.majors(name), *self._retired.get(name, ()), 0]) + 1

    # ---- changing -----------------------------------------------------------------------------

    async def deployed(self, name: str, record, actor: str = "") -> str:
        """The deployer's hook after ``record`` went live on endpoint ``name``: its schema against
        the live one. Returns a note for the deploy's message ('' when it has no typed API)."""
        try:
            new = from_signature(name, record.signature, model_version=str(record.version))
        except NoTypedApi as why:
            self.unavailable[name] = str(why)
            return ""
        async with self._lock:
            if name not in self._persisted and name in self._derived:
                # what callers used until now (derived from the loaded model) becomes the endpoint's v1
                await self._save(name, self._derived.pop(name), actor)
            majors = self._persisted.get(name, {})
            if not majors:
                schema, note = new.with_version(self._next_major(name)), "typed API {service}"
            else:
                live = majors[max(majors)]
                changes = compare(live, new)
                if is_breaking(changes):
                    schema = new.with_version(self._next_major(name))
                    old = ", ".join(f"v{m}" for m in sorted(majors))
                    note = (
                        f"typed API {{service}}: breaking change from {live.label} ({'; '.join(str(c) for c in changes if c.breaking)}); "
                        f"{old} still served until `inferplane endpoints retire-schema {name} v{live.major}`"
                    )
                elif changes:
                    schema = new.with_version(live.major, live.revision + 1)
                    note = f"typed API {{service}} {schema.label}: non-breaking ({'; '.join(str(c) for c in changes)})"
                else:
                    schema, note = new.with_version(live.major, live.revision), "typed API {service} unchanged"
            await self._save(name, schema, actor)
            self.revision += 1
            return note.format(service=schema.service)

    async def _save(self, name: str, schema: TypedSchema, actor: str) -> None:
        if self.store is not None:
            await asyncio.to_thread(self.store.save, name, schema.as_dict(), actor)
        self._persisted.setdefault(name, {})[schema.major] = schema
        self._derived_from.pop(name, None)

    async def retire(self, name: str, major: int, actor: str = "") -> list[TypedSchema]:
        """Stop serving schema ``major`` of endpoint ``name`` (never its newest); returns what stays."""
        async with self._lock:
            majors = self.majors(name)
            if major not in majors:
                what = "was already retired" if major in self._retired.get(name, ()) else "is not served"
                raise ModelNotFound(f"typed schema v{major} of '{name}' {what} (served: {', '.join(f'v{m}' for m in sorted(majors)) or 'none'})")
            if major == max(majors):
                raise Conflict(f"v{major} is the newest typed schema of '{name}'; only older majors can be retired")
            if self.store is not None:
                await asyncio.to_thread(self.store.retire, name, major, actor)
            del self._persisted[name][major]
            self._retired.setdefault(name, set()).add(major)
            self.revision += 1
            return [s for _, s in sorted(self._persisted[name].items())]
