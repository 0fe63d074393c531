"""Process-wide handles the kernel provisioner needs: the running arbiter and the kernel tokens.

The provisioner is created by jupyter_client's kernel manager, not by the extension, so it finds
the extension here. Only one GPU scheduler extension runs per Jupyter server process.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Tokens:
    """Per-kernel tokens: each is good for its own kernel's lease only.

    Only a digest of each token is kept, so a memory dump of the server does not hand them out.
    """

    _by_digest: dict[str, str] = field(default_factory=dict)
    _by_kernel: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def _digest(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    def issue(self, kernel_id: str) -> str:
        self.revoke(kernel_id)
        token = secrets.token_urlsafe(32)
        digest = self._digest(token)
        self._by_digest[digest] = kernel_id
        self._by_kernel[kernel_id] = digest
        return token

    def kernel_of(self, token: str | None) -> str | None:
        if not token:
            return None
        # Looking up a digest leaks nothing useful about the token itself.
        return self._by_digest.get(self._digest(token))

    def revoke(self, kernel_id: str) -> None:
        digest = self._by_kernel.pop(kernel_id, None)
        if digest is not None:
            self._by_digest.pop(digest, None)


@dataclass
class Registry:
    arbiter: Any = None
    kernels: Any = None
    tokens: Tokens = field(default_factory=Tokens)
    user: str = ""
    url: str = ""
    sim_state: str | None = None
    log: Any = None
    #: The MPS daemons (``server.mps.MPS``), or None.
    mps: Any = None


_current: Registry | None = None


def current() -> Registry | None:
    return _current


def install(registry: Registry | None) -> None:
    global _current
    _current = registry
