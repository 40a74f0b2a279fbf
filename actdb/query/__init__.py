"""Query: SQL over a store, with lazy geometric tensor functions."""

from .database import Database, connect
from .functions import FUNCTIONS, REGISTRY
from .result import Result

__all__ = ["FUNCTIONS", "REGISTRY", "Database", "Result", "connect"]
