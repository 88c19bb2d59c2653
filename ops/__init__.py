"""Op families: one spec each, plus their public PyTorch functions."""
from .registry import get_spec, specs  # noqa: F401
