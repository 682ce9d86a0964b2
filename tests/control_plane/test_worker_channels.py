"""Channels to workers that left every route are closed, but only after the grace period."""

from __future__ import annotations

from inferplane.control_plane.routing.worker_channels import WorkerChannels


async def test_a_departed_worker_keeps_its_channel_for_the_grace_period_then_loses_it():
    channels = WorkerChannels()
    stay, leave = channels.stub("127.0.0.1:1"), channels.stub("127.0.0.1:2")
    assert channels.stub("127.0.0.1:1") is stay  # one channel per address, reused
    assert await channels.prune({"127.0.0.1:1"}, grace=60, now=1000) == []  # just left: may still stream
    assert await channels.prune({"127.0.0.1:1"}, grace=60, now=1059) == []
    assert await channels.prune({"127.0.0.1:1"}, grace=60, now=1060) == ["127.0.0.1:2"]
    assert channels.addresses == {"127.0.0.1:1"}
    assert channels.stub("127.0.0.1:2") is not leave  # coming back gets a fresh channel
    await channels.close()
    assert channels.addresses == set()


async def test_a_worker_that_returns_within_the_grace_period_keeps_its_channel():
    channels = WorkerChannels()
    stub = channels.stub("127.0.0.1:3")
    assert await channels.prune(set(), grace=60, now=0) == []
    assert await channels.prune({"127.0.0.1:3"}, grace=60, now=30) == []  # back: the clock restarts
    assert await channels.prune(set(), grace=60, now=80) == []
    assert channels.stub("127.0.0.1:3") is stub
    await channels.close()
