"""Whom the ``gpusched`` service's token may go to: what a node broker must show first.

The brokers asked are only those of the admin's list or of the Kubernetes API's pod list
(:func:`jupyter_gpusched.kubernetes.node_brokers`); :class:`BrokerTrust` says how each is reached:
over ``https`` with its certificate verified, over plain ``http`` only to this host's loopback
address or to hosts the admin allowed.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
import urllib.parse
from dataclasses import dataclass
from typing import Any

from . import transport

#: The CA file (PEM) that node brokers' certificates must be signed by (https:// brokers).
ENV_CA = "GPUSCHED_BROKER_CA"
#: The client certificate and key (PEM) shown to https:// brokers that ask for one (mutual TLS).
ENV_CLIENT_CERT = "GPUSCHED_BROKER_CERT"
ENV_CLIENT_KEY = "GPUSCHED_BROKER_KEY"
#: Hosts besides this host's loopback address that may get the service token over plain http.
ENV_ALLOW_HTTP = "GPUSCHED_BROKER_ALLOW_HTTP"
#: JupyterHub's internal_ssl files, as the hub gives them to its services and servers.
ENV_HUB_CA = "JUPYTERHUB_SSL_CLIENT_CA"
ENV_HUB_CERT = "JUPYTERHUB_SSL_CERTFILE"
ENV_HUB_KEY = "JUPYTERHUB_SSL_KEYFILE"
#: A Kubernetes node name (a DNS subdomain), or a host name.
_NODE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class BrokerTrust:
    """What a node broker must show before the ``gpusched`` service's token goes to it.

    The brokers asked are only those of the admin's list or of the Kubernetes API's pod list
    (:func:`node_brokers`); this says how each is reached. Over ``https`` the broker's certificate
    must be verified (host name included) before anything is sent; over plain ``http`` the token
    goes only to this host's loopback address (as JupyterHub itself talks to its local services)
    or to the hosts the admin allowed.

    Attributes:
        ca_file: the CA file (PEM) that an https:// broker's certificate must be signed by; empty:
            the system's trusted CAs.
        cert_file: a client certificate (PEM) shown to brokers that ask for one (JupyterHub's
            ``internal_ssl`` services do); empty: none. ``key_file`` is its key.
        allow_http: hosts besides the loopback address that may get the token over plain http:
            host names, IP addresses, IP networks (``10.0.0.0/8``), or ``*`` for every host.
    """

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    allow_http: tuple[str, ...] = ()

    @classmethod
    def from_environment(cls) -> BrokerTrust:
        """The trust this process is configured with.

        ``GPUSCHED_BROKER_CA``, else JupyterHub's internal_ssl CA (``JUPYTERHUB_SSL_CLIENT_CA`` in a
        service, the hub's own trust bundle in the hub process when ``internal_ssl`` is on);
        ``GPUSCHED_BROKER_CERT`` and ``GPUSCHED_BROKER_KEY``, else internal_ssl's
        (``JUPYTERHUB_SSL_CERTFILE``, ``JUPYTERHUB_SSL_KEYFILE``, or the hub's); and
        ``GPUSCHED_BROKER_ALLOW_HTTP`` (comma-separated).

        Raises:
            ValueError: a file that is not there, a certificate without its key, a bad host entry.
        """
        hub = _hub_internal_ssl()
        ca = _env(ENV_CA) or _env(ENV_HUB_CA) or (hub[0] if hub else "")
        cert, key = _env(ENV_CLIENT_CERT), _env(ENV_CLIENT_KEY)
        if not (cert or key):
            cert, key = _env(ENV_HUB_CERT), _env(ENV_HUB_KEY)
        if not (cert or key) and hub:
            cert, key = hub[1], hub[2]
        if bool(cert) != bool(key):
            raise ValueError(f"{ENV_CLIENT_CERT} and {ENV_CLIENT_KEY} go together: set both or neither")
        for what, path in (("CA file", ca), ("client certificate", cert), ("client key", key)):
            if path and not os.path.isfile(path):
                raise ValueError(f"the node brokers' {what} {path} is not a file")
        return cls(ca, cert, key, parse_allow_http(_env(ENV_ALLOW_HTTP)))

    def refusal(self, url: str) -> str | None:
        """Why the token must not go to ``url`` at all (None: it may, once its certificate is checked)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == "https":
            return None
        host = (parts.hostname or "").lower()
        if parts.scheme != "http" or not host:
            return f"{url!r} is not an http(s):// URL"
        if transport.is_loopback(host) or self.allows_http(host):
            return None
        return (
            f"plain http to {host}, which is not this host's loopback address: the service token is not sent "
            f"there (give the broker an https:// URL, or allow the host in {ENV_ALLOW_HTTP})"
        )

    def allows_http(self, host: str) -> bool:
        """Whether the admin allowed plain http to ``host``."""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            address = None
        for entry in self.allow_http:
            if entry == "*" or entry == host.lower():
                return True
            if address is not None and "/" in entry:
                network = ipaddress.ip_network(entry)
                if address.version == network.version and address in network:
                    return True
        return False

    def tls_options(self) -> dict[str, Any]:
        """The request options that verify an https:// broker (both tornado HTTP clients read them)."""
        return {
            "validate_cert": True,
            "ca_certs": self.ca_file or None,
            "client_cert": self.cert_file or None,
            "client_key": self.key_file or None,
        }


def parse_allow_http(spec: str, what: str = ENV_ALLOW_HTTP) -> tuple[str, ...]:
    """``host,10.0.0.0/8,*`` as :attr:`BrokerTrust.allow_http` (networks normalised); ``ValueError``
    naming a bad entry."""
    out: list[str] = []
    for entry in (part.strip().lower() for part in re.split(r"[,\s]+", spec or "")):
        if not entry:
            continue
        if entry == "*":
            out.append(entry)
            continue
        try:
            out.append(str(ipaddress.ip_network(entry.strip("[]"), strict=False)))
            continue
        except ValueError:
            pass
        if not _NODE_NAME.match(entry):
            raise ValueError(f"{what}: {entry!r} is not a host name, an IP address or network, or *")
        out.append(entry)
    return tuple(out)


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def _hub_internal_ssl() -> tuple[str, str, str] | None:
    """In the hub process with ``internal_ssl`` on: its trust bundle, certificate and key."""
    app_module = sys.modules.get("jupyterhub.app")  # never imported here: only if the hub runs
    hub_class = getattr(app_module, "JupyterHub", None)
    try:
        if hub_class is None or not hub_class.initialized():
            return None
        hub = hub_class.instance()
        if not hub.internal_ssl:
            return None
        return str(hub.internal_ssl_ca or ""), str(hub.internal_ssl_cert or ""), str(hub.internal_ssl_key or "")
    except Exception:  # noqa: BLE001 - a hub of another version: the environment alone decides
        return None
