"""Fair, dynamic GPU sharing for Jupyter."""

from typing import Any

from ._version import __version__

__all__ = ["__version__", "gpu", "load_ipython_extension", "unload_ipython_extension"]


# ``%load_ext jupyter_gpusched``: the kernel agent (``%gpu`` magics, pre-run hook). The kernel
# package imports nothing until it is loaded.
from .kernel import load_ipython_extension, unload_ipython_extension  # noqa: E402


def __getattr__(name: str) -> Any:
    """``from jupyter_gpusched import gpu`` without importing any server code."""
    if name != "gpu":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .kernel.api import gpu

    return gpu


def _jupyter_server_extension_points() -> list[dict]:
    # Imported here so that kernels importing this package never load the server.
    from .server.app import GPUSchedApp

    return [{"module": "jupyter_gpusched", "app": GPUSchedApp}]


def _jupyter_labextension_paths() -> list[dict]:
    return [{"src": "labextension", "dest": "jupyter-gpusched"}]
