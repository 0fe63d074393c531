"""Fair, dynamic GPU sharing for Jupyter."""
from ._version import __version__

__all__ = ["__version__"]
