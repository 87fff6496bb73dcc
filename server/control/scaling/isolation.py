"""Failure domains (issue 29), as pure policy: which isolation group a model's copies belong to, how
many copies (and zones) a tier asks for. ``server.control.scaling.placement`` keeps each group on Triton
processes of its own, so a crash of one group's Triton never fails another group's endpoints.

Modes of the embedded default (``INFERPLANE_ISOLATION``):

* ``llm`` (the default): the LLMs (decoupled, streaming models) share Triton process(es) apart from
  the tree/ONNX models, which share the embedded one — a crashed LLM engine reloads alone, and the
  tabular endpoints never see it;
* ``each``: every model has a Triton of its own (one process per model: memory and start time in
  BENCHMARKS.md);
* ``none``: every model in the embedded Triton (one crash is an outage of all of them).

A warm standby asked for (``INFERPLANE_WARM_STANDBY=MODEL=N``) gives the model a group of its own
too, in ``llm`` and ``each`` (not ``none``): a standby holds that one model, and it can take a dead
replica's place only if the replica hosted nothing else (``LocalReplicaPool.take_over``), so a tree
model with a standby leaves the embedded Triton (whose supervisor is the frontend's: nothing takes
its place) for a supervised replica of its own, and a ``kill -9`` of that replica's Triton is covered
by the standby at once instead of a restart and reload.

Tiers (``--tier``, stored in the endpoint's scaling config: ``batching.autoscale_policy.ScalingConfig``,
which also raises a tier-1 endpoint to at least two replicas): a tier-1 endpoint gets a group of its
own whatever the mode (no co-tenants), and placement spreads its copies over the zones; tiers 2 and
3 share by the mode and pack by memory.
"""

from __future__ import annotations

from pathlib import Path

from model_repository.config_writer import CONFIG_FILE, ENSEMBLE_PLATFORM, read_config

MODES = ("none", "llm", "each")
DEFAULT_TIER = 2
LLM_GROUP = "llm"


def isolation_group(
    model: str, *, streams: bool, mode: str, tier: int = DEFAULT_TIER, ensemble: bool = False, standby: bool = False
) -> str:
    """The group ``model``'s copies share Tritons with ('' is the shared default group). ``ensemble``:
    the model is a Triton ensemble or one of its steps — they must share one Triton, so ``each`` and a
    standby keep them in the shared group. ``standby``: a warm standby of the model is asked for."""
    if mode not in MODES:
        raise ValueError(f"isolation mode must be one of {', '.join(MODES)}, got {mode!r}")
    if tier == 1 or (mode != "none" and (mode == "each" or standby) and not ensemble):
        return f"own:{model}"
    if mode == "llm" and streams:
        return LLM_GROUP
    return ""


def streams(repository: Path, model: str) -> bool:
    """Whether the repository's ``model`` is decoupled (an LLM streaming tokens); False when unknown."""
    try:
        return bool(read_config(Path(repository) / model).model_transaction_policy.decoupled)
    except Exception:  # no config (yet), or one Triton would refuse: the shared group
        return False


def ensemble_bound(repository: Path) -> set[str]:
    """The repository's ensembles and every model their steps name (one Triton must hold them all)."""
    out: set[str] = set()
    for path in sorted(Path(repository).glob(f"*/{CONFIG_FILE}")):
        try:
            config = read_config(path)
        except Exception:  # a config Triton would refuse: not an ensemble here
            continue
        if config.platform == ENSEMBLE_PLATFORM:
            out.add(config.name or path.parent.name)
            out.update(step.model_name for step in config.ensemble_scheduling.step)
    return out
