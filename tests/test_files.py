"""The ledger and the simulated GPU state file: private, never through a link, never another app's."""

from __future__ import annotations

import os
import sqlite3
import stat

import pytest

from jupyter_gpusched.devices import InventoryUnavailable
from jupyter_gpusched.devices.simulated import SimulatedBackend
from jupyter_gpusched.ledger import SCHEMA_VERSION, Ledger, LedgerError


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def open_ledger(path, **kw):
    Ledger(path, **kw).close()


def open_sim(path, **kw):
    SimulatedBackend(2, state_path=str(path), **kw)


OPENERS = {"ledger": (open_ledger, LedgerError), "simulated": (open_sim, InventoryUnavailable)}


@pytest.fixture(params=sorted(OPENERS))
def opener(request):
    return OPENERS[request.param]


def refused(opener, path, match, **kw) -> str:
    open_fn, error = opener
    with pytest.raises(error, match=match) as info:
        open_fn(path, **kw)
    message = str(info.value)
    assert str(path) in message and "left untouched" in message
    return message


def test_new_files_are_private_whatever_the_umask(opener, tmp_path):
    path = tmp_path / "new" / "state.sqlite"
    old = os.umask(0)
    try:
        opener[0](path)
    finally:
        os.umask(old)
    assert mode(path) == 0o600
    for side in ("-wal", "-shm"):
        if os.path.exists(str(path) + side):
            assert mode(str(path) + side) & ~0o600 == 0
    assert mode(path.parent) == 0o700
    opener[0](path)  # and they open again


def test_a_dangling_link_is_refused_and_its_target_never_created(opener, tmp_path):
    target = tmp_path / "elsewhere" / "victim.sqlite"
    target.parent.mkdir()
    path = tmp_path / "state.sqlite"
    path.symlink_to(target)
    message = refused(opener, path, "symbolic link")
    assert "does not exist" in message
    assert not target.exists()
    assert not list(target.parent.iterdir())


def test_a_link_to_a_good_file_is_refused_too(opener, tmp_path):
    real = tmp_path / "real.sqlite"
    opener[0](real)
    before = real.read_bytes()
    path = tmp_path / "link.sqlite"
    path.symlink_to(real)
    refused(opener, path, "symbolic link")
    assert real.read_bytes() == before


def test_a_shared_file_is_refused_unless_the_admin_allows_it(opener, tmp_path):
    path = tmp_path / "state.sqlite"
    path.touch()
    path.chmod(0o666)
    message = refused(opener, path, "every user")
    assert "0666" in message and "chmod 600" in message and "allow_shared_state_files" in message
    assert path.read_bytes() == b""
    path.chmod(0o640)
    assert "its group" in refused(opener, path, "permissions 0640")

    opener[0](path, allow_shared=True)  # shared on purpose: used as it is
    assert mode(path) == 0o640


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_another_users_file_is_refused(opener, tmp_path):
    path = tmp_path / "state.sqlite"
    opener[0](path)
    os.chown(path, 65534, 65534)
    refused(opener, path, "belongs to")


def test_a_looser_or_linked_side_file_is_refused(opener, tmp_path):
    path = tmp_path / "state.sqlite"
    opener[0](path)
    wal = tmp_path / "state.sqlite-wal"
    wal.unlink(missing_ok=True)
    wal.touch()
    wal.chmod(0o666)
    refused(opener, path, "side file .*looser")
    wal.unlink()
    wal.symlink_to(tmp_path / "planted")
    refused(opener, path, "side file .*symbolic link")
    assert not (tmp_path / "planted").exists()


def foreign_sqlite(path, version=0, tables=("recipes",)):
    raw = sqlite3.connect(path)
    for table in tables:
        raw.execute(f"CREATE TABLE {table} (name TEXT)")
    raw.execute(f"PRAGMA user_version = {version}")
    raw.commit()
    raw.close()
    os.chmod(path, 0o600)


def test_another_applications_sqlite_file_is_never_extended(opener, tmp_path):
    path = tmp_path / "app.sqlite"
    foreign_sqlite(path)
    before = path.read_bytes()
    refused(opener, path, "recipes")
    assert path.read_bytes() == before


@pytest.mark.parametrize("version", range(1, SCHEMA_VERSION + 1))
def test_a_ledger_with_tables_that_are_not_the_ledgers_is_refused_untouched(tmp_path, version):
    path = tmp_path / "ledger.sqlite"
    foreign_sqlite(path, version=version, tables=("leases", "events", "recipes"))
    before = path.read_bytes()
    refused(OPENERS["ledger"], path, "not a GPU ledger.*recipes")
    assert path.read_bytes() == before
    with sqlite3.connect(path) as raw:
        tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables == {"leases", "events", "recipes"}


def test_a_simulated_state_file_of_another_version_is_refused(tmp_path):
    path = tmp_path / "sim.sqlite"
    foreign_sqlite(path, version=7, tables=("devices",))
    refused(OPENERS["simulated"], path, "something else")


def test_several_processes_of_one_user_still_share_the_files(tmp_path):
    ledger_path, sim_path = tmp_path / "ledger.sqlite", tmp_path / "sim.sqlite"
    with Ledger(ledger_path) as first, Ledger(ledger_path) as second:
        with first.transaction() as tx:
            tx.set_drained("GPU-0", True, "maintenance")
        assert second.drained() == {"GPU-0": "maintenance"}
    a = SimulatedBackend(2, state_path=str(sim_path))
    b = SimulatedBackend(2, state_path=str(sim_path))
    a.add_process(a.devices[0].uuid, os.getpid(), "1GiB")
    assert b.snapshot()[0].memory_used == 1024**3
    a.remove_process(os.getpid())
