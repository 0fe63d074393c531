"""Process identity and liveness: a zombie is gone, a reused pid is another process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import replace

import psutil
import pytest

from jupyter_gpusched import ledger, procs
from jupyter_gpusched.procs import OwnerId, alive, is_alive, same_process, started

HOST = socket.gethostname()


@pytest.fixture
def zombie():
    """A child that exited and was not reaped yet: its pid stays in the process table."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        proc = psutil.Process(child.pid)
        deadline = time.monotonic() + 30
        while proc.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.02)
        yield child.pid, proc.create_time()
    finally:
        child.wait(timeout=30)


def test_the_current_process_is_alive_and_itself():
    me, since = os.getpid(), started(os.getpid())
    assert since is not None
    assert alive(me)
    assert alive(me, since)
    assert same_process(me, since)
    assert is_alive(OwnerId.current())
    assert OwnerId.current() == OwnerId(me, since, HOST)


def test_a_zombie_is_not_alive(zombie):
    pid, since = zombie
    assert started(pid) == since, "a zombie is still in the process table"
    assert not alive(pid)
    assert not alive(pid, since)
    assert not is_alive(OwnerId(pid, since, HOST))


def test_a_reused_pid_with_another_start_time_is_not_the_same_process():
    me = OwnerId.current()
    earlier = me.create_time - 3600
    assert not same_process(me.pid, earlier)
    assert not alive(me.pid, earlier)
    assert not is_alive(replace(me, create_time=earlier))
    # Within the tolerance it is the same process: /proc's boot time can move by a second.
    assert alive(me.pid, me.create_time + procs.START_TIME_TOLERANCE / 2)


def test_a_process_that_is_gone_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    since = psutil.Process(child.pid).create_time()
    child.wait(timeout=30)
    assert started(child.pid) is None or started(child.pid) != since
    assert not same_process(child.pid, since)
    assert not alive(child.pid, since)
    assert not is_alive(OwnerId(child.pid, since, HOST))
    assert not alive(-1), "no process has a negative pid"


def test_a_process_on_another_host_cannot_be_judged_and_counts_as_alive():
    assert is_alive(OwnerId(os.getpid(), 0.0, HOST + "-elsewhere"))


def test_a_lease_owner_is_judged_by_its_process(zombie):
    pid, since = zombie
    owner = ledger.Owner("lease-1", "kernel-1", "server-1", OwnerId(pid, since, HOST), since=time.time())
    assert not is_alive(owner)
    assert is_alive(replace(owner, process=OwnerId.current()))


def test_the_ledger_exports_the_same_identity_and_liveness():
    assert ledger.OwnerId is OwnerId
    assert ledger.is_alive is is_alive


def test_a_process_of_the_hosts_own_namespaces_has_no_pod_and_no_namespace_above_it():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert procs.pod_name(child.pid) is None, "it shares this process's host name: no pod of its own"
        assert procs.pid_namespace_chain(child.pid) == []
    finally:
        child.kill()
        child.wait(10)
    assert procs.pod_name(child.pid) is None, "a process that is gone is in no pod"
    with pytest.raises(ProcessLookupError):
        procs.pid_namespace_chain(child.pid)
