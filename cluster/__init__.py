"""pdserve: a serving cluster for LLMs. The engine core lives in this package and imports no Ray,
HTTP or Redis: workers and front doors wrap it."""

__version__ = "0.1.0"
