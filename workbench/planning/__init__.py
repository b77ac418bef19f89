"""The dry-run planner: from a source catalog and a mapper to a `Plan` the engine executes."""

from .build import build_plan, make_options, plan
from .model import Plan, PlanOptions
from .sizes import format_bytes, parse_size

__all__ = ["Plan", "PlanOptions", "build_plan", "format_bytes", "make_options", "parse_size", "plan"]
