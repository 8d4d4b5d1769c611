"""The engine's worker processes (``execution.processes``): forked by one server per driver,
each in the driver's environment as it is when the worker starts."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

import pytest

from slora_batch.engine.execution.processes import call_in_environment, worker_args, worker_context


def report(name: str, out) -> None:
    """In the worker: its view of ``name``, its parent and whether torch came imported."""
    out.send((os.environ.get(name), os.getppid(), "torch" in sys.modules))


def start(context, name: str):
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=call_in_environment, args=worker_args(report, name, writer))
    process.start()
    writer.close()
    answer = reader.recv()
    process.join(60)
    assert process.exitcode == 0
    return answer


@pytest.mark.skipif("forkserver" not in mp.get_all_start_methods(), reason="no fork server")
def test_workers_share_one_server_and_see_the_environment_of_the_moment(monkeypatch):
    context = worker_context()
    monkeypatch.setenv("SLORA_BATCH_TEST_VALUE", "first")
    first = start(context, "SLORA_BATCH_TEST_VALUE")
    monkeypatch.setenv("SLORA_BATCH_TEST_VALUE", "second")  # after the server started
    second = start(context, "SLORA_BATCH_TEST_VALUE")
    monkeypatch.delenv("SLORA_BATCH_TEST_VALUE")
    third = start(context, "SLORA_BATCH_TEST_VALUE")
    assert [first[0], second[0], third[0]] == ["first", "second", None]
    assert first[1] == second[1] == third[1] != os.getpid()  # the server, not this process
    assert first[2]  # torch came with the fork: imported once, by the server
