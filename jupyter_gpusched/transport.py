"""How a single-user server reaches the hub's GPU broker without giving its token to an impostor.

A server sends its hub token with every call to the broker. On a shared host any local user can
listen on a TCP port of 127.0.0.1 that happens to be free (while the broker restarts, say), and
would collect the tokens of every server that reconnects. So a server reaches the broker in one
of two ways that another user cannot take over:

- ``http+unix://%2Frun%2Fjupyterhub-gpusched%2Fbroker.sock/services/gpusched/`` (also written
  ``unix+http://``): the broker's Unix domain socket, in a directory that only the broker's user
  can create files in. Before every connection the server checks the whole path
  (:func:`check_socket`), so nobody else can have put a socket of their own there.
- ``https://HOST:PORT/services/gpusched/``: TLS, with the broker's certificate verified against a
  CA file (JupyterHub's ``internal_ssl`` certificates, or the admin's own).

Plain ``http://`` still works (a broker on another host of a trusted network, a test), and a
server says in its log what it risks.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import stat
import urllib.parse
from dataclasses import dataclass

from tornado.netutil import Resolver

__all__ = [
    "BrokerAbsent",
    "BrokerAddress",
    "UnixResolver",
    "UntrustedBroker",
    "check_socket",
    "client_ssl_context",
    "is_loopback",
    "parse_broker_url",
    "prepare_socket_dir",
]

#: The schemes of a broker URL on a Unix domain socket (jupyter_server's spelling first).
UNIX_SCHEMES = ("http+unix", "unix+http")
#: The host name an HTTP request to a Unix socket carries (the socket, not DNS, decides where it goes).
UNIX_HOST = "gpusched-broker"
#: The longest path a Unix domain socket may have (``sun_path`` less its terminating NUL).
MAX_SOCKET_PATH = 107


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this host's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class UntrustedBroker(Exception):
    """The broker's address cannot be trusted with a token: nothing is sent there."""


class BrokerAbsent(UntrustedBroker):
    """The broker's socket is not there: the broker is not running (nothing is sent either)."""


@dataclass(frozen=True)
class BrokerAddress:
    """A broker URL taken apart.

    Attributes:
        url: the URL as configured, ending in ``/``.
        base: the URL that HTTP requests are made to (for a Unix socket, ``http://gpusched-broker``
            and the path; the resolver sends it to the socket), ending in ``/``.
        socket_path: the Unix socket's path, or None for TCP.
        tls: whether the connection is TLS (``https``).
    """

    url: str
    base: str
    socket_path: str | None = None
    tls: bool = False

    @property
    def loopback_http(self) -> bool:
        """Plain HTTP to an address of this host, which any local user may hold while it is free."""
        if self.socket_path is not None or self.tls:
            return False
        return is_loopback(urllib.parse.urlsplit(self.base).hostname or "")

    def where(self) -> str:
        """The address for people: the socket's path, or the URL."""
        return f"the Unix socket {self.socket_path}" if self.socket_path else self.url

    def websocket_url(self, path: str) -> str:
        scheme = "wss" if self.tls else "ws"
        return scheme + ":" + self.base.split(":", 1)[1] + path


def parse_broker_url(url: str) -> BrokerAddress:
    """Read a broker URL: ``http://``, ``https://`` or ``http+unix://<socket path, %-encoded>/prefix/``.

    Raises:
        ValueError: the URL is none of these, with what was wrong.
    """
    url = (url or "").strip()
    if not url:
        raise ValueError("the broker URL is empty")
    if not url.endswith("/"):
        url += "/"
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in UNIX_SCHEMES:
        # The socket's path is the URL's host, %-encoded (as JupyterHub and jupyter_server write it).
        encoded = url.split("://", 1)[1].split("/", 1)[0]
        path = urllib.parse.unquote(encoded)
        if not path.startswith("/"):
            raise ValueError(
                f"broker URL {url!r}: the socket's path must be absolute and %-encoded, as in "
                "http+unix://%2Frun%2Fjupyterhub-gpusched%2Fbroker.sock/services/gpusched/"
            )
        if len(path.encode()) > MAX_SOCKET_PATH:
            raise ValueError(f"broker URL {url!r}: a Unix socket's path has at most {MAX_SOCKET_PATH} bytes")
        prefix = parts.path or "/"
        return BrokerAddress(url=url, base=f"http://{UNIX_HOST}{prefix}", socket_path=os.path.normpath(path))
    if scheme in ("http", "https"):
        if not parts.hostname:
            raise ValueError(f"broker URL {url!r} names no host")
        return BrokerAddress(url=url, base=url, tls=scheme == "https")
    raise ValueError(
        f"broker URL {url!r}: use http+unix://<socket path, %-encoded>/services/gpusched/ (a broker on "
        "this host), https:// (verified with a CA file) or http://"
    )


