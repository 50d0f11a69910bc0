"""Admission against shared capacity: an earliest-deadline-first test, tenant quotas and budgets.

``core.feasibility.assess`` judges a job alone on its own pools. When pools are shared (their GPUs
set with ``deadline-batch capacity set``, docs/tenants.md), a job is admitted only if every
admitted, unfinished job on those pools still meets its deadline with it. "Meets" keeps
``core.feasibility``'s margins, per pool: its queue and startup lead, and the recovery reserve
``max(min_recovery_reserve_s, fraction × run)``; pool ``p`` can work ``G_p(d)`` GPU-seconds by
``d``. On one pool of ``C`` GPUs an EDF order meets every deadline iff

    W(d) / C + reserve(W(d) / C) <= d - now - lead        for every deadline d.

Work is divisible and may move between the pools a job may use, so with several pools the exact
condition is a transportation problem: jobs send their GPU-seconds to (pool, interval between
consecutive deadlines) cells they may use, each cell holding ``G_p(d_k) - G_p(d_k-1)``. By Hall's
theorem it is feasible iff for every choice of a cut-off deadline ``D_p`` per pool, the work of
the jobs whose pools all reach their deadline by the cut-off, ``d_j <= D_p`` for each of their
pools ``p``, fits into ``sum_p G_p(D_p)``. One cut-off for a whole pool set is not enough: a job
on pools a and b due early, and one on a only due late, can break with the cut-offs (late, early)
alone. The test solves it as a max flow (polynomial; no enumeration) over the pools linked to the
new job through held jobs; a refusal names the minimum cut: the jobs, and per pool the cut-off,
whose work cannot all be done.

Jobs are reserved by the GPU-seconds their admitted plan needs (``run_seconds × gpus``: the
efficiency margin and expected preemption overhead included), scaled by the share of their
estimated work not yet committed. Pure functions; the store reads the rows and serializes the
admissions so that two admissions never count the same free capacity.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from airflow_deadline_batch.core.clock import ensure_aware
from airflow_deadline_batch.core.feasibility import AdmissionPolicy, format_duration

__all__ = [
    "DeadlineCheck",
    "Demand",
    "EdfResult",
    "SharedPool",
    "budget_refusal",
    "edf_test",
    "gpu_quota_refusals",
    "projected_cost",
    "reserved_gpu_seconds",
    "supply_seconds",
    "window_needed_s",
]


@dataclass(frozen=True, kw_only=True)
class Demand:
    """Work a job holds on shared capacity: GPU-seconds due by its deadline, on the pools it may use."""

    job_id: str
    tenant: str
    deadline: dt.datetime
    gpu_seconds: float
    #: the managed pools the work may run on (empty: every pool of the test)
    pools: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        object.__setattr__(self, "deadline", ensure_aware(self.deadline, "deadline"))
        object.__setattr__(self, "pools", frozenset(self.pools))
        if not self.gpu_seconds >= 0:
            raise ValueError(f"job {self.job_id}: gpu_seconds must be >= 0, got {self.gpu_seconds}")


@dataclass(frozen=True, kw_only=True)
class SharedPool:
    """A managed pool: the GPUs set with ``capacity set`` and the lead before work starts on it."""

    name: str
    gpus: int
    lead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise ValueError(f"pool {self.name}: gpus must be >= 0, got {self.gpus}")
        if not self.lead_s >= 0:
            raise ValueError(f"pool {self.name}: lead_s must be >= 0, got {self.lead_s}")


@dataclass(frozen=True, kw_only=True)
class DeadlineCheck:
    """Work that cannot all be done: jobs due on ``pools`` by their cut-offs against what they give.

    ``deadline`` is the latest cut-off and ``job_id`` the job due last among those counted.
    """

    deadline: dt.datetime
    job_id: str
    demand_s: float
    supply_s: float
    pools: tuple[str, ...] = ()
    #: each pool's cut-off deadline (its capacity until then is counted)
    pool_deadlines: Mapping[str, dt.datetime] = field(default_factory=dict)
    gpus: int = 0
    #: the largest queue and startup lead among ``pools``
    lead_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.demand_s <= self.supply_s + 1e-6

    def to_dict(self) -> dict[str, Any]:
        return {
            "deadline": _iso(self.deadline),
            "job_id": self.job_id,
            "pools": list(self.pools),
            "pool_deadlines": {p: _iso(d) for p, d in sorted(self.pool_deadlines.items())},
            "gpus": self.gpus,
            "demand_gpu_s": round(self.demand_s, 3),
            "supply_gpu_s": round(self.supply_s, 3),
            "ok": self.ok,
        }

    def where(self) -> str:
        """The pools and cut-offs in words."""
        if len(self.pools) <= 1:
            return f"on pool {self.pools[0]}" if self.pools else "on no pool"
        cuts = ", ".join(f"{p} until {_iso(self.pool_deadlines[p])}" for p in self.pools)
        return f"on pools {cuts}"


@dataclass(frozen=True, kw_only=True)
class EdfResult:
    """The verdict of the shared-capacity test for a new job, with what would admit it when refused."""

    job_id: str
    feasible: bool
    #: the GPUs of the new job's managed pools
    gpus: int
    #: the new job's managed pools
    pools: tuple[str, ...] = ()
    lead_s: float
    #: held jobs and managed pools the new job is linked to (what the flow was solved over)
    linked_jobs: int = 0
    linked_pools: tuple[str, ...] = ()
    #: the minimum cut when refused: the jobs due by per-pool cut-offs that cannot all be met
    violated: DeadlineCheck | None
    #: the earliest deadline the new job could have and still be admitted (None: none would do)
    earliest_feasible_deadline: dt.datetime | None
    #: the GPUs on the new job's managed pools that would admit it with its deadline (None: none would)
    gpus_needed: int | None
    #: whether a refusal's two fields above were searched (``edf_test(explain=False)`` skips them)
    explained: bool = True

    def reasons(self) -> list[str]:
        """Sentences with the numbers: the verdict, and when refused, what would work."""
        where = _pool_names(self.pools)
        if self.feasible:
            return [
                f"shared capacity: {self.gpus} GPU(s){where} meet every admitted deadline with this job "
                f"({self.linked_jobs} admitted job(s) on {len(self.linked_pools)} linked pool(s))"
            ]
        bad = self.violated
        assert bad is not None
        head = (
            f"rejected by shared capacity: by {_iso(bad.deadline)} (job {bad.job_id}) the admitted jobs "
            f"due {bad.where()} and this one need {bad.demand_s:,.0f} GPU-seconds but those "
            f"{bad.gpus} GPU(s) give {bad.supply_s:,.0f} after {format_duration(bad.lead_s)} lead and "
            "the recovery reserve"
        )
        fixes = []
        if self.earliest_feasible_deadline is not None:
            fixes.append(f"the earliest feasible deadline is {_iso(self.earliest_feasible_deadline)}")
        if self.gpus_needed is not None:
            fixes.append(f"{self.gpus_needed} shared GPU(s){where} would admit it with its deadline")
        if not self.explained:
            return [head]
        advice = "; ".join(fixes) if fixes else "no later deadline or capacity would admit it"
        return [f"{head}; {advice}"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "feasible": self.feasible,
            "gpus": self.gpus,
            "pools": list(self.pools),
            "lead_seconds": self.lead_s,
            "linked_jobs": self.linked_jobs,
            "linked_pools": list(self.linked_pools),
            "violated": None if self.violated is None else self.violated.to_dict(),
            "earliest_feasible_deadline": _iso(self.earliest_feasible_deadline),
            "gpus_needed": self.gpus_needed,
            "explained": self.explained,
        }


def _iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat().replace("+00:00", "Z")


def _pool_names(pools: Sequence[str]) -> str:
    return f" on {', '.join(pools)}" if len(pools) > 1 else ""


def supply_seconds(gpus: int, window_s: float, policy: AdmissionPolicy) -> float:
    """GPU-seconds ``gpus`` can work in ``window_s`` while keeping the recovery reserve."""
    run = min(window_s - policy.min_recovery_reserve_s, window_s / (1.0 + policy.recovery_reserve_fraction))
    return gpus * max(0.0, run)


def window_needed_s(gpu_seconds: float, gpus: int, policy: AdmissionPolicy) -> float:
    """The shortest window in which ``gpus`` finish ``gpu_seconds`` with the recovery reserve."""
    run = gpu_seconds / gpus
    return max(run + policy.min_recovery_reserve_s, run * (1.0 + policy.recovery_reserve_fraction))


def edf_test(
    new: Demand,
    held: Iterable[Demand],
    *,
    pools: Sequence[SharedPool],
    now: dt.datetime,
    policy: AdmissionPolicy | None = None,
    explain: bool = True,
) -> EdfResult:
    """Whether ``new`` fits on the managed ``pools`` beside the ``held`` work, every deadline met.

    Held work whose deadline has passed is left out (its job expires at its deadline), and so is
    work on none of ``pools``. The new job is admitted iff the max flow grows by all its work:
    held work that already cannot all be done is not the new job's to answer for, unless the new
    job takes capacity it needs. A refusal names the minimum cut and, with ``explain``, the
    earliest deadline that would be admitted and the GPUs on the new job's pools that would admit
    it (searches of some 20 to 40 flows: the caller may run them after releasing a lock).
    """
    policy = policy or AdmissionPolicy()
    now = ensure_aware(now, "now")
    by_name = {p.name: p for p in pools}
    everything = frozenset(by_name)
    mine = _reach(new, everything)
    if not mine:
        raise ValueError(
            f"job {new.job_id}: none of its pools {sorted(new.pools)} is among {sorted(everything)}"
        )
    live = [d for d in held if d.deadline > now and d.job_id != new.job_id and _reach(d, everything)]
    group, linked = _linked(mine, live, everything)
    problem = _Problem(
        pools=tuple(by_name[n] for n in sorted(group)),
        held=tuple(replace(d, pools=_reach(d, everything)) for d in linked),
        now=now,
        policy=policy,
    )
    new = replace(new, pools=mine)
    own = tuple(by_name[n] for n in sorted(mine))
    fits, cut = problem.fits(new)
    result = EdfResult(
        job_id=new.job_id,
        feasible=fits,
        gpus=sum(p.gpus for p in own),
        pools=tuple(p.name for p in own),
        lead_s=max(p.lead_s for p in own),
        linked_jobs=len(linked),
        linked_pools=tuple(sorted(group)),
        violated=cut,
        earliest_feasible_deadline=None,
        gpus_needed=None,
    )
    if fits:
        return result
    if not explain:
        return replace(result, explained=False)
    return replace(
        result,
        earliest_feasible_deadline=problem.earliest_deadline(new),
        gpus_needed=problem.gpus_needed(new, own),
    )


def _reach(demand: Demand, everything: frozenset[str]) -> frozenset[str]:
    return demand.pools & everything if demand.pools else everything


def _linked(
    mine: frozenset[str], live: Sequence[Demand], everything: frozenset[str]
) -> tuple[frozenset[str], list[Demand]]:
    """The pools linked to ``mine`` through held jobs' pool sets, and the held jobs on them.

    A pool not linked shares no job with the new one: its work and capacity change no verdict.
    """
    group = set(mine)
    grew = True
    while grew:
        grew = False
        for d in live:
            reach = _reach(d, everything)
            if reach & group and not reach <= group:
                group |= reach
                grew = True
    return frozenset(group), [d for d in live if _reach(d, everything) <= group]


@dataclass
class _Built:
    """A flow network of one problem and where its parts are."""

    net: _FlowNetwork
    source: int
    sink: int
    cells: dict[tuple[str, dt.datetime], int] = field(default_factory=dict)
    jobs: list[tuple[int, Demand]] = field(default_factory=list)
    edge_of_new: int = -1


@dataclass(frozen=True)
class _Problem:
    """Held work on linked pools, as a transportation problem the new job is added to."""

    pools: tuple[SharedPool, ...]
    held: tuple[Demand, ...]
    now: dt.datetime
    policy: AdmissionPolicy

    def supply(self, pool: SharedPool, at: dt.datetime) -> float:
        """``G_p(at)``: what the pool works by ``at`` after its lead, keeping the recovery reserve."""
        window = (at - self.now).total_seconds() - pool.lead_s
        return supply_seconds(pool.gpus, window, self.policy)

    def fits(
        self, new: Demand, pools: tuple[SharedPool, ...] | None = None
    ) -> tuple[bool, DeadlineCheck | None]:
        """Whether the flow takes all of ``new``'s work beside the held work; the minimum cut if not."""
        pools = pools or self.pools
        built = self._network(new, pools)
        net = built.net
        net.max_flow(built.source, built.sink)  # the held work alone
        net.capacity[built.edge_of_new] = new.gpu_seconds
        if net.max_flow(built.source, built.sink) >= new.gpu_seconds - _FIT_TOLERANCE:
            return True, None
        return False, self._cut(new, pools, built)

    def _network(self, new: Demand, pools: tuple[SharedPool, ...]) -> _Built:
        """source → job (its work) → its pools' cells at its deadline → earlier cells → sink.

        Cell (pool, d) holds the pool's capacity between its previous deadline and ``d``; only the
        deadlines of jobs on the pool cut it, as no work enters it in between. The new job's
        source edge starts closed, so the held work is routed first.
        """
        demands = [*self.held, new]
        net = _FlowNetwork()
        built = _Built(net=net, source=net.node(), sink=net.node())
        for pool in pools:
            before, previous = 0.0, None
            for deadline in sorted({d.deadline for d in demands if pool.name in d.pools}):
                cell = built.cells[pool.name, deadline] = net.node()
                until = self.supply(pool, deadline)
                net.edge(cell, built.sink, until - before)
                before = until
                if previous is not None:  # work due by d may be done in earlier cells
                    net.edge(cell, previous, math.inf)
                previous = cell
        groups: dict[tuple[frozenset[str], dt.datetime], int] = {}  # held jobs alike share a node
        for demand in demands:
            key = (demand.pools, demand.deadline)
            node = groups.get(key) if demand is not new else None
            if node is None:
                node = net.node()
                for name in sorted(demand.pools):
                    net.edge(node, built.cells[name, demand.deadline], math.inf)
                if demand is not new:
                    groups[key] = node
            built.jobs.append((node, demand))
            edge = net.edge(built.source, node, 0.0 if demand is new else demand.gpu_seconds)
            if demand is new:
                built.edge_of_new = edge
        return built

    def _cut(self, new: Demand, pools: tuple[SharedPool, ...], built: _Built) -> DeadlineCheck:
        """The minimum cut's source side: the jobs, and per pool the last cell, it holds."""
        reached = built.net.reachable(built.source)
        counted = [d for node, d in built.jobs if node in reached]
        cut_offs: dict[str, dt.datetime] = {}
        for (name, deadline), cell in built.cells.items():  # a pool's reached cells are a prefix
            if cell in reached and (name not in cut_offs or deadline > cut_offs[name]):
                cut_offs[name] = deadline
        by_name = {p.name: p for p in pools}
        cut_pools = tuple(sorted(cut_offs))
        last = max(counted, key=lambda d: (d.deadline, d is new), default=new)
        return DeadlineCheck(
            deadline=max(cut_offs.values(), default=new.deadline),
            job_id=last.job_id,
            demand_s=math.fsum(d.gpu_seconds for d in counted),
            supply_s=math.fsum(self.supply(by_name[p], d) for p, d in cut_offs.items()),
            pools=cut_pools,
            pool_deadlines=dict(cut_offs),
            gpus=sum(by_name[p].gpus for p in cut_pools),
            lead_s=max((by_name[p].lead_s for p in cut_pools), default=0.0),
        )

    def earliest_deadline(self, new: Demand) -> dt.datetime | None:
        """The least whole second at which ``new`` would fit (a later deadline never hurts)."""
        own = [p for p in self.pools if p.name in new.pools and p.gpus > 0]
        if not own:
            return None
        # by then the new job's own pools alone can work all the linked work and its own
        everything = math.fsum(d.gpu_seconds for d in self.held) + new.gpu_seconds
        lead = max(p.lead_s for p in own)
        run = window_needed_s(everything, sum(p.gpus for p in own), self.policy)
        try:
            high = _ceil_second(self.now + dt.timedelta(seconds=lead + run + 1))
            high = max(high, _ceil_second(new.deadline) + dt.timedelta(seconds=1))
        except (OverflowError, ValueError):
            return None  # the work outlasts any date a deadline can name
        if not self.fits(replace(new, deadline=high))[0]:
            return None  # held work that already cannot be done leaves it no room
        low = _ceil_second(new.deadline)  # refused at new.deadline, so at most this second
        if self.fits(replace(new, deadline=low))[0] and low > new.deadline:
            return low
        while (high - low).total_seconds() > 1:
            mid = low + dt.timedelta(seconds=int((high - low).total_seconds()) // 2)
            if self.fits(replace(new, deadline=mid))[0]:
                high = mid
            else:
                low = mid
        return high

    def gpus_needed(self, new: Demand, own: Sequence[SharedPool]) -> int | None:
        """The fewest GPUs on the new job's pools that admit it, added where the lead is largest."""
        slowest = max(own, key=lambda p: (p.lead_s, p.name))
        per_gpu = self.supply(replace(slowest, gpus=1), new.deadline)
        if per_gpu <= 0 or not new.gpu_seconds / per_gpu < 1 << 30:
            return None  # no GPUs finish it by its deadline (or more than the search would try)

        def with_extra(extra: int) -> tuple[SharedPool, ...]:
            return tuple(replace(p, gpus=p.gpus + extra) if p is slowest else p for p in self.pools)

        low, high = 0, max(1, math.ceil(new.gpu_seconds / per_gpu))  # enough for the new job alone
        while not self.fits(new, with_extra(high))[0]:
            high *= 2  # float margins: never expected, but a search must end
            if high > 1 << 30:
                return None
        while high - low > 1:
            mid = (low + high) // 2
            if self.fits(new, with_extra(mid))[0]:
                high = mid
            else:
                low = mid
        return sum(p.gpus for p in own) + high


#: capacity below which a residual edge counts as full (GPU-seconds)
_TOLERANCE = 1e-9
#: work that may be left over and the job still fits (GPU-seconds; as ``DeadlineCheck.ok``)
_FIT_TOLERANCE = 1e-6


class _FlowNetwork:
    """A max-flow network with float capacities (Dinic's algorithm); small: jobs plus pool cells."""

    def __init__(self) -> None:
        self.adjacent: list[list[int]] = []
        self.head: list[int] = []
        self.capacity: list[float] = []

    def node(self) -> int:
        self.adjacent.append([])
        return len(self.adjacent) - 1

    def edge(self, a: int, b: int, capacity: float) -> int:
        """An edge and its residual twin (``edge ^ 1``); returns the edge's index."""
        self.adjacent[a].append(len(self.head))
        self.head.append(b)
        self.capacity.append(max(0.0, capacity))
        self.adjacent[b].append(len(self.head))
        self.head.append(a)
        self.capacity.append(0.0)
        return len(self.head) - 2

    def _open(self, edge: int) -> bool:
        return self.capacity[edge] > _TOLERANCE

    def _levels(self, source: int, sink: int) -> list[int] | None:
        level = [-1] * len(self.adjacent)
        level[source] = 0
        queue = [source]
        capacity, head = self.capacity, self.head  # the hot loop: no attribute or method lookups
        for node in queue:
            below = level[node] + 1
            for edge in self.adjacent[node]:
                nxt = head[edge]
                if level[nxt] < 0 and capacity[edge] > _TOLERANCE:
                    level[nxt] = below
                    queue.append(nxt)
        return level if level[sink] >= 0 else None

    def _augment(self, source: int, sink: int, level: list[int], cursor: list[int]) -> float:
        """Push one augmenting path of the level graph (an iterative search); 0 when none is left."""
        path: list[int] = []
        node = source
        while node != sink:
            while cursor[node] < len(self.adjacent[node]):
                edge = self.adjacent[node][cursor[node]]
                if self._open(edge) and level[self.head[edge]] == level[node] + 1:
                    break
                cursor[node] += 1
            else:  # a dead end: never visit it again in this phase, step back
                if not path:
                    return 0.0
                level[node] = -1
                node = self.head[path.pop() ^ 1]
                cursor[node] += 1
                continue
            path.append(edge)
            node = self.head[edge]
        amount = min(self.capacity[e] for e in path)
        for edge in path:
            self.capacity[edge] -= amount
            self.capacity[edge ^ 1] += amount
        return amount

    def max_flow(self, source: int, sink: int) -> float:
        """Augment from the current flow to a maximum; returns what was added."""
        total = 0.0
        while (level := self._levels(source, sink)) is not None:
            cursor = [0] * len(self.adjacent)
            while (pushed := self._augment(source, sink, level, cursor)) > _TOLERANCE:
                total += pushed
        return total

    def reachable(self, source: int) -> set[int]:
        """Nodes reachable from ``source`` in the residual network: the source side of a minimum cut."""
        seen = {source}
        queue = [source]
        for node in queue:
            for edge in self.adjacent[node]:
                if self._open(edge) and self.head[edge] not in seen:
                    seen.add(self.head[edge])
                    queue.append(self.head[edge])
        return seen


def _ceil_second(value: dt.datetime) -> dt.datetime:
    whole = value.replace(microsecond=0)
    return whole if whole == value else whole + dt.timedelta(seconds=1)


def reserved_gpu_seconds(
    admission: Mapping[str, Any] | None,
    est_work_s: float,
    remaining_work_s: float,
    policy: AdmissionPolicy,
    work_scale: float = 1.0,
) -> float:
    """GPU-seconds a job still holds: its admitted plan's (run × GPUs) times the share of work left.

    Without a plan in the report (an older job), its estimated work over the policy's efficiency.
    ``work_scale`` is the slowdown its committed microbatches measured (``JobView.work_scale``):
    a job that runs slower than estimated holds more.
    """
    chosen = (admission or {}).get("chosen") or {}
    run, gpus = chosen.get("run_seconds"), chosen.get("gpus")
    scale = work_scale if math.isfinite(work_scale) and work_scale > 0 else 1.0
    if isinstance(run, int | float) and isinstance(gpus, int) and math.isfinite(run) and est_work_s > 0:
        return float(run) * gpus * max(0.0, min(1.0, remaining_work_s / est_work_s)) * scale
    return max(0.0, remaining_work_s) / policy.efficiency * scale


def projected_cost(admission: Mapping[str, Any] | None) -> float:
    """The cost of a job's admitted plan (``cost_units``), 0 without one."""
    cost = ((admission or {}).get("chosen") or {}).get("cost_units")
    return float(cost) if isinstance(cost, int | float) and math.isfinite(cost) else 0.0


def budget_refusal(
    tenant: str, cost: float, spent: Iterable[float], budget: float | None, period_s: float | None
) -> str | None:
    """Why a job of ``cost`` breaks the tenant's budget for the period (None: it fits)."""
    if budget is None:
        return None
    if not math.isfinite(cost):  # NaN passes no comparison: it would pass every budget
        return (
            f"rejected by tenant {tenant}'s budget: this job's projected cost is {cost}, not an amount; "
            "give each of its pools a finite price_per_gpu_hour and finite rates"
        )
    used = math.fsum(spent)
    if used + cost <= budget + 1e-9:
        return None
    return (
        f"rejected by tenant {tenant}'s budget: {used:.2f} spent or reserved in the last "
        f"{format_duration(period_s or 0.0)} plus this job's projected {cost:.2f} is "
        f"{used + cost:.2f}, above the budget of {budget:.2f}; raise it with `deadline-batch quota "
        f"set {tenant} --budget`, wait for the period to roll, or shrink the job"
    )


def gpu_quota_refusals(
    tenant: str, plan_gpus: Mapping[str, int], quota: Mapping[str, int | None]
) -> list[str]:
    """Why the admitted plan's GPUs per pool kind exceed the tenant's quota (empty: within it)."""
    out = []
    for kind, n in sorted(plan_gpus.items()):
        limit = quota.get(kind)
        if limit is not None and n > limit:
            out.append(
                f"rejected by tenant {tenant}'s quota: the plan needs {n} {kind} GPU(s) at once, the "
                f"quota allows {limit}; run with fewer workers or raise the quota "
                f"(`deadline-batch quota set {tenant} --{kind.replace('_', '-')}-gpus N`)"
            )
    return out
