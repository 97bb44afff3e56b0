"""The admission workers' fair share: one tenant's flood of large bodies waits, and is refused, by itself."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.fair_share import FairShare
from gateway.errors import GatewayError


class Jobs:
    """Jobs that hold their slot until released, recording the order they got one."""

    def __init__(self, share: FairShare) -> None:
        self.share = share
        self.started: list[str] = []
        self.release: dict[str, asyncio.Event] = {}

    def submit(self, tenant: str, name: str, home: int = 0) -> asyncio.Task[int]:
        self.release[name] = asyncio.Event()

        async def job() -> int:
            async with self.share.slot(tenant, home) as slot:
                self.started.append(name)
                await self.release[name].wait()
                return slot

        return asyncio.get_running_loop().create_task(job())


def test_a_flooding_tenant_runs_within_its_share_and_its_surplus_is_refused_while_another_is_served() -> None:
    async def scenario() -> None:
        jobs = Jobs(FairShare(2, tenant_waiting=4))
        flood = [jobs.submit("b", f"b{i}") for i in range(5)]
        await asyncio.sleep(0)
        assert jobs.started == ["b0"]  # half the slots at most: the other stays for someone else
        with pytest.raises(GatewayError) as refused:
            async with jobs.share.slot("b", 0):
                pass
        assert refused.value.status == 429 and refused.value.code == "admission_busy"
        assert refused.value.retry_after_s == 1
        other = jobs.submit("a", "a0")
        await asyncio.sleep(0)
        assert jobs.started == ["b0", "a0"]  # at once, on the free slot (its home was taken)
        jobs.release["a0"].set()
        assert await other == 1
        for name in jobs.release:
            jobs.release[name].set()
        await asyncio.gather(*flood)
        assert jobs.started == ["b0", "a0", "b1", "b2", "b3", "b4"]

    asyncio.run(scenario())


def test_waiting_tenants_take_turns_and_a_cancelled_job_leaves_its_line() -> None:
    async def scenario() -> None:
        jobs = Jobs(FairShare(1, tenant_waiting=4))
        first = jobs.submit("b", "b0")
        rest = [jobs.submit("b", f"b{i}") for i in (1, 2)]
        await asyncio.sleep(0)
        late = jobs.submit("a", "a0")
        gone = jobs.submit("c", "c0")
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        jobs.release["b0"].set()
        await first
        await asyncio.sleep(0)
        assert jobs.started == ["b0", "b1"]  # b was first in line for the freed slot ...
        jobs.release["b1"].set()
        await asyncio.sleep(0.01)
        assert jobs.started == ["b0", "b1", "a0"]  # ... then a's turn comes before b's next, and c left
        for name in jobs.release:
            jobs.release[name].set()
        await asyncio.gather(late, *rest)
        assert jobs.started == ["b0", "b1", "a0", "b2"]

    asyncio.run(scenario())
