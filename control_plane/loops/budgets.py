"""The budget loop: every `budget_interval_s` (FLEET_BUDGET_INTERVAL_S, 30 s), one pass
of the team budget policy over every budget (`control_plane.cost.budget_store`): events
for thresholds newly crossed, the decision stored per team. When the set of teams whose
hard budget is spent changes, the key loop is woken so gateways get the keys'
`budget_exhausted` at once (it also follows within `key_lease_interval_s` anyway)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from control_plane.context import ControlPlaneContext
from control_plane.cost.budget_store import Outcome, TeamSpend, evaluate_budgets, exhausted_teams

log = logging.getLogger(__name__)


class BudgetLoop:
    def __init__(
        self, ctx: ControlPlaneContext, interval_s: float | None = None, spend: TeamSpend | None = None
    ) -> None:
        self.ctx = ctx
        self.interval_s = interval_s or ctx.settings.budget_interval_s
        self.spend = spend  # None: the cost report
        self.passes = 0
        self.last: list[Outcome] = []
        self._exhausted: set[str] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> BudgetLoop:
        self._task = asyncio.create_task(self._run(), name="cp-budgets")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def _pass(self) -> tuple[list[Outcome], set[str]]:
        now = time.time()
        with self.ctx.sessions() as session:
            outcomes = evaluate_budgets(session, now, spend=self.spend)
            session.commit()
            return outcomes, exhausted_teams(session, now)

    async def run_once(self) -> list[Outcome]:
        outcomes, exhausted = await asyncio.to_thread(self._pass)
        self.passes += 1
        self.last = outcomes
        if exhausted != self._exhausted:
            if self._exhausted is not None:
                log.warning(
                    "teams refused for a spent hard budget: %s", ", ".join(sorted(exhausted)) or "none"
                )
            self._exhausted = exhausted
            self.ctx.keys_changed.set()
        return outcomes

    async def _run(self) -> None:
        while True:
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the budget pass failed; retrying")
            await asyncio.sleep(self.interval_s)


async def start_budget_loop(ctx: ControlPlaneContext) -> BudgetLoop:
    return await BudgetLoop(ctx).start()
