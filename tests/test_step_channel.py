"""The direct step channel (kvray.cluster.step_channel) between a scheduler and its worker
actors, in one process: answers in order, a failed step reported as such, a closed end
seen at once, and a socket nobody else can reach once its scheduler is connected."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from kvray.cluster.step_channel import ChannelClosed, StepClient, StepFailed, StepServer
from kvray.workers import cpu_bind


def _double(plan: np.ndarray) -> np.ndarray:
    if plan.size == 0:
        raise ValueError("an empty plan")
    return plan * 2


def test_answers_come_in_order_from_every_rank() -> None:
    servers = [StepServer(_double) for _ in range(2)]
    paths = [s.path for s in servers]
    client = StepClient(paths)
    try:
        # Two plans in flight (overlap scheduling), answered in order; rank 0's answer.
        client.send(np.arange(3))
        client.send(np.arange(4))
        assert client.recv(5.0).tolist() == [0, 2, 4]
        # The path is gone once its scheduler is in: nobody else connects.
        for path in paths:
            assert not os.path.exists(path)
        assert client.recv(5.0).tolist() == [0, 2, 4, 6]
        # A step that raised is reported, and the channel serves on.
        client.send(np.arange(0))
        with pytest.raises(StepFailed, match="rank 0's step failed: ValueError: an empty plan"):
            client.recv(5.0)
        client.send(np.arange(2))
        assert client.recv(5.0).tolist() == [0, 2]
    finally:
        client.close()


def test_a_rank_that_goes_away_is_seen_at_once() -> None:
    block = threading.Event()

    def stuck(plan: np.ndarray) -> np.ndarray:  # a rank waiting on its dead peer
        block.wait(30)
        return plan

    # Neither rank answers: a rank 1 that answered before its end closed would leave
    # recv waiting on rank 0 alone (rightly: rank 0 then finishes the step too).
    alive, dying = StepServer(stuck), StepServer(stuck)
    client = StepClient([alive.path, dying.path])
    try:
        client.send(np.arange(2))
        client.socks[1].shutdown(2)  # rank 1's end closes (its process died)
        with pytest.raises(ChannelClosed):  # not waiting for rank 0, stuck in a collective
            client.recv(10.0)
        with pytest.raises(OSError):  # the executor's WorkerFailure
            client.send(np.arange(2))
        # Nothing answered in time: a timeout, not a hang.
        solo = StepServer(stuck)
        late = StepClient([solo.path])
        late.send(np.arange(1))
        with pytest.raises(TimeoutError):
            late.recv(0.2)
        late.close()
    finally:
        block.set()
        client.close()


def test_release_omp_team_leaves_torch_working() -> None:
    a = torch.randn(1 << 16)
    before = (a + 1).sum()
    released = cpu_bind.release_omp_team()
    assert released == (cpu_bind._EXTENSION.load() is not None)
    assert torch.equal((a + 1).sum(), before)  # a new team computes the same
