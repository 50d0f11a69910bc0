"""The ``deadline-batch`` command (docs/design.md §8): run, plan, status, verify, cancel, simulate.

Exit codes: 0 manifest published; 2 usage or configuration error; 3 rejected at admission;
4 finished without a complete manifest. User errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import math
import os
import re
import signal
import stat
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import orjson

from airflow_deadline_batch.core.clock import MAX_SECONDS, SystemClock
from airflow_deadline_batch.core.deadlines import parse_deadline
from airflow_deadline_batch.core.exit_codes import EXIT_INCOMPLETE, EXIT_OK, EXIT_REJECTED, EXIT_USAGE
from airflow_deadline_batch.core.feasibility import AdmissionReport, format_duration
from airflow_deadline_batch.core.pools import PoolSpec, default_local_pools
from airflow_deadline_batch.core.states import JobState
from airflow_deadline_batch.core.tenants import DEFAULT_TENANT, check_tenant
from airflow_deadline_batch.exceptions import (
    AdmissionRejected,
    ConfigurationError,
    DeadlineBatchError,
    InvalidTransition,
    StorageError,
)

if TYPE_CHECKING:
    from airflow_deadline_batch.service.planning import PlanRequest
    from airflow_deadline_batch.store import ManifestStore

DEFAULT_HOME = ".deadline-batch"
ENGINES = ("echo", "transformers", "vllm", "openai")
#: the environment variables that give the store and the output when ``--store``/``--output`` are left out
STORE_VARIABLE = "ADB_STORE_URL"
OUTPUT_VARIABLE = "ADB_OUTPUT_URI"


def default_store_url() -> str:
    if os.environ.get(STORE_VARIABLE):
        return os.environ[STORE_VARIABLE]
    return f"sqlite:///{Path(DEFAULT_HOME).resolve() / 'store.db'}"


def default_output() -> str:
    return os.environ.get(OUTPUT_VARIABLE) or str(Path(DEFAULT_HOME).resolve() / "output")


def _source(args: argparse.Namespace, option: str) -> str:
    """Where the value of ``--store`` or ``--output`` came from, as an error's fix names it: the
    option, or the environment variable that stood in for it (the user set that one, not the option)."""
    variable = STORE_VARIABLE if option == "--store" else OUTPUT_VARIABLE
    given = getattr(args, option.removeprefix("--"), None)
    return variable if given is None and os.environ.get(variable) else option


class _Parser(argparse.ArgumentParser):
    #: the last usage error, for the ``--json`` line (argparse exits from inside ``parse_args``)
    last_error: str | None = None

    def error(self, message: str) -> NoReturn:  # one line and exit 2, as for every other usage error
        _Parser.last_error = f"{_printable(redact(message))} (see {self.prog} --help)"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_Parser.last_error}\n")


#: the largest count (workers, tokens, records per commit) the command takes: the store's and the
#: planner's integer columns hold more, but a larger value is a typo, and past 2**63 it would not fit
MAX_COUNT = 2**31 - 1


#: the shortest ``run --lease-ttl``: a worker renews its lease every third of it, so a shorter one
#: expires between renewals on a loaded machine and no attempt keeps its shard
MIN_LEASE_TTL_S = 1.0


def _count(text: str) -> int:
    """An argparse type: a whole number from 1 to :data:`MAX_COUNT`."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text} is out of range: give a whole number from 1 to {MAX_COUNT}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="deadline-batch", description="Deadline-aware LLM batch inference on Spot GPUs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def job_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("input", metavar="INPUT", help="JSON Lines input: a local path or s3://bucket/key")
        p.add_argument(
            "--deadline", required=True, help="ISO 8601 instant with a time zone, or +DURATION (+2h)"
        )
        p.add_argument("--workers", type=_count, default=4, help="shards processed at once (default 4)")
        p.add_argument(
            "--engine",
            choices=ENGINES,
            default=None,
            help="inference engine (run: transformers; plan: echo rates unless --pools)",
        )
        p.add_argument("--model", default=None, help="model name or local directory (engine-specific)")
        p.add_argument("--max-tokens", type=_count, default=None, help="default max output tokens per record")
        p.add_argument("--microbatch-size", type=_count, default=None, help="records per durable commit")
        p.add_argument("--pools", metavar="FILE", default=None, help="JSON file: a list of pool definitions")
        p.add_argument(
            "--max-invalid-fraction",
            type=float,
            default=0.1,
            help="reject the job when more input lines than this are invalid (default 0.1)",
        )
        p.add_argument("--json", action="store_true", help="print one JSON object (the last stdout line)")
        # tenants (docs/tenants.md)
        p.add_argument(
            "--tenant", default=None, help="the team the job belongs to (default: default; docs/tenants.md)"
        )

    run = sub.add_parser("run", help="run a whole job locally: plan, workers, verification, publication")
    job_options(run)
    run.add_argument("--output", default=None, help="output base: a directory or s3://bucket/prefix")
    run.add_argument("--store", default=None, help="manifest store URL (default: a SQLite file)")
    run.add_argument(
        "--preempt-rate",
        type=float,
        default=0.0,
        metavar="PER_WORKER_HOUR",
        help="inject Spot-style preemptions at this rate per Spot worker-hour",
    )
    run.add_argument(
        "--preempt-notice",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="seconds between SIGTERM and SIGKILL of a preempted worker (default 5)",
    )
    run.add_argument("--seed", type=int, default=0, help="seed of the preemption injector")
    run.add_argument(
        "--idempotency-key",
        default=None,
        help="repeat a submission without creating a second job (default: derived from the input's "
        "SHA-256 and the options, so rerunning the same command resumes the same job)",
    )
    run.add_argument(
        "--new-job",
        action="store_true",
        help="start a fresh job even if the same input and options already have an unfinished one",
    )
    run.add_argument("--lease-ttl", type=float, default=30.0, help="worker lease time-to-live in seconds")

    plan = sub.add_parser("plan", help="validate the input and report feasibility; nothing runs")
    job_options(plan)

    for name, text in (
        ("status", "show a job's committed progress"),
        ("verify", "verify a job's outcomes; exit 0 only if complete and intact"),
        ("cancel", "cancel a job and publish its manifest: unfinished records become cancelled"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("job_id", metavar="JOB_ID")
        p.add_argument("--store", default=None, help="manifest store URL (default: a SQLite file)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "cancel":
            p.add_argument(
                "--no-publish",
                action="store_true",
                help="only stop the job; whoever finalizes it (the runner, the sensor) publishes",
            )
            p.add_argument(
                "--reason",
                default=None,
                help="why, kept as the job's error (status and the UI show it); default: who, where",
            )
    _add_tenant_parsers(sub)
    export = sub.add_parser(
        "export", help="write a published job's outcomes as OpenAI Batch output, error and retry files"
    )
    export.add_argument("job_id", metavar="JOB_ID")
    export.add_argument("--format", choices=("openai",), default="openai", help="output format (openai)")
    export.add_argument("--output", required=True, help="directory or s3://bucket/prefix to write to")
    export.add_argument("--store", default=None, help="manifest store URL (default: a SQLite file)")
    export.add_argument("--json", action="store_true", help="print one JSON object")
    try:
        from airflow_deadline_batch.sim.cli import add_simulate_parser
    except ImportError:  # pragma: no cover - the simulator ships with the package
        pass
    else:
        add_simulate_parser(sub)
    return parser


# -- tenants: usage, capacity, quota (docs/tenants.md) -----------------------------------------------


def _add_tenant_parsers(sub: Any) -> None:
    usage = sub.add_parser("usage", help="settled usage and cost per tenant (docs/tenants.md)")
    usage.add_argument("--tenant", default=None, help="only this tenant (default: every tenant)")
    usage.add_argument(
        "--since",
        default=None,
        help="attempts started at or after: an ISO 8601 instant, or a duration back from now (24h, 7d)",
    )
    usage.add_argument("--store", default=None, help="manifest store URL (default: a SQLite file)")
    usage.add_argument("--json", action="store_true", help="print one JSON object")

    capacity = sub.add_parser("capacity", help="shared GPU capacity of pools (docs/tenants.md)")
    cap = capacity.add_subparsers(dest="action", required=True, parser_class=_Parser)
    cap_set = cap.add_parser("set", help="set a pool's shared GPUs: admission then checks every deadline")
    cap_set.add_argument("pool", metavar="POOL", help="pool name, as in the jobs' pool definitions")
    cap_set.add_argument("--gpus", type=int, required=True, help="GPUs of the pool shared by all tenants")
    cap_list = cap.add_parser("list", help="each pool's GPUs, reservations and free capacity")
    cap_list.add_argument(
        "--until", default="+24h", help="free capacity until: ISO 8601 instant or +DURATION (default +24h)"
    )
    cap_del = cap.add_parser("delete", help="stop managing a pool: its jobs are admitted alone again")
    cap_del.add_argument("pool", metavar="POOL")
    quota = sub.add_parser("quota", help="GPU quotas and budgets per tenant (docs/tenants.md)")
    qa = quota.add_subparsers(dest="action", required=True, parser_class=_Parser)
    q_set = qa.add_parser("set", help="set (replace) a tenant's quota; omitted limits are unlimited")
    q_set.add_argument("tenant", metavar="TENANT")
    q_set.add_argument("--spot-gpus", type=int, default=None, help="max Spot GPUs at once")
    q_set.add_argument("--on-demand-gpus", type=int, default=None, help="max on-demand GPUs at once")
    q_set.add_argument("--budget", type=float, default=None, help="cost budget per period (pool price units)")
    q_set.add_argument("--period", default="+1d", help="budget period as +DURATION (default +1d)")
    q_set.add_argument(
        "--weight",
        type=float,
        default=1.0,
        help="weight in the fair shares of managed pools' GPUs (default 1; docs/tenants.md, Dispatch)",
    )
    qa.add_parser("list", help="every tenant's quota")
    q_del = qa.add_parser("delete", help="remove a tenant's quota (no limits)")
    q_del.add_argument("tenant", metavar="TENANT")
    for p in (*cap.choices.values(), *qa.choices.values()):
        p.add_argument("--store", default=None, help="manifest store URL (default: a SQLite file)")
        p.add_argument("--json", action="store_true", help="print one JSON object")


def _labels(parser: argparse.ArgumentParser, command: Sequence[str]) -> dict[str, str]:
    """How the user wrote each argument of the (sub)command ``command`` names: ``--store``, ``INPUT``."""
    labels: dict[str, str] = {}
    for action in parser._actions:  # argparse keeps no public list of a parser's arguments
        if isinstance(action, argparse._SubParsersAction):
            if command and command[0] in action.choices:
                labels.update(_labels(action.choices[command[0]], command[1:]))
        elif action.option_strings:
            labels[action.dest] = max(action.option_strings, key=len)
        else:
            labels[action.dest] = str(action.metavar or action.dest.upper())
    return labels


def _check_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Values argparse lets through that no option means: an empty string (an unset shell variable,
    which an ``or`` would otherwise turn into the default store, output or tenant) and a number that
    is not finite (``nan``, ``inf``: every float option is a bounded quantity)."""
    command = [v for v in (getattr(args, "command", None), getattr(args, "action", None)) if v]
    labels = _labels(parser, command)
    for dest, value in vars(args).items():
        label = labels.get(dest)
        if label is None:
            continue
        if isinstance(value, str) and not value.strip():
            leave_out = f", or leave {label} out for its default" if label.startswith("-") else ""
            raise ConfigurationError(f"{label} is empty: give a value{leave_out}")
        if isinstance(value, list) and any(isinstance(v, str) and not v.strip() for v in value):
            raise ConfigurationError(f"{label} is empty: give a value")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigurationError(f"{label} {value}: give a finite number")


def _usage_error(exc: ValueError) -> ConfigurationError:
    return ConfigurationError(str(exc))


def _named_tenant(text: str) -> str:
    """A tenant named on the command line: an empty name is a mistake (an unset shell variable), not
    the ``default`` tenant that a job submitted without one belongs to."""
    if not text.strip():
        raise ConfigurationError(
            f"tenant name is empty: name it (jobs submitted without a tenant belong to {DEFAULT_TENANT!r})"
        )
    try:
        return check_tenant(text)
    except ValueError as exc:
        raise _usage_error(exc) from None


def _open_admin_store(args: argparse.Namespace) -> ManifestStore:
    """``capacity``/``quota``: ``set`` may come before any job, so it creates the store if needed."""
    if args.action == "set":
        return _open_run_store(args.store or default_store_url(), _source(args, "--store"))
    return _open_store(args)


def cmd_capacity(args: argparse.Namespace) -> int:
    from airflow_deadline_batch.service.admission import capacity_view

    store = _open_admin_store(args)
    if args.action == "set":
        try:
            row = store.set_capacity(args.pool, args.gpus)
        except ValueError as exc:
            raise _usage_error(exc) from None
        _emit(args, {"pool": row.pool, "gpus": row.gpus}, f"pool {row.pool}: {row.gpus} shared GPU(s)")
        return EXIT_OK
    if args.action == "delete":
        gone = store.delete_capacity(args.pool)
        _emit(
            args,
            {"pool": args.pool, "deleted": gone},
            f"pool {args.pool}: " + ("no longer managed" if gone else "was not managed"),
        )
        return EXIT_OK
    now = SystemClock().now()
    try:
        until = parse_deadline(args.until, now)
    except ValueError as exc:
        raise ConfigurationError(f"--until {args.until}: {exc}") from None
    except OverflowError:
        msg = f"--until {args.until}: beyond the calendar; use a nearer one (+7d)"
        raise ConfigurationError(msg) from None
    pools = capacity_view(store.admission_snapshot(DEFAULT_TENANT), until)
    lines = [f"shared capacity until {until.isoformat(timespec='seconds')}:"]
    out = []
    for p in pools:
        rates, slots = _pool_rates(store, p.pool), _pool_slots(store, p.pool)
        out.append({**p.to_dict(), "rates": rates, "dispatch": slots})
        lines.append(
            f"  {p.pool}: {p.gpus} GPU(s), {len(p.reservations)} job(s) hold {p.reserved_gpu_s:,.0f} "
            f"GPU-s, free {p.free_gpu_s:,.0f} GPU-s; slots granted {slots['granted']}, "
            f"requests waiting {slots['waiting']}"
        )
        lines.extend(
            f"    {r.job_id} ({r.tenant}): {r.reserved_gpu_s:,.0f} GPU-s due {r.deadline.isoformat()}"
            for r in p.reservations
        )
        lines.extend(
            f"    measured {r['model']}: {r['tokens_per_s']:,.0f} tokens/s per GPU over {r['commits']} "
            f"commit(s) of {r['jobs']} job(s)"
            for r in rates
        )
    if not pools:
        lines.append("  no pool is managed: every job is admitted alone (deadline-batch capacity set)")
    _emit(args, {"until": until.isoformat(), "pools": out}, "\n".join(lines))
    return EXIT_OK


def _pool_rates(store: ManifestStore, pool: str) -> list[dict[str, Any]]:
    """What earlier jobs measured on ``pool``, one entry per model (the rates new jobs are planned at)."""
    from airflow_deadline_batch.store.throughput import model_key

    out = []
    for engine, model in store.pool_models(pool):
        rate = store.measured_rates([pool], engine=engine, model=model)[pool]
        if rate.tokens_per_s is not None:
            out.append({"model": model_key(engine, model), **rate.to_dict()})
    return out


def _pool_slots(store: ManifestStore, pool: str) -> dict[str, int]:
    """Dispatch on ``pool`` now: slots granted to shards and requests waiting for one."""
    requests = store.dispatch_requests(pool)
    granted = sum(1 for r in requests if r.granted_at is not None)
    return {"granted": granted, "waiting": len(requests) - granted}


def cmd_quota(args: argparse.Namespace) -> int:
    from airflow_deadline_batch.core.deadlines import parse_duration
    from airflow_deadline_batch.store import TenantQuotaRow

    tenant = "" if args.action == "list" else _named_tenant(args.tenant)
    store = _open_admin_store(args)
    if args.action == "set":
        try:
            period = parse_duration(args.period).total_seconds() if args.budget is not None else None
        except OverflowError:
            raise ConfigurationError(f"--period {args.period}: too long; use a shorter one (+30d)") from None
        except ValueError as exc:
            raise _usage_error(exc) from None
        try:
            row = store.set_quota(
                TenantQuotaRow(
                    tenant=tenant,
                    spot_gpus=args.spot_gpus,
                    on_demand_gpus=args.on_demand_gpus,
                    budget=args.budget,
                    budget_period_s=period,
                    weight=args.weight,
                )
            )
        except ValueError as exc:
            raise _usage_error(exc) from None
        rows = [row]
    elif args.action == "delete":
        gone = store.delete_quota(tenant)
        _emit(
            args,
            {"tenant": tenant, "deleted": gone},
            f"tenant {tenant}: " + ("quota removed" if gone else "had no quota"),
        )
        return EXIT_OK
    else:
        rows = store.list_quotas()
    data = [
        {
            "tenant": r.tenant,
            "spot_gpus": r.spot_gpus,
            "on_demand_gpus": r.on_demand_gpus,
            "budget": r.budget,
            "budget_period_s": r.budget_period_s,
            "weight": r.weight,
        }
        for r in rows
    ]

    def limit(value: object) -> str:
        return "unlimited" if value is None else str(value)

    lines = [
        f"{r.tenant}: spot GPUs {limit(r.spot_gpus)}, on-demand GPUs {limit(r.on_demand_gpus)}, budget "
        + (
            "unlimited"
            if r.budget is None
            else f"{r.budget:.2f} per {format_duration(r.budget_period_s or 0.0)}"
        )
        + f", weight {r.weight:g}"
        for r in rows
    ] or ["no quotas: every tenant is unlimited"]
    _emit(args, {"quotas": data}, "\n".join(lines))
    return EXIT_OK


def _parse_since(text: str | None, now: dt.datetime) -> dt.datetime | None:
    """``--since``: an aware ISO 8601 instant, or a duration (``24h``, ``-7d``) back from ``now``."""
    from airflow_deadline_batch.core.deadlines import parse_duration

    if text is None:
        return None
    value = text.strip()
    if re.match(r"^[-+]?\d", value) and value[-1:] in "dhms" and "T" not in value:
        try:
            return now - parse_duration("+" + value.lstrip("+-"))
        except ValueError as exc:
            raise ConfigurationError(f"--since {text}: {exc}") from None
        except OverflowError:
            raise ConfigurationError(
                f"--since {text}: reaches back before the calendar; leave --since out for everything"
            ) from None
    try:
        return parse_deadline(value, now)
    except ValueError:
        raise ConfigurationError(
            f"--since {text}: use an ISO 8601 instant with a time zone (2026-12-01T06:00:00Z) "
            "or a duration back from now (24h, 7d)"
        ) from None


def cmd_usage(args: argparse.Namespace) -> int:
    from airflow_deadline_batch.service.settlement import usage_by_tenant

    now = SystemClock().now()
    since = _parse_since(args.since, now)
    tenant = None if args.tenant is None else _named_tenant(args.tenant)
    store = _open_store(args)
    report = usage_by_tenant(*store.usage_totals(tenant=tenant, since=since))
    payload = {
        "since": since.isoformat() if since else None,
        "tenant": tenant,
        "tenants": [t.to_dict() for t in report],
    }
    lines = [f"settled usage since {since.isoformat(timespec='seconds') if since else 'the beginning'}:"]
    for t in report:
        u = t.usage
        lines.append(
            f"  {u.tenant}: {t.jobs} job(s), {u.attempts} attempt(s), {u.prompt_tokens:,} prompt + "
            f"{u.completion_tokens:,} completion tokens, {u.gpu_seconds:,.1f} GPU-s, cost {u.cost:.4f}"
        )
        lines.extend(
            f"    {name}: {p.attempts} attempt(s), {p.gpu_seconds:,.1f} GPU-s, cost {p.cost:.4f}"
            for name, p in t.pools.items()
        )
    if not report:
        lines.append("  nothing settled" + (f" for tenant {tenant}" if tenant else ""))
    _emit(args, payload, "\n".join(lines))
    return EXIT_OK


#: the largest ``--pools`` file read: a list of pools is kilobytes, so more is not one (``/dev/zero``
#: or a misnamed dump would otherwise be read into memory whole)
MAX_POOLS_FILE_BYTES = 16 * 2**20


def _load_pools(path: str | None, engine: str) -> tuple[PoolSpec, ...]:
    if path is None:
        return default_local_pools(engine)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigurationError(f"pools file {path} does not exist: pass a JSON list of pools") from None
    except OSError as exc:
        raise ConfigurationError(f"pools file {path} cannot be read ({exc.strerror}): fix --pools") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigurationError(f"pools file {path} is a directory: give the path of a JSON file in it")
    if not stat.S_ISREG(info.st_mode):  # a FIFO would block for ever, a device never end
        raise ConfigurationError(
            f"pools file {path} is not a regular file (a FIFO, device or socket): fix --pools"
        )
    if info.st_size > MAX_POOLS_FILE_BYTES:
        raise ConfigurationError(
            f"pools file {path} holds {info.st_size:,} bytes, more than a list of pools "
            f"({MAX_POOLS_FILE_BYTES // 2**20} MiB at most): check --pools"
        )
    try:
        data = orjson.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ConfigurationError(f"pools file {path} cannot be read ({exc.strerror}): fix --pools") from None
    except orjson.JSONDecodeError as exc:
        raise ConfigurationError(f"pools file {path} is not valid JSON ({exc}): fix its syntax") from None
    items = data.get("pools", data) if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise ConfigurationError(f"pools file {path} must hold a non-empty JSON list of pools")
    try:
        return tuple(PoolSpec.from_dict(item) for item in items)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"pools file {path}: {exc}") from None


class Stopped(BaseException):
    """SIGINT or SIGTERM reached ``deadline-batch``: unwind (workers stopped, leases released)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # 130 for SIGINT, 143 for SIGTERM (docs/design.md §8)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


@contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM is handled like SIGINT: the first one unwinds the command through its cleanups.

    Later ones are ignored while the cleanup runs (it stops the workers within their grace), but
    by a Python handler, not SIG_IGN, which a worker launched meanwhile would inherit.
    """

    def again(_signum: int, _frame: FrameType | None) -> None:
        return None

    def stop(signum: int, _frame: FrameType | None) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, again)
        raise Stopped(signum)

    previous: dict[int, Any] = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, stop)
    except ValueError:  # not the main thread (an embedding caller): leave its handlers alone
        yield
        return
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@dataclass
class _RunContext:
    """What ``run`` (or ``cancel``) has done so far, for the line printed when it stops early."""

    idempotency_key: str | None = None
    default_key: bool = False
    job_id: str | None = None
    store: ManifestStore | None = None
    #: ``cancel``: the job's cancellation committed (publication may be left)
    cancelled: bool = False

    def resume_hint(self) -> str:
        if self.job_id is None:
            return "no job was recorded; rerun the command to start it"
        if self.default_key:
            return f"committed work of job {self.job_id} is kept; rerun the same command to resume it"
        return (
            f"committed work of job {self.job_id} is kept; rerun with "
            f"--idempotency-key {self.idempotency_key} to resume it"
        )

    def state(self) -> str | None:
        if self.job_id is None or self.store is None:
            return None
        try:
            return self.store.get_job(self.job_id).state.value
        except Exception:  # the store may be what failed
            return None


#: job states after which a default-keyed rerun starts a new job instead of returning this one
_RESTART_STATES = frozenset(
    s.value for s in (JobState.REJECTED, JobState.CANCELLED, JobState.PARTIAL, JobState.FAILED)
)


def default_idempotency_key(request: PlanRequest) -> str:
    """The idempotency key of a ``run`` without ``--idempotency-key``: same input bytes, same job.

    Derived from the input's SHA-256 and every option that changes the plan or the outputs (not
    the deadline, nor the worker count or preemption injection), so rerunning an interrupted
    command resumes its job (docs/design.md §8).
    """
    from airflow_deadline_batch.service.planning import hash_input

    options = {
        "input": request.input_uri,
        "input_sha256": hash_input(request.input_uri),
        "output": request.output_uri,
        "engine": request.engine,
        "model": request.model,
        "generation": dict(request.generation),
        "microbatch_size": request.microbatch_size,
        "max_invalid_fraction": request.max_invalid_fraction,
        "pools": [p.to_dict() for p in request.pools],
    }
    if request.tenant != DEFAULT_TENANT:  # keys of jobs from before tenants stay as they were
        options["tenant"] = request.tenant
    digest = hashlib.sha256(orjson.dumps(options, option=orjson.OPT_SORT_KEYS, default=str)).hexdigest()
    return f"run-{digest[:32]}"


def _resolve_key(
    args: argparse.Namespace, request: PlanRequest, store: ManifestStore, ctx: _RunContext
) -> str:
    if args.idempotency_key:
        if args.new_job:
            raise ConfigurationError("--new-job and --idempotency-key exclude each other: pass one")
        ctx.idempotency_key = args.idempotency_key
        return str(args.idempotency_key)
    base = default_idempotency_key(request)
    if args.new_job:
        ctx.idempotency_key = f"{base}.{uuid.uuid4().hex[:12]}"
        return ctx.idempotency_key
    n = 0
    while True:  # a job that ended without a full manifest is not resumed by the default key
        key = base if n == 0 else f"{base}.{n}"
        job = store.get_job_by_idempotency_key(key)
        if job is None or job.state.value not in _RESTART_STATES:
            ctx.idempotency_key, ctx.default_key = key, True
            return key
        n += 1


def _absolute(path: str) -> str:
    """``path`` made absolute, its symlinks resolved where they can be (a symlink loop stays as
    given, for planning to refuse it by name: ``resolve`` raises ``RuntimeError`` on one)."""
    try:
        return str(Path(path).resolve())
    except (RuntimeError, OSError):
        return os.path.abspath(path)


def _plan_request(args: argparse.Namespace, engine: str, output: str) -> PlanRequest:
    from airflow_deadline_batch.service.planning import PlanRequest

    clock = SystemClock()
    try:
        deadline = parse_deadline(args.deadline, clock.now())
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    except OverflowError:
        raise ConfigurationError(
            f"--deadline {args.deadline} is beyond the year 9999: give a nearer deadline"
        ) from None
    generation: dict[str, Any] = {}
    if args.max_tokens is not None:
        generation["max_tokens"] = args.max_tokens
    elif engine == "transformers":
        generation["max_tokens"] = 48  # a short summary per record keeps the CPU demo brisk
    extra: dict[str, Any] = {}
    if args.microbatch_size is not None:
        extra["microbatch_size"] = args.microbatch_size
    elif engine == "transformers":
        extra["microbatch_size"] = 8
    if getattr(args, "idempotency_key", None):
        extra["idempotency_key"] = args.idempotency_key
    if getattr(args, "lease_ttl", None):
        extra["lease_ttl_s"] = args.lease_ttl
    if not 0 <= args.max_invalid_fraction <= 1:  # the planner's own message names its field, not the option
        raise ConfigurationError(
            f"--max-invalid-fraction must be between 0 and 1, got {args.max_invalid_fraction} (default 0.1)"
        )
    input_uri = args.input if "://" in args.input else _absolute(args.input)
    return PlanRequest(
        input_uri=input_uri,
        deadline=deadline,
        output_uri=output,
        engine=engine,
        model=args.model,
        generation=generation,
        pools=_load_pools(args.pools, engine),
        workers=args.workers,
        max_invalid_fraction=args.max_invalid_fraction,
        tenant=args.tenant or DEFAULT_TENANT,
        **extra,
    )


def _emit(args: argparse.Namespace, payload: dict[str, Any], text: str) -> None:
    if getattr(args, "json", False):
        _write_stdout(orjson.dumps(payload, default=str).decode() + "\n")
    else:
        _write_stdout(text.rstrip("\n") + "\n")


def _write_stdout(text: str) -> None:
    """Write and flush ``text``; a reader that went away (``| head -1``) is not the command's failure."""
    try:
        sys.stdout.write(_printable(redact(text)))
        sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()


def _write_stderr(text: str) -> None:
    """Write ``text`` to stderr as the command may print it (:func:`redact`, :func:`_printable`)."""
    sys.stderr.write(_printable(redact(text)))


#: control characters a terminal acts on (escape sequences, carriage return, bell, C1 controls), but
#: not the line breaks and tabs of the command's own layout
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _printable(text: str) -> str:
    """``text`` with its control characters shown as ``\\uXXXX``: what the store holds (a cancel
    ``--reason``, a worker's error, a job ID typed by anyone) cannot drive the reader's terminal.
    The form is JSON's own escape, so a ``--json`` line stays valid JSON meaning the same."""
    return _CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _discard_stdout() -> None:
    """Send what is left for stdout to /dev/null: the reader closed the pipe, so the command ends
    with its own exit code and no ``BrokenPipeError`` when Python flushes stdout at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stream without a file descriptor (an embedding caller's)
        pass


def cmd_plan(args: argparse.Namespace) -> int:
    from airflow_deadline_batch.service.planning import analyze_input

    engine = args.engine or "echo"
    analysis = analyze_input(_plan_request(args, engine, default_output()))
    try:
        from airflow_deadline_batch.core.capacity import capacity
        from airflow_deadline_batch.core.feasibility import AdmissionPolicy

        report = analysis.report
        request = analysis.request
        room = capacity(
            analysis.work,
            request.pools,
            now=report.now,
            deadline=report.deadline,
            policy=AdmissionPolicy(max_invalid_fraction=request.max_invalid_fraction),
        )
        payload = {
            "tenant": analysis.request.tenant,
            "feasible": report.feasible,
            "verdict": report.verdict.value,
            "report": report.to_dict(),
            "lines": analysis.total_lines,
            "records": analysis.work.records,
            "invalid": analysis.work.invalid,
            "errors_by_code": dict(analysis.errors_by_code),
            "shards": len(analysis.cuts),
            "target_shard_s": round(analysis.target_shard_s, 3),
            "capacity": room.to_dict(),
        }
        by_code = ", ".join(f"{code} {n}" for code, n in sorted(analysis.errors_by_code.items()))
        text = report.summary() + (
            f"\ntenant: {analysis.request.tenant}"
            f"\nrecords: {analysis.work.records}, invalid lines: {analysis.work.invalid}"
            + (f" ({by_code})" if by_code else "")
            + f", shards: {len(analysis.cuts)}\n"
            + ("" if analysis.work.records or analysis.work.invalid else _EMPTY_INPUT)
            + "\n".join(room.lines())
        )
        _emit(args, payload, text)
        if report.feasible:
            return EXIT_OK
        # the verdict's own reason (the last one) says why and what to change; the report is on stdout
        why = report.reasons[-1] if report.reasons else report.verdict.value
        _write_stderr(f"deadline-batch: rejected ({report.verdict.value}): {why}\n")
        return EXIT_REJECTED
    finally:
        analysis.close()


#: what ``plan`` says of an input without a line to answer: its job would publish an empty manifest,
#: which is right for an empty night but is usually an upstream export that failed
_EMPTY_INPUT = (
    "note: the input holds no record (it is empty or blank lines only); its job would publish an"
    " empty manifest. If it should hold records, check what writes it.\n"
)


def cmd_run(args: argparse.Namespace) -> int:
    from airflow_deadline_batch.local.progress import ProgressDisplay
    from airflow_deadline_batch.local.runner import RunOptions, run_job
    from airflow_deadline_batch.service.planning import PlanResult
    from airflow_deadline_batch.worker.engines import check_engine

    ctx: _RunContext = args.run_context
    engine = args.engine or "transformers"
    store_url = args.store or default_store_url()
    output = args.output or default_output()
    if "://" not in output:
        output = str(Path(output).resolve())
    if args.workers < 1:
        raise ConfigurationError(f"--workers must be >= 1, got {args.workers}")
    if not 0 <= args.preempt_rate < math.inf:
        raise ConfigurationError("--preempt-rate must be finite and not negative")
    if not 0 <= args.preempt_notice <= MAX_SECONDS:
        # it is each worker's --grace, which a worker refuses past a day: every launch exited 1
        # ("worker exited 1 without saying why") after the job was recorded
        raise ConfigurationError(
            f"--preempt-notice must be a number of seconds >= 0 and <= {MAX_SECONDS:g}, "
            f"got {args.preempt_notice} (default 5)"
        )
    if not MIN_LEASE_TTL_S <= args.lease_ttl <= MAX_SECONDS:
        # a worker refuses a lease TTL of 0 before it claims: every launch would die unseen; one of
        # microseconds expires between its heartbeats, so every attempt lost its lease and was
        # relaunched until the deadline
        raise ConfigurationError(
            f"--lease-ttl must be a number of seconds >= {MIN_LEASE_TTL_S:g} and <= {MAX_SECONDS:g}, "
            f"got {args.lease_ttl} (default 30)"
        )
    request = _plan_request(args, engine, output)
    # admission (docs/design.md §8): configuration that cannot work is refused before a job exists
    check_engine(engine, args.model)
    _check_output(output, _source(args, "--output"))
    store = _open_run_store(store_url, _source(args, "--store"))
    ctx.store = store
    request = replace(request, idempotency_key=_resolve_key(args, request, store, ctx))
    log_path = Path(output) / "worker.log" if "://" not in output else None
    options = RunOptions(
        workers=args.workers,
        preempt_rate_per_worker_hour=args.preempt_rate,
        preempt_notice_s=args.preempt_notice,
        seed=args.seed,
        lease_ttl_s=args.lease_ttl,
        worker_log=str(log_path) if log_path else None,
        # the store's own URL is masked (user:***@host): workers get the real one by environment,
        # never in argv or logs (docs/design.md §8)
        worker_env={"ADB_STORE_URL": store_url},
    )
    with ProgressDisplay(enabled=sys.stderr.isatty()) as display:

        def planned(plan: PlanResult) -> None:
            ctx.job_id = plan.job_id
            display.planned(plan)

        summary = run_job(store, request, options, on_progress=display.update, on_plan=planned)
    data = summary.to_dict()
    # the exit code and deadline_met follow verification, not only the stored state: a published
    # job whose objects no longer verify (tampered, lost) is not a success (docs/design.md §8)
    verified = summary.manifest is not None and not summary.problems
    data["verified"] = verified
    data["deadline_met"] = summary.deadline_met and verified
    data["idempotency_key"] = ctx.idempotency_key
    text = (
        f"job {summary.job_id}: {summary.state}; manifest: {summary.manifest or 'not published'}\n"
        f"records: {summary.records}\nattempts: {summary.attempts}, preemptions: {summary.preemptions}, "
        f"deadline met: {data['deadline_met']}, elapsed: {summary.elapsed_s:.1f} s"
    )
    if summary.problems:
        text += "\n" + "\n".join(f"  - {p}" for p in summary.problems)
    if log_path:
        text += f"\nworker logs: {log_path}"
    if summary.state == "completed" and not verified:
        data["error"] = f"the published outputs fail verification: {summary.problems[0]}"
        _emit(args, data, text)
        _write_stderr(
            f"deadline-batch: job {summary.job_id} is published but {data['error']}; "
            f"see `deadline-batch verify {summary.job_id}`\n"
        )
        return EXIT_INCOMPLETE
    _emit(args, data, text)
    return EXIT_OK if summary.state == "completed" else EXIT_INCOMPLETE


#: a URL's ``user:password@``; a password holding an unescaped ``@`` (``user:p@ss@host``) is masked
#: to its last ``@`` before the host, which is where a URL parser that accepts it ends it too. The
#: user name may hold an ``@`` as well (``u@corp:pw@host``: SQLAlchemy reads the user ``u@corp``).
#: A password never spans another URL's ``://``: "sqlite://x.db): fix (postgresql://u:pw@h" is not one.
_PASSWORD = re.compile(r"(://[^:/\s]*:)((?:(?!://)[^@])*@(?:[^\s@/]*@)*)")


def mask_url(text: str) -> str:
    """``text`` with the password of any URL in it replaced by ``***``."""
    return _PASSWORD.sub(r"\1***@", text)


#: a password fragment this short is masked only where it ends a URL's user part (before an ``@``):
#: anywhere else it cannot be told from the words of the message it would garble
_SHORT_FRAGMENT = 4


def secret_fragments(url: str) -> frozenset[str]:
    """The texts of ``url``'s password that a driver's error may echo outside a URL.

    A password holding an unescaped ``@`` (``u:p@ss@host``) is split by URL parsers at its first
    ``@``: SQLAlchemy takes ``p`` as the password and ``ss@host`` as the host, which psycopg then
    prints ("failed to resolve host 'ss@host'"); so the password as given, its pieces between
    ``@``, each tail after an ``@``, their percent-decoded and JSON-escaped forms, and the password
    the parser split off are all secret.
    """
    import urllib.parse

    found: set[str] = set()
    for match in _PASSWORD.finditer(url):
        password = match.group(2).removesuffix("@")
        pieces = password.split("@")
        found.update((password, *pieces, *("@".join(pieces[i:]) for i in range(1, len(pieces)))))
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url).password if "://" in url else None
    except Exception:  # not a database URL: the pattern above found its password, if any
        parsed = None
    if parsed:
        found.add(str(parsed))
    found |= {urllib.parse.unquote(f) for f in found}
    found |= {orjson.dumps(f).decode()[1:-1] for f in found}
    return frozenset(f for f in found if f and f != "***")


#: the secret fragments of the URLs the running command was given (argv and environment)
_secrets: frozenset[str] = frozenset()


def redact(text: str) -> str:
    """``text`` as the command may print it: URLs' passwords masked (:func:`mask_url`), and every
    fragment of a password given to this command (:func:`secret_fragments`) replaced by ``***``,
    wherever a driver's or a parser's message put it."""
    text = mask_url(text)
    for fragment in sorted(_secrets, key=len, reverse=True):
        if len(fragment) >= _SHORT_FRAGMENT:
            text = text.replace(fragment, "***")
        else:
            text = re.sub(re.escape(fragment) + "(?=@)", "***", text)
    return text


def _collect_secrets(argv: Sequence[str]) -> frozenset[str]:
    """The secret fragments of every URL in ``argv`` and in the variables the command reads."""
    values = [*argv, *(os.environ.get(name, "") for name in (STORE_VARIABLE, OUTPUT_VARIABLE))]
    return frozenset().union(*(secret_fragments(v) for v in values if "://" in v))


def _check_output(output: str, source: str) -> None:
    """The output location exists or can be created, and takes writes: a probe written and deleted.

    ``source`` is where ``output`` came from (:func:`_source`), which the fix names.
    """
    from airflow_deadline_batch.storage import open_storage

    if "://" not in output and Path(output).exists() and not Path(output).is_dir():
        raise ConfigurationError(
            f"{source} {output} is an existing file: give a directory or s3://bucket/prefix"
        )
    probe = f"_adb-probe-{uuid.uuid4().hex}"
    try:
        storage = open_storage(output)
        storage.put_bytes(probe, b"")
        storage.delete(probe)
    except StorageError as exc:
        reason = exc.message.splitlines()[0] if exc.message else type(exc).__name__
        raise ConfigurationError(
            f"output {output} is not writable ({reason}): fix {source} (the directory or bucket "
            "must exist or be creatable, with write permission)"
        ) from None


def _open_run_store(url: str, source: str) -> ManifestStore:
    """The manifest store on ``url``, migrated: reachable with the credentials the workers get.

    ``source`` is where ``url`` came from (:func:`_source`), which the fix names.
    """
    path = _sqlite_file(url)
    if path is not None:
        if path.is_dir():
            raise ConfigurationError(
                f"store {url} is a directory: fix {source} to name a database file in it (.../store.db)"
            )
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot create the folder of store {url}: {exc.strerror}; fix {source}"
            ) from None
    store = _store_at(url, source)
    try:
        store.migrate()
    except Exception as exc:
        store.close()
        reason = redact(
            exc.message if isinstance(exc, DeadlineBatchError) else str(exc) or type(exc).__name__
        ).splitlines()[0]
        if redact(store.url) not in reason:
            reason = f"{store.url}: {reason}"
        raise ConfigurationError(
            f"cannot use the manifest store {reason}; fix {source} (host, port, user, password, database)"
        ) from None
    return store


def _store_at(url: str, source: str) -> ManifestStore:
    """A :class:`ManifestStore` on ``url``, not yet connected: a URL no parser takes is a usage error."""
    from airflow_deadline_batch.store import ManifestStore

    if _in_memory(url):
        # the store would end with this command, and a worker given the URL opens its own empty one:
        # ``run`` retried every try until the deadline, ``quota set`` reported a quota it then lost
        raise ConfigurationError(
            f"store {url} is in memory: it would end with this command and no worker could share it; "
            f"fix {source} to name a database file (sqlite:///path/store.db)"
        )
    try:
        return ManifestStore(url)
    except DeadlineBatchError:
        raise
    except Exception as exc:  # SQLAlchemy's URL parser raises ValueError, ArgumentError, ...
        raise ConfigurationError(
            f"store URL {redact(url)} is invalid ({redact(str(exc).splitlines()[0])}): fix {source} "
            "(sqlite:///path/store.db or postgresql+psycopg://user:password@host:port/db)"
        ) from None


def _sqlite_file(url: str) -> Path | None:
    """The database file an SQLite URL names, as SQLAlchemy reads it: without the URL's query
    (``sqlite:///s.db?timeout=5`` is the file ``s.db``); ``None`` for another URL or one in memory."""
    from sqlalchemy.engine import make_url

    if not url.startswith("sqlite:///") or _in_memory(url):
        return None
    try:
        return Path(make_url(url).database or "")
    except Exception:  # not a URL SQLAlchemy takes: ManifestStore says why
        return Path(url.removeprefix("sqlite:///"))


def _in_memory(url: str) -> bool:
    """``url`` names an SQLite database in memory (``sqlite://``, ``sqlite:///:memory:``, ``mode=memory``)."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:  # not a URL SQLAlchemy takes: ManifestStore says why
        return False
    if not parsed.drivername.startswith("sqlite") or parsed.host:  # sqlite://x.db: invalid, not memory
        return False
    return (parsed.database or "") in ("", ":memory:") or parsed.query.get("mode") == "memory"


def _open_store(args: argparse.Namespace) -> ManifestStore:
    """The store of existing jobs: a SQLite URL must name a database file that is there."""
    url = args.store or default_store_url()
    source = _source(args, "--store")
    path = _sqlite_file(url)
    if path is not None and not path.is_file():
        if source == STORE_VARIABLE:
            raise ConfigurationError(
                f"no manifest store at {url} ({STORE_VARIABLE}): set {STORE_VARIABLE}, or pass --store, "
                "with the URL the job was run with"
            )
        raise ConfigurationError(
            f"no manifest store at {url}: pass --store with the URL the job was run with"
        )
    store = _store_at(url, source)
    store.migrate()
    return store


def _name_sources(args: argparse.Namespace | None, message: str) -> str:
    """``message`` with the store's hints (``check the --store URL``, which the store layer words for
    the command line) naming ``ADB_STORE_URL`` when that variable, not the option, gave the URL."""
    if args is None or _source(args, "--store") != STORE_VARIABLE:
        return message
    return re.sub(r"(?:the )?--store URL", STORE_VARIABLE, message)


def cmd_status(args: argparse.Namespace) -> int:
    from airflow_deadline_batch.operators.placement import read_job_view

    store = _open_store(args)
    progress = store.progress(args.job_id)
    # predicted finish and slack from committed work only (docs/design.md §4.5 invariant 4), on the
    # rates measured so far: the job view every placement decision uses, so on-call sees the slack
    # the placement sees
    view = read_job_view(store, args.job_id, now=SystemClock().now())
    manifest = store.get_job(args.job_id).manifest_uri
    rates = view.rates()
    payload = {
        "job_id": view.job_id,
        "tenant": view.tenant,
        "state": view.state.value,
        "deadline": view.deadline.isoformat(),
        "manifest": manifest,
        "records": {
            "total": progress.total_records,
            "committed": progress.committed_records,
            "succeeded": progress.succeeded,
            "errored": progress.errored,
        },
        "shards": {
            "total": progress.shards_total,
            **{str(k): v for k, v in progress.shards_by_state.items()},
        },
        "attempts": progress.attempts,
        "preemptions": progress.preemptions,
        "remaining_work_s": round(view.remaining_work_s, 3),
        "work_scale": round(view.work_scale, 4),
        "rates": [r.to_dict() for r in rates],
        "predicted_finish": view.predicted_finish.isoformat(),
        "slack_s": round(view.slack_s, 3),
        "error": progress.error,
    }
    predicted, slack_s = view.predicted_finish, view.slack_s
    pct = 100.0 * progress.committed_records / progress.total_records if progress.total_records else 100.0
    rate_lines = "".join(
        f"  {r.pool} ({r.kind.value}): "
        + (
            f"{r.tokens_per_s:,.0f} tokens/s measured over {r.microbatches} microbatch(es) "
            f"(nominal {r.nominal_tokens_per_s:,.0f})"
            if r.microbatches
            else f"{r.nominal_tokens_per_s:,.0f} tokens/s nominal, not measured yet"
        )
        + "\n"
        for r in rates
    )
    text = (
        f"job {view.job_id}: {view.state.value}, deadline {view.deadline.isoformat()}\n"
        f"tenant: {view.tenant}\n"
        f"committed {progress.committed_records}/{progress.total_records} records ({pct:.1f}%): "
        f"succeeded {progress.succeeded}, errored {progress.errored}\n"
        f"shards: {payload['shards']}\nattempts: {progress.attempts}, preemptions: {progress.preemptions}\n"
        f"rates (work x{view.work_scale:.2f} of the planned estimate):\n{rate_lines}"
        + (
            f"finished {predicted.isoformat(timespec='seconds')}, "
            f"{format_duration(abs(slack_s))} {'before' if slack_s >= 0 else 'after'} the deadline\n"
            if view.finished
            else f"remaining work {format_duration(view.remaining_work_s)} GPU-time on {view.parallelism} "
            f"worker(s) plus a {format_duration(view.changeover_s)} changeover: predicted finish "
            f"{predicted.isoformat(timespec='seconds')}, slack {format_duration(slack_s, signed=True)}\n"
        )
        + (f"stopped because: {progress.error}\n" if progress.error else "")
        + f"manifest: {manifest or 'not published'}"
    )
    _emit(args, payload, text)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from airflow_deadline_batch.service.finalize import verify_job

    store = _open_store(args)
    job = store.get_job(args.job_id)
    report = verify_job(store, args.job_id)
    published = bool(job.manifest_uri)
    payload = {**report.to_dict(), "manifest": job.manifest_uri, "published": published}
    _emit(args, payload, report.summary() + f"\nmanifest: {job.manifest_uri or 'not published'}")
    return EXIT_OK if report.complete and published else EXIT_INCOMPLETE


def cmd_cancel(args: argparse.Namespace) -> int:
    """Stop leasing, fence running attempts, then publish the ``cancelled`` manifest.

    Cancelling moves every unfinished shard to a new epoch in the same transaction, so a running
    worker's next heartbeat or commit is refused and it stops; nothing it writes afterwards counts.
    The manifest then lists every committed outcome and ``cancelled`` for every other record (the
    runner or the sensor, if one is watching, publishes the same one: publication is conditional).
    """
    from airflow_deadline_batch.service.finalize import finalize_job

    ctx: _RunContext = args.run_context
    store = _open_store(args)
    try:
        job = store.cancel_job(args.job_id, reason=args.reason or _cancelled_by())
    except InvalidTransition:
        # it ended before (completed, partial, failed, rejected): nothing is left to stop, and exit 4
        # would say a job that published its full manifest did not
        ended = store.get_job(args.job_id)
        raise ConfigurationError(
            f"job {ended.job_id} already ended {ended.state.value} (manifest: "
            f"{ended.manifest_uri or 'none'}): there is nothing to cancel; see `deadline-batch status "
            f"{ended.job_id}`"
        ) from None
    ctx.cancelled = True
    stopped = f"job {job.job_id}: cancelled; running workers stop at their next heartbeat or commit"
    if args.no_publish:
        _emit(args, {"job_id": job.job_id, "state": job.state.value, "manifest": None}, stopped)
        return EXIT_OK
    result = finalize_job(store, job.job_id)
    outcomes = {str(k): int(v) for k, v in result.report.outcomes.items()}
    payload = {
        "job_id": job.job_id,
        "state": result.state.value,
        "manifest": result.manifest_uri,
        "outcomes": outcomes,
    }
    counts = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
    _emit(args, payload, f"{stopped}\nmanifest: {result.manifest_uri or 'not published'} ({counts})")
    return EXIT_OK if result.manifest_uri else EXIT_INCOMPLETE


def _cancelled_by() -> str:
    """The default reason of ``deadline-batch cancel``: who ran it, on which machine."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this UID (a container's arbitrary user)
        user = f"uid {os.getuid()}"
    return f"cancelled with deadline-batch cancel by {user} on {socket.gethostname()}"


def cmd_export(args: argparse.Namespace) -> int:
    from airflow_deadline_batch.service.export import export_job

    store = _open_store(args)
    if store.get_job(args.job_id).manifest_uri:  # else export_job refuses it, creating nothing
        # an output that cannot take writes is a usage error (exit 2), as for run; not a failed export
        _check_output(args.output, "--output")
    result = export_job(store, args.job_id, args.output, fmt=args.format)
    files = ", ".join(f"{f.name} {f.lines} lines" for f in result.files)
    _emit(args, result.to_dict(), f"job {result.job_id}: exported ({files}); manifest {result.manifest_uri}")
    return EXIT_OK


def _error_line(args: argparse.Namespace | None, ctx: _RunContext, error: str) -> None:
    """With ``--json``, the contract's last stdout line also on errors: the state and the error."""
    if args is None or not getattr(args, "json", False):
        return
    state = ctx.state()
    payload = {
        "job_id": ctx.job_id,
        "state": state or "error",
        "error": error,
        "resumable": state is not None and state not in _RESTART_STATES | {"completed"},
    }
    _write_stdout(orjson.dumps(payload).decode() + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    global _secrets
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    _secrets = _collect_secrets(raw)
    ctx = _RunContext()
    try:
        args = parser.parse_args(raw)
    except SystemExit as exc:
        if exc.code == EXIT_USAGE and "--json" in raw:
            _error_line(argparse.Namespace(json=True), ctx, _Parser.last_error or "usage error")
        raise
    args.run_context = ctx
    with _stop_on_signals():
        try:
            return _dispatch(args, parser)
        except Stopped as stop:
            return _stopped(args, ctx, stop.name, stop.exit_code)
        except KeyboardInterrupt:
            return _stopped(args, ctx, "SIGINT", 128 + signal.SIGINT)


def _stopped(args: argparse.Namespace, ctx: _RunContext, name: str, code: int) -> int:
    if args.command == "run":
        what = "workers stopped, leases released; " if ctx.job_id else ""
        _write_stderr(f"deadline-batch: stopped by {name}; {what}{ctx.resume_hint()}\n")
    else:
        _write_stderr(f"deadline-batch: {_command(args)} stopped by {name}; {_interrupted(args, ctx)}\n")
    _error_line(args, ctx, f"stopped by {name}")
    return code


def _command(args: argparse.Namespace) -> str:
    """The (sub)command ``args`` ran, as typed: ``status``, ``quota set``."""
    return " ".join(v for v in (args.command, getattr(args, "action", None)) if v)


#: the commands that only read: stopping one changes nothing
_READS = frozenset({"plan", "status", "verify", "usage", "capacity list", "quota list"})


def _interrupted(args: argparse.Namespace, ctx: _RunContext) -> str:
    """What a command other than ``run`` stopped by a signal has done, and whether rerunning it is safe."""
    command = _command(args)
    if command in _READS:
        return "it changes nothing; rerun it"
    if command == "simulate":
        plot = "; the --plot file may be incomplete" if args.plot else ""
        return f"it changes nothing{plot}; rerun it"
    if command == "cancel":
        # cancelling is one transaction and publishing is conditional: a rerun finishes either
        rerun = f"rerunning `deadline-batch cancel {args.job_id}` is safe and finishes it"
        if not ctx.cancelled:
            return f"job {args.job_id} may or may not be cancelled (never half); {rerun}"
        if args.no_publish:
            return f"job {args.job_id} is cancelled"
        return f"job {args.job_id} is cancelled but its manifest may not be published; {rerun}"
    if command == "export":
        return (
            f"{args.output} holds a whole export only if its export.json is there; rerunning the "
            "command is safe: it writes the files again"
        )
    # capacity/quota set and delete: one transaction each, and a repeat changes nothing more
    return "the change was made whole or not at all; rerunning the command is safe"


def _dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    ctx: _RunContext = args.run_context
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "run": cmd_run,
        "plan": cmd_plan,
        "status": cmd_status,
        "verify": cmd_verify,
        "cancel": cmd_cancel,
        "usage": cmd_usage,
        "capacity": cmd_capacity,
        "quota": cmd_quota,
        "export": cmd_export,
    }
    try:
        _check_values(parser, args)
        if args.command == "simulate":
            from airflow_deadline_batch.sim.cli import run_simulate

            try:
                return int(run_simulate(args))
            except BrokenPipeError:  # its lines go to a reader that stopped reading (`| head -1`)
                _discard_stdout()
                return EXIT_OK
        return handlers[args.command](args)
    except AdmissionRejected as exc:
        # the planner's report, or the recorded one (plain values) of an earlier rejected submission
        report: AdmissionReport | Mapping[str, Any] | None = exc.fields.get("report")
        if getattr(args, "json", False) and report is not None:
            data = report.to_dict() if isinstance(report, AdmissionReport) else dict(report)
            _write_stdout(
                orjson.dumps(
                    {"state": "rejected", "job_id": exc.fields.get("job_id"), "report": data}, default=str
                ).decode()
                + "\n"
            )
        elif isinstance(report, AdmissionReport):
            _write_stderr(report.summary().rstrip("\n") + "\n")
        _write_stderr(f"deadline-batch: rejected: {exc.message}\n")
        return EXIT_REJECTED
    except DeadlineBatchError as exc:
        # a URL in the cause (an input, output or store the user gave) never shows its password
        message = redact(_name_sources(args, exc.message.splitlines()[0] if exc.message else str(exc)))
        code = exc.exit_code if exc.exit_code in (EXIT_USAGE, EXIT_REJECTED) else EXIT_INCOMPLETE
        if code == EXIT_INCOMPLETE and ctx.job_id:
            message += f"; {ctx.resume_hint()}"
        _write_stderr(f"deadline-batch: error: {message}\n")
        _error_line(args, ctx, message)
        return code
    except Exception as exc:
        # never a traceback (docs/design.md §8): one line, and the job (if any) is resumable
        if os.environ.get("ADB_DEBUG"):
            raise
        message = redact(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": "))
        hint = f"; {ctx.resume_hint()}" if ctx.job_id else ""
        _write_stderr(f"deadline-batch: error: {message}{hint} (ADB_DEBUG=1 shows the traceback)\n")
        _error_line(args, ctx, message)
        return EXIT_INCOMPLETE


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
