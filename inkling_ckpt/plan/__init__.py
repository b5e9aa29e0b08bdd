"""TP/EP planning: the split rule of every tensor and which rank holds what (no I/O)."""

from .parallel import ParallelPlan, Placement, ShardPlan, place, validate
from .rules import SPLITS, Rule, Split, rule_of

__all__ = ["ParallelPlan", "Placement", "ShardPlan", "place", "validate", "SPLITS", "Rule", "Split", "rule_of"]
