"""Errors of the planner.

    PlannerError
    ├── ConfigError        a bad target, budget or setting: start-up stops, naming the flag
    └── ConnectorError     a connector could not act (a worker did not start, the Kubernetes API refused)
"""
from __future__ import annotations


class PlannerError(Exception):
    """Base class of the planner's errors."""


class ConfigError(PlannerError, ValueError):
    pass


class ConnectorError(PlannerError):
    pass
