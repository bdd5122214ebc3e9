"""poolkeeper: a maintenance plane for lease-based execution pools."""

__version__ = "0.1.0"
