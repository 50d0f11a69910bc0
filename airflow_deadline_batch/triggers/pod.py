"""``ShardPodTrigger``: KubernetesPodOperator's own trigger, holding its event until the task may resume.

A deferred shard try hands its worker slot back when it defers. Airflow 3.3's scheduler fails a task
that starts again (same try number) before it has processed the executor's report of that exit
(docs/airflow.md, *Resuming tasks*), and the provider's ``KubernetesPodTrigger`` yields as soon as
its first read sees the pod finished: a Spot pod reclaimed within a scheduler loop of its deferral
came back as a failed try, spending a retry, and the next try reattached to the dead pod
(docs/kubernetes.md, *Deferrable shard pods*). This subclass watches the pod exactly as the
provider's does and holds the event until ``resume_after`` (the deferral plus
``core.failures.MIN_RESUME_DELAY_S``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger
from airflow.triggers.base import TriggerEvent


class ShardPodTrigger(KubernetesPodTrigger):
    """The provider's pod trigger whose one event comes no sooner than ``resume_after``.

    :param resume_after: Unix time before which the event is held (the pod is still polled).
    Every other argument is :class:`KubernetesPodTrigger`'s.
    """

    def __init__(self, *, resume_after: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.resume_after = float(resume_after)

    @classmethod
    def adopt(cls, trigger: KubernetesPodTrigger, *, resume_after: float) -> ShardPodTrigger:
        """This trigger with the arguments the provider's operator built ``trigger`` with."""
        _, kwargs = trigger.serialize()
        return cls(**kwargs, resume_after=resume_after)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        _, kwargs = super().serialize()
        return f"{type(self).__module__}.{type(self).__qualname__}", {
            **kwargs,
            "resume_after": self.resume_after,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async for event in super().run():
            # the pod's end is known; the task's resume waits until the scheduler has seen the
            # deferral's exit, or it fails the resumed try (the Airflow 3.3 resume race)
            if (hold := self.resume_after - time.time()) > 0:
                self.log.info("pod %s ended; resuming the task in %.1f s", self.pod_name, hold)
                await asyncio.sleep(hold)
            yield event
