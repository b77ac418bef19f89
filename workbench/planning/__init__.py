"""The dry-run planner: from a source catalog and a mapper to a `Plan` the engine executes."""

from ..display import format_bytes, parse_size
from .build import build_plan, make_options, plan
from .model import Plan, PlanOptions

__all__ = ["Plan", "PlanOptions", "build_plan", "format_bytes", "make_options", "parse_size", "plan"]
