"""LoRA adapters of an LLM: their check against the base model, the index of installed versions, and
(for our CPU engine) the bank that applies a different adapter to each row of one batch.

Copied beside ``model.py`` with the engines. An LLM's Triton model folder holds its adapters::

    NAME/adapters/index.json                       {"adapters": {ADAPTER: {version, sha256, rank, alpha, ...}}}
    NAME/adapters/ADAPTER/VERSION/adapter_model.safetensors
    NAME/adapters/ADAPTER/VERSION/adapter_config.json

written by ``model_repository/lora.py`` (``inferplane llm adapter add``). Only peft's safetensors
format is read (never a pickled ``adapter_model.bin``): the safetensors header gives every tensor's
shape, which must match the base model's module (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``), and
the weights' sha256 is checked against the index when an engine loads them. The index also records
the base weights' sha256: an adapter trained on other weights is refused, not silently applied.

Standard library only at import: ``torch`` is imported by :class:`LoraBank` alone, so the vLLM path
(which hands the folder to vLLM) needs none of it.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # beside model.py in the Triton model directory
    from _common import sha256_file
except ImportError:  # in the repository (tests, tools)
    from model_repository.adapters._common import sha256_file

ADAPTERS_DIR = "adapters"
INDEX_FILE = "index.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
# the linear layers an adapter may target (Llama-style names; what both engines apply)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_RANK = 64
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+\.(?P<target>[a-z_]+))\.lora_(?P<part>[AB])(?:\.default)?\.weight$")
_FLOAT_DTYPES = ("F32", "F16", "BF16")
# a request naming an unknown adapter: the frontend maps this prefix to NOT_FOUND
NOT_FOUND_PREFIX = "not found: "


class AdapterError(ValueError):
    """An adapter that cannot be installed or applied (wrong format, shape, base, or digest)."""


class AdapterNotFound(AdapterError):
    pass


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensors of a safetensors file (name -> dtype, shape), read from its JSON header only."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise AdapterError(f"{Path(path).name} is not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", raw)
        if length <= 0 or length > 100 * 1024 * 1024 or length > os.fstat(f.fileno()).st_size - 8:
            raise AdapterError(f"{Path(path).name} is not a safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise AdapterError(f"{Path(path).name} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{Path(path).name} is not a safetensors file")
    header.pop("__metadata__", None)
    return header


@dataclass(frozen=True)
class AdapterSpec:
    """What was checked: rank, scale and the (base module, in, out) each pair of tensors adapts."""

    rank: int
    alpha: float
    scale: float
    targets: tuple[str, ...]
    modules: dict[str, tuple[str, str, int, int]]  # base module name -> (A tensor, B tensor, in, out)


def check_adapter(folder: Path, base_dir: Path) -> AdapterSpec:
    """Check a peft LoRA folder against the base model folder (``config.json``, ``model.safetensors``)."""
    folder, base_dir = Path(folder), Path(base_dir)
    weights, config_path = folder / WEIGHTS_FILE, folder / CONFIG_FILE
    if not weights.is_file():
        unsafe = [p.name for p in folder.glob("adapter_model.*") if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt")]
        why = f" ({', '.join(unsafe)} is a pickle: save the adapter with safe_serialization=True)" if unsafe else ""
        raise AdapterError(f"no {WEIGHTS_FILE} in {folder}{why}")
    if not config_path.is_file():
        raise AdapterError(f"no {CONFIG_FILE} in {folder}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise AdapterError(f"{CONFIG_FILE} is not JSON") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(f"{CONFIG_FILE}: peft_type must be LORA, got {config.get('peft_type') if isinstance(config, dict) else config!r}")
    for key, allowed in (("bias", (None, "none")), ("use_dora", (None, False)), ("modules_to_save", (None, [])),
                         ("rank_pattern", (None, {})), ("alpha_pattern", (None, {})), ("fan_in_fan_out", (None, False)),
                         ("layer_replication", (None,)), ("trainable_token_indices", (None,))):  # fmt: skip
        if config.get(key) not in allowed:
            raise AdapterError(f"{CONFIG_FILE}: {key}={config.get(key)!r} is not supported (plain LoRA only)")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise AdapterError(f"{CONFIG_FILE}: r must be an integer in [1, {MAX_RANK}], got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{CONFIG_FILE}: lora_alpha must be a positive number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    base = safetensors_header(base_dir / "model.safetensors")
    tensors = safetensors_header(weights)
    pairs: dict[str, dict[str, str]] = {}
    for name, meta in tensors.items():
        found = _TENSOR.match(name)
        if found is None:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {name!r} is not a LoRA A/B weight (embedding or head updates are not supported)")
        if found["target"] not in TARGETS:
            raise AdapterError(f"{WEIGHTS_FILE}: {name!r} targets {found['target']!r}; supported: {', '.join(TARGETS)}")
        if meta.get("dtype") not in _FLOAT_DTYPES:
            raise AdapterError(f"{WEIGHTS_FILE}: {name!r} has dtype {meta.get('dtype')!r}; expected one of {', '.join(_FLOAT_DTYPES)}")
        pairs.setdefault(found["module"], {})[found["part"]] = name
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    modules = {}
    for module, parts in sorted(pairs.items()):
        if set(parts) != {"A", "B"}:
            raise AdapterError(f"{WEIGHTS_FILE}: {module} has lora_{''.join(parts)} without its pair")
        target = base.get(module + ".weight")
        if target is None:
            raise AdapterError(f"the base model has no module {module!r}: this adapter was made for another model")
        out_features, in_features = target["shape"]
        a, b = tensors[parts["A"]]["shape"], tensors[parts["B"]]["shape"]
        if a != [rank, in_features] or b != [out_features, rank]:
            raise AdapterError(
                f"{module}: lora_A {a} / lora_B {b} do not fit the base model's [{out_features}, {in_features}] weight "
                f"at rank {rank}: this adapter was made for another model"
            )
        modules[module] = (parts["A"], parts["B"], in_features, out_features)
    targets = tuple(sorted({m.rsplit(".", 1)[1] for m in modules}))
    return AdapterSpec(rank=rank, alpha=float(alpha), scale=float(scale), targets=targets, modules=modules)


# ---- the index of installed adapters --------------------------------------------------------------


@dataclass(frozen=True)
class Adapter:
    """One installed adapter version, as an engine applies it."""

    name: str
    version: int
    folder: Path
    sha256: str
    rank: int
    scale: float
    base_sha256: str

    @property
    def key(self) -> str:
        """Unique per version (a new version is a new adapter to the engines and the prefix cache)."""
        return f"{self.name}-v{self.version}"


def read_index(model_dir: Path) -> dict[str, dict[str, Any]]:
    path = Path(model_dir) / ADAPTERS_DIR / INDEX_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return dict(doc.get("adapters", {}))


class AdapterIndex:
    """The adapters a model folder holds, re-read when ``index.json`` changes (an install while serving)."""

    def __init__(self, model_dir: Path, base_sha256: str):
        self.model_dir = Path(model_dir)
        self.base_sha256 = base_sha256
        self._stamp: tuple[int, int] | None = None
        self._entries: dict[str, dict[str, Any]] = {}
        self._verified: dict[tuple[str, int], str] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        with self._lock:
            self._refresh()
            return sorted(self._entries)

    def lookup(self, name: str) -> Adapter:
        """The current version of ``name``; its weights' digest checked (once per version)."""
        if not isinstance(name, str) or not NAME.match(name):
            raise AdapterNotFound(f"adapter names are lowercase letters, digits, '-' and '_' (got {name!r})")
        with self._lock:
            self._refresh()
            entry = self._entries.get(name)
            if entry is None:
                raise AdapterNotFound(f"unknown adapter {name!r} (installed: {', '.join(sorted(self._entries)) or 'none'})")
            version = int(entry["version"])
            folder = self.model_dir / ADAPTERS_DIR / name / str(version)
            if entry.get("base_sha256") != self.base_sha256:
                raise AdapterError(f"adapter {name!r} v{version} was checked against other base weights; reinstall it")
            if self._verified.get((name, version)) != entry["sha256"]:
                actual = sha256_file(folder / WEIGHTS_FILE) if (folder / WEIGHTS_FILE).is_file() else "missing"
                if actual != entry["sha256"]:
                    raise AdapterError(f"adapter {name!r} v{version}: weights sha256 {actual}, index expects {entry['sha256']}; refusing it")
                self._verified[(name, version)] = actual
            return Adapter(name, version, folder, entry["sha256"], int(entry["rank"]), float(entry["scale"]), entry["base_sha256"])

    def _refresh(self) -> None:
        path = self.model_dir / ADAPTERS_DIR / INDEX_FILE
        try:
            st = path.stat()
        except FileNotFoundError:
            self._stamp, self._entries = None, {}
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._entries, self._stamp = read_index(self.model_dir), stamp


