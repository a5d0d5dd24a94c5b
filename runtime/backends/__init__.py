"""Backends behind one runner contract, found by name through a lazy registry."""

from .base import BACKENDS, Runner, available_backends, get_runner_class

__all__ = ["BACKENDS", "Runner", "available_backends", "get_runner_class"]
