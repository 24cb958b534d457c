"""Schedulers: page placement per step, and how a long prompt is cut into chunks."""

from kvtier.scheduler.base import MigrationPlan, Move, Scheduler
from kvtier.scheduler.lookahead import LookaheadScheduler, page_info

__all__ = ["LookaheadScheduler", "MigrationPlan", "Move", "Scheduler", "page_info"]
