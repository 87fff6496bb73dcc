"""Monthly budgets per team or endpoint: spend so far (the owner view of cost for the calendar
month, UTC), a month-end forecast from the burn so far, the thresholds crossed (50 / 80 / 100 %),
and the optional hard action at 100 %.

- :func:`month_bounds`, :func:`forecast`, :func:`assess` are pure.
- :class:`BudgetGuard` reads the database: the deployer asks it before every deploy
  (:meth:`BudgetGuard.check_deploy`); a budget over 100 % whose hard action is ``refuse_deploys``
  refuses the deploy with :class:`BudgetExceeded` and writes an ``audit_log`` row (action ``budget``,
  outcome ``refused``); ``cap_replicas`` caps the endpoint at the replicas it runs now
  (:meth:`BudgetGuard.replica_cap`), also audited.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from server.control.planning.cost_store import Budget, CostStore
from server.control.planning.cost_views import owner_view
from server.control.planning.prices import PriceBook
from server.errors import Conflict

THRESHOLDS = (0.5, 0.8, 1.0)


class BudgetExceeded(Conflict):
    """A budget's hard action refused the change (FAILED_PRECONDITION / 409)."""


def month_bounds(now: float) -> tuple[float, float]:
    """The UTC calendar month holding ``now``: [first second, first second of the next month)."""
    dt = datetime.fromtimestamp(now, tz=timezone.utc)
    start = datetime(dt.year, dt.month, 1, tzinfo=timezone.utc)
    days = calendar.monthrange(dt.year, dt.month)[1]
    return start.timestamp(), start.timestamp() + days * 86400.0


def forecast(spent: float, start: float, end: float, now: float) -> float:
    """Month-end spend if the month goes on burning as it has so far (linear in elapsed time)."""
    elapsed = min(now, end) - start
    if elapsed <= 0:
        return spent
    return spent * (end - start) / elapsed


@dataclass(frozen=True)
class Assessment:
    budget: Budget
    spent_usd: float
    forecast_usd: float

    @property
    def fraction(self) -> float:
        return self.spent_usd / self.budget.amount_usd

    @property
    def crossed(self) -> tuple[float, ...]:
        return tuple(t for t in THRESHOLDS if self.fraction >= t)

    @property
    def forecast_over(self) -> bool:
        return self.forecast_usd > self.budget.amount_usd

    @property
    def exhausted(self) -> bool:
        return self.fraction >= 1.0

    def as_dict(self) -> dict:
        return {
            "scope": self.budget.scope, "name": self.budget.name, "budget_usd": self.budget.amount_usd, "spent_usd": round(self.spent_usd, 6),
            "forecast_usd": round(self.forecast_usd, 6), "percent": round(100 * self.fraction, 3), "forecast_over": self.forecast_over,
            "hard_action": self.budget.hard_action, "exhausted": self.exhausted,
        }  # fmt: skip


def assess(budgets: list[Budget], owner_rows: list[dict], start: float, end: float, now: float) -> list[Assessment]:
    """Each budget against the owner-view rows of [start, now)."""
    out = []
    for b in budgets:
        key = "team" if b.scope == "team" else "endpoint"
        spent = sum(r["cost_usd"] for r in owner_rows if r[key] == b.name)
        out.append(Assessment(b, spent, forecast(spent, start, end, now)))
    return out


def _money(usd: float) -> str:
    return f"${usd:,.2f}"


class BudgetGuard:
    def __init__(self, store: CostStore, prices: Callable[[], PriceBook], clock: Callable[[], float] = time.time):
        self.store = store
        self.registry = store.registry
        self.prices = prices  # a loader: the price list current when the check runs
        self.clock = clock

    def owners(self) -> dict[str, str]:
        return {m.name: m.owner_team for m in self.registry.list_models()}

    def month_to_date(self, now: float | None = None) -> tuple[list[Assessment], list[dict]]:
        now = self.clock() if now is None else now
        start, end = month_bounds(now)
        rows = owner_view(self.store.intervals(start, now), self.prices(), start, now, self.owners())
        return assess(self.store.budgets(), rows, start, end, now), rows

    def _blocking(self, endpoint: str, action: str) -> list[Assessment]:
        budgets = [b for b in self.store.budgets() if b.hard_action == action]
        if not budgets:
            return []  # the common case: no database read beyond the budgets table
        owner = self.owners().get(endpoint, "")
        mine = [b for b in budgets if (b.scope, b.name) in (("team", owner), ("endpoint", endpoint))]
        if not mine:
            return []
        try:
            assessments, _ = self.month_to_date()
        except ValueError as err:  # no price list, or a ledger row it has no price for: fail closed, say why
            raise Conflict(f"the budget of '{endpoint}' cannot be checked: {err}") from None
        return [a for a in assessments if a.budget in mine and a.exhausted]

    def check_deploy(self, endpoint: str, actor: str = "") -> None:
        """Raise :class:`BudgetExceeded` (and audit it) when a ``refuse_deploys`` budget of the endpoint
        or its owner team is spent."""
        over = self._blocking(endpoint, "refuse_deploys")
        if not over:
            return
        a = over[0]
        message = (
            f"deploy of '{endpoint}' refused: {a.budget.scope} '{a.budget.name}' has spent {_money(a.spent_usd)} of its "
            f"{_money(a.budget.amount_usd)} monthly budget ({100 * a.fraction:.1f} %), and its hard action refuses new deploys; "
            f"raise it with `inferplane budget set {a.budget.name} AMOUNTUSD"
            + (" --endpoint`" if a.budget.scope == "endpoint" else "`")
        )
        self.registry.audit(actor, "budget", endpoint, "refused", message)
        raise BudgetExceeded(message)

    def replica_cap(self, endpoint: str, current: int, actor: str = "") -> int | None:
        """The most replicas ``endpoint`` may run while a ``cap_replicas`` budget of it is spent: the
        ones it runs now (never more); None when no such budget is spent. Audited when it caps."""
        over = self._blocking(endpoint, "cap_replicas")
        if not over:
            return None
        a = over[0]
        self.registry.audit(actor or "budget", "budget", endpoint, "capped",
                            f"{a.budget.scope} '{a.budget.name}' spent {_money(a.spent_usd)} of {_money(a.budget.amount_usd)}: max replicas {current}")  # fmt: skip
        return current
