"""The MPS daemons' pipe folder under a deep runtime directory: private, unpredictable, short.

Under a runtime directory too deep for Unix sockets the pipes go to a folder in the temp
directory. Its name used to be ``gpusched-mps-<uid>``: another user who made that folder first
(or a link by that name) denied this user MPS. Now nobody can name it in advance.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import tempfile

import pytest

from jupyter_gpusched.server import mps as mps_module
from jupyter_gpusched.server.mps import LONGEST_SOCKET, MAX_SOCKET_PATH, MPS

UUID = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
DEEP = "/tmp/" + "d" * 90 + "/runtime/gpusched-mps"


def _true(name: str) -> str:
    """A control program that starts nothing and says it did (the daemon is not what is tested)."""
    return shutil.which("true") or "/bin/true"


def _private(path: str) -> bool:
    info = os.lstat(path)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700


@pytest.fixture
def temp(monkeypatch):
    """A temp directory of the test's own, short enough for sockets (pytest's are too deep)."""
    base = tempfile.mkdtemp(prefix="gs-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", base)
    yield pathlib.Path(base)
    shutil.rmtree(base, ignore_errors=True)


def test_another_user_who_makes_the_old_folder_name_first_denies_nothing(temp):
    # What another user could make in advance: the old predictable name, open to all, and a link.
    squatted = temp / f"gpusched-mps-{os.getuid()}"
    squatted.mkdir(mode=0o777)
    os.chmod(squatted, 0o777)
    (temp / "elsewhere").mkdir()
    os.symlink(temp / "elsewhere", temp / f"gpusched-mps-{os.getuid() + 1}")
    mps = MPS("auto", DEEP, which=_true)
    mps.start([UUID])
    try:
        assert mps.state == "running", mps.reason
        daemon = mps.daemons[UUID]
        assert len(os.path.join(daemon.pipe_directory, LONGEST_SOCKET)) <= MAX_SOCKET_PATH
        root = mps.short_root
        assert root is not None and os.path.dirname(root) == str(temp)
        assert root != str(squatted) and daemon.pipe_directory.startswith(root + os.sep)
        assert _private(root) and os.path.isdir(daemon.pipe_directory) and os.path.isdir(daemon.log_directory)
        assert os.listdir(squatted) == [] and os.listdir(temp / "elsewhere") == []
        assert mps.daemon_for(UUID) == daemon, "one folder for the server's whole life"
    finally:
        mps.stop()
    assert not os.path.exists(root), "the folder goes when its daemons have quit"


def test_each_server_gets_a_folder_nobody_could_name_in_advance(temp):
    first, second = MPS("auto", DEEP, which=_true), MPS("auto", DEEP, which=_true)
    a, b = first.daemon_for(UUID).pipe_directory, second.daemon_for(UUID).pipe_directory
    assert a != b
    for root in (first.short_root, second.short_root):
        name = os.path.basename(root)
        assert name.startswith("gpusched-mps-") and name != f"gpusched-mps-{os.getuid()}"
        assert len(name) >= len("gpusched-mps-") + 8 and _private(root)
        shutil.rmtree(root)


def test_a_temp_directory_too_deep_for_sockets_gives_way_to_tmp(tmp_path, monkeypatch):
    deep_temp = tmp_path / ("t" * 80)
    deep_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep_temp))
    mps = MPS("auto", DEEP, which=_true)
    pipes = mps.daemon_for(UUID).pipe_directory
    try:
        assert os.path.dirname(mps.short_root) == "/tmp" and _private(mps.short_root)
        assert len(os.path.join(pipes, LONGEST_SOCKET)) <= MAX_SOCKET_PATH
    finally:
        shutil.rmtree(mps.short_root)


def test_a_folder_that_is_not_private_after_all_is_refused(temp, monkeypatch, caplog):
    def open_to_all(prefix, dir):
        path = os.path.join(dir, prefix + "abcdefgh")
        os.mkdir(path)
        os.chmod(path, 0o777)
        return path

    monkeypatch.setattr(mps_module.tempfile, "mkdtemp", open_to_all)
    mps = MPS("auto", DEEP, which=_true)
    with caplog.at_level("WARNING", "jupyter_gpusched.mps"):
        mps.daemon_for(UUID)
    assert "is not a private folder of this user's" in caplog.text and mps.short_root is None
