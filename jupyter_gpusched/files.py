"""The files that hold scheduling state (the ledger, the simulated GPUs' state), opened safely.

Whoever can write the ledger can grant themselves GPUs, so these files are private to the Unix
user who schedules: created 0600, never reached through a symbolic link (a link planted at the
path, dangling or not, would make us create or extend a file elsewhere), and refused when another
user could read or write them, unless an admin shares them on purpose. SQLite's side files
(``-wal``, ``-shm``, ``-journal``) get the same checks, and may not be looser than the main file.

SQLite opens the file by name itself, so :func:`confirm_same` checks after the connection is
made that the path still names the file that was checked.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

__all__ = ["CheckedFile", "UnsafeFile", "SIDE_SUFFIXES", "check_private", "confirm_same", "prepare"]

#: The files SQLite keeps next to a database.
SIDE_SUFFIXES = ("-wal", "-shm", "-journal")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class UnsafeFile(Exception):
    """A state file we must not use.

    Attributes:
        problem: what is wrong, as the end of a sentence that starts with the path
            ("is a symbolic link to /x").
        advice: what to do about it.
    """

    def __init__(self, problem: str, advice: str = "") -> None:
        super().__init__(problem + (f". {advice}" if advice else ""))
        self.problem = problem
        self.advice = advice


@dataclass(frozen=True)
class CheckedFile:
    """A state file as it was found (or made): ``header`` is its first bytes."""

    path: str
    created: bool
    st: os.stat_result
    header: bytes


def _describe_link(path: str) -> str:
    try:
        target = os.readlink(path)
    except OSError:
        return "is a symbolic link"
    whole = os.path.join(os.path.dirname(path), target)
    if not os.path.exists(whole):
        return f"is a symbolic link to {target}, which does not exist"
    return f"is a symbolic link (to {target})"


def _link_advice(setting: str) -> str:
    return f"State files are never reached through a link: set {setting} to the real file's path"


def prepare(path: str, *, setting: str, header_size: int = 16) -> CheckedFile:
    """Create ``path`` (mode 0600, missing directories 0700), or look at the file already there.

    Nothing is written to an existing file. Call :func:`check_private` on the result before
    using it.

    Args:
        path: the file (absolute).
        setting: the configuration setting that names it, for the messages.
        header_size: how many leading bytes to read into :attr:`CheckedFile.header`.

    Raises:
        UnsafeFile: the path is a symbolic link, a directory or something else than a regular
            file, or cannot be read or created.
    """
    try:
        os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(path)
        try:
            os.makedirs(parent, mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW | _CLOEXEC, 0o600)
        except FileExistsError:
            pass  # another process (or a link) got there first: look at what is there now
        except OSError as exc:
            raise UnsafeFile(
                f"cannot be created ({exc.strerror})", f"set {setting} to a place this user can write"
            ) from None
        else:
            try:
                os.fchmod(fd, 0o600)  # whatever the umask
                st = os.fstat(fd)
            finally:
                os.close(fd)
            return CheckedFile(path, True, st, b"")
    return _existing(path, setting, header_size)


def _existing(path: str, setting: str, header_size: int) -> CheckedFile:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFile(_describe_link(path), _link_advice(setting))
    if stat.S_ISDIR(st.st_mode):
        raise UnsafeFile("is a directory, not a SQLite file", f"set {setting} to a file in it")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile("is not a regular file", f"set {setting} to a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(_describe_link(path), _link_advice(setting)) from None
        raise UnsafeFile(f"cannot be read ({exc.strerror})", "check its permissions") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile("is not a regular file", f"set {setting} to a regular file")
        header = os.read(fd, header_size) if header_size else b""
    except OSError as exc:
        raise UnsafeFile(f"cannot be read ({exc.strerror})", "check its permissions") from None
    finally:
        os.close(fd)
    if not os.access(path, os.R_OK | os.W_OK):
        raise UnsafeFile("cannot be written by this user", "check its permissions")
    return CheckedFile(path, False, st, header)


def _owner(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def _loose(mode: int) -> str:
    who = []
    if mode & 0o060:
        who.append("its group")
    if mode & 0o006:
        who.append("every user")
    what = "written" if mode & 0o022 else "read"
    return f"can be {what} by {' and '.join(who)} (permissions {stat.S_IMODE(mode):04o})"


def check_private(checked: CheckedFile, *, setting: str, allow_shared: bool, allow_setting: str) -> None:
    """Refuse a file (or side file) that another user owns or may read or write.

    Args:
        checked: from :func:`prepare`.
        setting: the setting that names the file.
        allow_shared: the admin shares the file on purpose: accept it as it is.
        allow_setting: the setting that would allow it, for the message.

    Raises:
        UnsafeFile: with what to do.
    """
    path, st = checked.path, checked.st
    if not allow_shared:
        allow = (
            f"If it is shared on purpose, set {allow_setting} = True (whoever can write it then "
            "takes part in the scheduling)"
        )
        if st.st_uid != os.geteuid():
            raise UnsafeFile(
                f"belongs to {_owner(st.st_uid)}, not to {_owner(os.geteuid())} who schedules with it "
                "(check its owner and permissions)",
                f"Set {setting} to a file of your own. {allow}",
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise UnsafeFile(
                _loose(st.st_mode),
                f"Make it private (chmod 600 {path}) or set {setting} to another file. {allow}",
            )
    _check_side_files(path, st, setting=setting, allow_shared=allow_shared, allow_setting=allow_setting)


def _check_side_files(path: str, main: os.stat_result, *, setting: str, allow_shared: bool, allow_setting: str) -> None:
    for suffix in SIDE_SUFFIXES:
        side = path + suffix
        try:
            st = os.lstat(side)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise UnsafeFile(f"has a side file {side} that cannot be checked ({exc.strerror})") from None
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeFile(
                f"has a side file {side} that is a symbolic link",
                f"Remove {side} (SQLite makes it again) or set {setting} to another file",
            )
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(
                f"has a side file {side} that is not a regular file", f"Remove it or set {setting} to another file"
            )
        if allow_shared:
            continue
        looser = stat.S_IMODE(st.st_mode) & ~stat.S_IMODE(main.st_mode) & 0o777
        if st.st_uid != main.st_uid or looser:
            raise UnsafeFile(
                f"has a side file {side} with another owner or looser permissions "
                f"({stat.S_IMODE(st.st_mode):04o}) than the file itself ({stat.S_IMODE(main.st_mode):04o})",
                f"Remove {side} while nothing uses the file, or set {allow_setting} = True if it is shared on purpose",
            )


def confirm_same(checked: CheckedFile) -> None:
    """After SQLite opened ``checked.path`` by name: it is still the file that was checked."""
    try:
        st = os.lstat(checked.path)
    except OSError as exc:
        raise UnsafeFile(f"disappeared while it was being opened ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode) or (st.st_dev, st.st_ino) != (checked.st.st_dev, checked.st.st_ino):
        raise UnsafeFile("was replaced while it was being opened", "check who else writes to its directory")
