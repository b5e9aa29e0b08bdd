"""TP/EP planning: the split rule of every tensor and which rank holds what (no I/O)."""

from .parallel import Cut, ParallelPlan, Placement, ShardPlan, place, validate
from .rules import EXPERT_PARTS, SPLITS, Rule, Split, rule_of

__all__ = ["Cut", "ParallelPlan", "Placement", "ShardPlan", "place", "validate", "EXPERT_PARTS", "SPLITS", "Rule",
           "Split", "rule_of"]
