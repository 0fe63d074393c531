"""The kernel side: ``%gpu`` magics, the Python API, the status panel and the pre-run hook.

Loaded into IPython kernels by the provisioner (``--InteractiveShellApp.extra_extensions=
jupyter_gpusched.kernel``) or by hand (``%load_ext jupyter_gpusched``). It imports only the
standard library and IPython (ipywidgets for the panel, when it is shown): never tornado,
jupyter_server or an NVML binding.
"""

from __future__ import annotations

from typing import Any

__all__ = ["gpu", "load_ipython_extension", "unload_ipython_extension"]


def load_ipython_extension(ipython: Any) -> None:
    """Register the ``%gpu`` magics and the pre-run hook in ``ipython``."""
    from .agent import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Remove the magics and the hook, and stop the watcher and the panel."""
    from .agent import unload_ipython_extension as unload

    unload(ipython)


def __getattr__(name: str) -> Any:
    if name == "gpu":
        from .api import gpu

        return gpu
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
