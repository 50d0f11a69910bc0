"""``ShardPodTrigger``: KubernetesPodOperator's own trigger, holding its event until the task may resume,
and handing a racing try back to its task while the pod runs.

A deferred shard try hands its worker slot back when it defers. Airflow 3.3's scheduler fails a task
that starts again (same try number) before it has processed the executor's report of that exit
(docs/airflow.md, *Resuming tasks*), and the provider's ``KubernetesPodTrigger`` yields as soon as
its first read sees the pod finished: a Spot pod reclaimed within a scheduler loop of its deferral
came back as a failed try, spending a retry, and the next try reattached to the dead pod
(docs/kubernetes.md, *Deferrable shard pods*). This subclass watches the pod exactly as the
provider's does and holds the event until ``resume_after`` (the deferral plus the resume delay,
:func:`min_resume_delay_s`: ``[deadline_batch] min_resume_delay_s``, default
``core.failures.MIN_RESUME_DELAY_S``). Every event carries the time it fired (``FIRED_AT_KEY``), from
which the resumed task learns how late Airflow resumed it.

The tail race in deferrable mode (docs/kubernetes.md, *The tail race*): with
``race_check_interval_s`` the trigger also yields a ``running`` event once the pod has run that
long, so that the task looks at the job's tail (the triggerer has no store access and no rule of
its own) and defers again; on a kill it deletes the try's racer pod with its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger
from airflow.triggers.base import TriggerEvent

from airflow_deadline_batch.core.failures import (
    MIN_RESUME_DELAY_S,
    parse_resume_delay,
    parse_scheduler_latency,
)

#: key of the tail race's state in the trigger's ``trigger_kwargs`` (echoed in every event):
#: ``{"pool": <the Spot pool>, "racer": <racer pod name or None>, "promoted": <watching the racer>}``
RACE_KEY = "deadline_batch_race"
#: status of the event a racing try's trigger yields while its pod still runs
RUNNING = "running"
#: key of the time (epoch seconds, the triggerer's clock) the trigger yielded its event, in every
#: event: the resumed task learns from it how late Airflow resumed it (``core.failures.TryLedger``)
FIRED_AT_KEY = "deadline_batch_fired_at"


def min_resume_delay_s() -> float:
    """The resume delay where this runs: ``[deadline_batch] min_resume_delay_s`` from Airflow's
    configuration (env ``AIRFLOW__DEADLINE_BATCH__MIN_RESUME_DELAY_S``), default
    :data:`~core.failures.MIN_RESUME_DELAY_S`. A bad value raises ``ConfigurationError`` naming it."""
    from airflow.sdk.configuration import conf

    return parse_resume_delay(conf.get("deadline_batch", "min_resume_delay_s", fallback=None))


def scheduler_latency_s() -> float:
    """Airflow's latency to start a task that is due, as the placement assumes it at least:
    ``[deadline_batch] scheduler_latency_s`` (env ``AIRFLOW__DEADLINE_BATCH__SCHEDULER_LATENCY_S``),
    default :data:`~core.failures.SCHEDULER_LATENCY_S`. A bad value raises ``ConfigurationError``."""
    from airflow.sdk.configuration import conf

    return parse_scheduler_latency(conf.get("deadline_batch", "scheduler_latency_s", fallback=None))


def resume_hold_s(resume_after: float, now: float, cap_s: float = MIN_RESUME_DELAY_S) -> float:
    """Seconds to hold the event at the triggerer's ``now``: what is left to ``resume_after`` (the
    deferring worker's clock), never more than ``cap_s`` (the resume delay the worker deferred
    with) — a worker whose clock runs a day ahead of the triggerer's must not hold its pod's end
    for a day."""
    return min(max(resume_after - now, 0.0), cap_s)


class ShardPodTrigger(KubernetesPodTrigger):
    """The provider's pod trigger whose event comes no sooner than ``resume_after``.

    :param resume_after: Unix time before which the event is held (the pod is still polled).
    :param resume_delay_s: the resume delay the task deferred with: the most the event is held
        (default: :func:`min_resume_delay_s` in the triggerer).
    :param race_check_interval_s: when set, a ``running`` event once the pod has been running for
        this long (a pod still ``Pending`` keeps its startup timeout: no event).
    Every other argument is :class:`KubernetesPodTrigger`'s.
    """

    def __init__(
        self,
        *,
        resume_after: float = 0.0,
        resume_delay_s: float | None = None,
        race_check_interval_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.resume_after = float(resume_after)
        self.resume_delay_s = None if resume_delay_s is None else float(resume_delay_s)
        self.race_check_interval_s = None if race_check_interval_s is None else float(race_check_interval_s)

    @classmethod
    def adopt(
        cls,
        trigger: KubernetesPodTrigger,
        *,
        resume_after: float,
        resume_delay_s: float | None = None,
        race_check_interval_s: float | None = None,
    ) -> ShardPodTrigger:
        """This trigger with the arguments the provider's operator built ``trigger`` with."""
        _, kwargs = trigger.serialize()
        return cls(
            **kwargs,
            resume_after=resume_after,
            resume_delay_s=resume_delay_s,
            race_check_interval_s=race_check_interval_s,
        )

    def serialize(self) -> tuple[str, dict[str, Any]]:
        _, kwargs = super().serialize()
        return f"{type(self).__module__}.{type(self).__qualname__}", {
            **kwargs,
            "resume_after": self.resume_after,
            "resume_delay_s": self.resume_delay_s,
            "race_check_interval_s": self.race_check_interval_s,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        watch = super().run()
        ended = asyncio.ensure_future(anext(watch))
        try:
            event = await self._pod_end_or_running(ended)
        finally:
            if not ended.done():
                ended.cancel()
            with contextlib.suppress(BaseException):  # the watch was cancelled: nothing to report
                await ended
            if isinstance(watch, AsyncGenerator):
                with contextlib.suppress(Exception):
                    await watch.aclose()
        # the task's resume waits until the scheduler has seen the deferral's exit, or it fails
        # the resumed try (the Airflow 3.3 resume race)
        if (hold := resume_hold_s(self.resume_after, time.time(), self.hold_cap_s())) > 0:
            self.log.info("resuming the task in %.1f s", hold)
            await asyncio.sleep(hold)
        if isinstance(event.payload, dict):  # stamped as it fires: the resume is due from now on
            event = TriggerEvent({**event.payload, FIRED_AT_KEY: time.time()})
        yield event

    def hold_cap_s(self) -> float:
        """The most the event is held: the task's resume delay, else the triggerer's (never raises:
        a bad option here is logged, and the default holds; the task's own read names it)."""
        if self.resume_delay_s is not None:
            return self.resume_delay_s
        try:
            return min_resume_delay_s()
        except Exception:
            self.log.warning("using the default resume delay", exc_info=True)
            return MIN_RESUME_DELAY_S

    async def _pod_end_or_running(self, ended: asyncio.Future[TriggerEvent]) -> TriggerEvent:
        """The provider's event, or a ``running`` one once the pod has run ``race_check_interval_s``."""
        interval = self.race_check_interval_s
        while True:
            done, _ = await asyncio.wait({ended}, timeout=interval)
            if done:
                return ended.result()
            try:  # bounded: a read that hangs must not stop the looks (the watch goes on regardless)
                phase = (
                    await asyncio.wait_for(self._get_pod(), timeout=max(interval or 0.0, 30.0))
                ).status.phase
            except Exception:  # a failed read is the provider's watch's to report
                self.log.warning("could not read pod %s; looking again", self.pod_name, exc_info=True)
                continue
            if phase == "Running":
                self._fired_event = True  # the task takes it from here (a kill then is the task's)
                return TriggerEvent(
                    {
                        "status": RUNNING,
                        "namespace": self.pod_namespace,
                        "name": self.pod_name,
                        "message": f"pod running for {interval:.0f} s or more: the task looks at the race",
                        "last_log_time": self.last_log_time,
                        **self.trigger_kwargs,
                    }
                )

    async def on_kill(self) -> None:
        """Delete the pod (the provider's), and this try's racer pod if it has one.

        Both deletions are asked at once and shielded: Airflow 3.3's triggerer cancels a cancelled
        trigger again at each of its loops until it has ended, and that second cancel, arriving while
        ``on_kill`` waited on the first deletion, left the racer pod running (holding its GPU).
        """
        race = self.trigger_kwargs.get(RACE_KEY)
        racer = race.get("racer") if isinstance(race, dict) and not race.get("promoted") else None
        deletions = [super().on_kill()]
        if racer and not self._fired_event:
            deletions.append(self._delete_racer(racer))
        await asyncio.shield(asyncio.gather(*deletions))

    async def _delete_racer(self, racer: str) -> None:
        self.log.info("Deleting racer pod %s in namespace %s.", racer, self.pod_namespace)
        try:
            await self.hook.delete_pod(
                name=racer, namespace=self.pod_namespace, grace_period_seconds=self.termination_grace_period
            )
        except Exception:
            self.log.exception("Unexpected error while deleting racer pod %s", racer)