def _who(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _trusted_path(directory: str, owners: set[int]) -> None:
    """Every directory from ``/`` down to ``directory`` is one no other user can change.

    A directory is safe when it is owned by root or one of ``owners`` and nobody else may write
    it; a world-writable directory with the sticky bit (``/tmp``) is safe above a child that such
    an owner owns, since nobody else may then rename or remove that child.
    """
    directory = os.path.abspath(directory)
    chain = []
    path = directory
    while True:
        chain.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    chain.reverse()  # "/" first
    for i, path in enumerate(chain):
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise UntrustedBroker(f"{path} cannot be read ({exc.strerror})") from None
        if stat.S_ISLNK(st.st_mode):
            raise UntrustedBroker(f"{path} is a symbolic link, which another user may have made")
        if not stat.S_ISDIR(st.st_mode):
            raise UntrustedBroker(f"{path} is not a directory")
        if st.st_uid != 0 and st.st_uid not in owners:
            raise UntrustedBroker(f"{path} belongs to {_who(st.st_uid)}, who does not run the broker")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            last = i == len(chain) - 1
            sticky = bool(st.st_mode & stat.S_ISVTX)
            if last or not sticky:
                raise UntrustedBroker(
                    f"{path} may be written by other users (mode {stat.S_IMODE(st.st_mode):04o}), who could put "
                    "a socket of their own there"
                )


def check_socket(path: str, *, owners: set[int] | None = None) -> None:
    """Whether the broker's Unix socket at ``path`` can only be the broker's.

    The socket must be owned by the user who owns its directory (or root), and the directory and
    each one above it must be changeable by nobody else (:func:`_trusted_path`). Then no other
    user can have created the socket, replaced it, or create it while the broker is down.

    Args:
        path: the socket's path.
        owners: the uids besides root that may run the broker; default: whoever owns the socket's
            directory.

    Raises:
        UntrustedBroker: what is wrong, as a sentence about the path.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        dir_st = os.lstat(directory)
    except OSError as exc:
        raise UntrustedBroker(f"the broker's socket directory {directory} cannot be read ({exc.strerror})") from None
    allowed = set(owners) if owners is not None else {dir_st.st_uid}
    _trusted_path(directory, allowed)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise BrokerAbsent(f"there is no socket at {path}: the broker is not running") from None
    except OSError as exc:
        raise UntrustedBroker(f"{path} cannot be read ({exc.strerror})") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise UntrustedBroker(f"{path} is not a socket")
    if st.st_uid != 0 and st.st_uid not in allowed:
        raise UntrustedBroker(f"the socket {path} belongs to {_who(st.st_uid)}, who does not run the broker")


def prepare_socket_dir(path: str) -> None:
    """Make the directory of the broker's socket, or check the one there (the broker's side).

    A missing directory is made (mode 0755: every user may connect, only this user may create
    files). An existing one must belong to this user or root and be writable by nobody else,
    and so must every directory above it.

    Raises:
        ValueError: the directory is unsafe or cannot be made, with what to do.
    """
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"unix_socket {path!r} is too long for a Unix socket (at most {MAX_SOCKET_PATH} bytes)")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(directory):
        try:
            os.makedirs(directory, mode=0o755)
        except OSError as exc:
            raise ValueError(f"cannot make the socket directory {directory}: {exc.strerror}") from None
        os.chmod(directory, 0o755)  # whatever the umask
    try:
        _trusted_path(directory, {os.geteuid()})
    except UntrustedBroker as exc:
        raise ValueError(
            f"the broker's socket directory is unsafe: {exc}. Use a directory that only the broker's user "
            "can write, such as /run/jupyterhub-gpusched"
        ) from None
    if os.lstat(directory).st_uid != os.geteuid():
        raise ValueError(
            f"the broker's socket directory {directory} belongs to {_who(os.lstat(directory).st_uid)}, not to "
            "the broker's user: use a directory of the broker's own"
        )


class UnixResolver(Resolver):
    """Sends every connection to one Unix socket (tornado's HTTP and websocket clients take a resolver)."""

    def initialize(self, path: str) -> None:  # type: ignore[override]
        self.path = path

    async def resolve(self, host: str, port: int, family: socket.AddressFamily = socket.AF_UNSPEC):  # noqa: ARG002
        return [(socket.AF_UNIX, self.path)]

    def close(self) -> None:
        pass


def client_ssl_context(ca_file: str | None) -> ssl.SSLContext:
    """TLS for a server's calls to the broker: the broker's certificate checked against ``ca_file``.

    Without a CA file the system's trusted authorities are used. JupyterHub's ``internal_ssl``
    client certificate and key (``JUPYTERHUB_SSL_CERTFILE``, ``JUPYTERHUB_SSL_KEYFILE``) are
    presented when the server has them.
    """
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file or None)
    certfile = os.environ.get("JUPYTERHUB_SSL_CERTFILE", "")
    keyfile = os.environ.get("JUPYTERHUB_SSL_KEYFILE", "")
    if certfile and keyfile and os.path.isfile(certfile) and os.path.isfile(keyfile):
        try:
            ctx.load_cert_chain(certfile, keyfile)
        except (OSError, ssl.SSLError):
            pass  # the broker does not require a client certificate
    return ctx