# ---- the CPU engine's bank: a different adapter per batch row ----------------------------------------


class LoraBank:
    """Up to ``slots`` adapters applied inside one forward pass, each row of the batch with its own.

    For every base module some loaded adapter targets, the bank holds ``A^T`` ``[slots + 1, in, R]`` and
    ``scale * B^T`` ``[slots + 1, R, out]`` (slot 0 all zeros: no adapter; ranks below ``R`` are
    zero-padded, which changes nothing, and only the loaded adapters' largest rank is computed) and a
    forward hook adds ``x A_row^T (scale B_row)^T`` to the module's output for each row, in place:
    two batched matmuls over the rows' gathered stacks, or two plain ones when every row has the
    same adapter. ``use`` (called by the engine before each forward) names each row's slot; with no
    adapter in the batch the hooks do nothing. Only the engine thread touches it.
    """

    def __init__(self, model: Any, slots: int = 8, max_rank: int = 16):
        import torch

        self.torch = torch
        self.model = model
        self.slots = max(1, slots)
        self.max_rank = max_rank
        self.rows = None  # LongTensor [batch] of slots, or None
        self.single = 0  # the one slot of every row, when they share one (plain matmuls, no gather)
        self._rank = 0  # the largest rank loaded: the stacks' computed width
        self._modules = dict(model.named_modules())
        self._a: dict[str, Any] = {}
        self._b: dict[str, Any] = {}
        self._ranks = [0] * (self.slots + 1)
        self._has: dict[str, set[int]] = {}  # module -> the slots whose adapter targets it
        self._in_use: set[int] = set()  # the slots of the next forward pass
        self._slot_of: dict[str, int] = {}  # adapter key -> slot
        self._holders = [0] * (self.slots + 1)  # sequences using each slot
        self._last_used = [0] * (self.slots + 1)
        self._clock = 0
        self._hooks: list = []

    def loaded(self) -> list[str]:
        return sorted(self._slot_of)

    def acquire(self, adapter: Adapter) -> int | None:
        """A slot holding ``adapter`` for one more sequence; None while every slot is held by others."""
        self._clock += 1
        slot = self._slot_of.get(adapter.key)
        if slot is None:
            free = [s for s in range(1, self.slots + 1) if self._holders[s] == 0]
            if not free:
                return None
            slot = min(free, key=lambda s: self._last_used[s])
            for key, s in list(self._slot_of.items()):
                if s == slot:
                    del self._slot_of[key]
            self._load(adapter, slot)
            self._slot_of[adapter.key] = slot
        self._holders[slot] += 1
        self._last_used[slot] = self._clock
        return slot

    def release(self, slot: int) -> None:
        if slot > 0:
            self._holders[slot] = max(0, self._holders[slot] - 1)

    def use(self, slots: list[int]) -> None:
        """The slots of the next forward pass's rows (in order)."""
        first = slots[0] if slots else 0
        self.single = first if first and all(s == first for s in slots) else 0
        self._in_use = set(slots)
        self.rows = self.torch.tensor(slots, dtype=self.torch.long) if any(slots) and not self.single else None

    def _load(self, adapter: Adapter, slot: int) -> None:
        from safetensors.torch import load_file

        torch = self.torch
        if adapter.rank > self.max_rank:
            raise AdapterError(f"adapter {adapter.name!r} has rank {adapter.rank}; this model serves ranks up to {self.max_rank} (max_lora_rank)")
        spec_modules = {}
        weights = load_file(str(adapter.folder / WEIGHTS_FILE))
        for name, tensor in weights.items():
            found = _TENSOR.match(name)
            if found is None:
                raise AdapterError(f"{WEIGHTS_FILE}: unexpected tensor {name!r}")
            spec_modules.setdefault(found["module"], {})[found["part"]] = tensor
        for store in (self._a, self._b):  # the slot's previous adapter leaves no trace
            for stack in store.values():
                stack[slot].zero_()
        for slots in self._has.values():
            slots.discard(slot)
        for module_name, parts in spec_modules.items():
            module = self._modules.get(module_name.removeprefix("base_model.model."))
            if module is None or not hasattr(module, "weight"):
                raise AdapterError(f"adapter {adapter.name!r}: the model has no module {module_name!r}")
            out_features, in_features = module.weight.shape
            if module_name not in self._a:
                dtype = module.weight.dtype
                self._a[module_name] = torch.zeros((self.slots + 1, in_features, self.max_rank), dtype=dtype)
                self._b[module_name] = torch.zeros((self.slots + 1, self.max_rank, out_features), dtype=dtype)
                self._hooks.append(module.register_forward_hook(self._hook(module_name)))
            a, b = parts["A"].float(), parts["B"].float()  # [r, in], [out, r]
            self._a[module_name][slot, :, : a.shape[0]] = a.t().to(self._a[module_name].dtype)
            self._b[module_name][slot, : b.shape[1]] = (b.t() * adapter.scale).to(self._b[module_name].dtype)
            self._has.setdefault(module_name, set()).add(slot)
        self._ranks[slot] = adapter.rank
        self._rank = max(self._ranks)

    def _hook(self, module_name: str):
        torch = self.torch

        has = self._has.setdefault(module_name, set())

        def add_lora(_module, inputs, output):
            r = self._rank
            if not has & self._in_use:  # no row's adapter adapts this module
                return None
            if self.single:
                a = self._a[module_name][self.single, :, :r]  # [in, r]
                b = self._b[module_name][self.single, :r]  # [r, out]
                output.add_(torch.matmul(torch.matmul(inputs[0], a), b))
            elif self.rows is not None:
                a = self._a[module_name][self.rows, :, :r]  # [batch, in, r]
                b = self._b[module_name][self.rows, :r]  # [batch, r, out]
                output.add_(torch.bmm(torch.bmm(inputs[0], a), b))
            return None

        return add_lora
