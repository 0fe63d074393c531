"""Fair, dynamic GPU sharing for Jupyter."""

from ._version import __version__

__all__ = ["__version__"]


def _jupyter_server_extension_points() -> list[dict]:
    # Imported here so that kernels importing this package never load the server.
    from .server.app import GPUSchedApp

    return [{"module": "jupyter_gpusched", "app": GPUSchedApp}]


def _jupyter_labextension_paths() -> list[dict]:
    return [{"src": "labextension", "dest": "jupyter-gpusched"}]
