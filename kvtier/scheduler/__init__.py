"""Schedulers: page placement per step, and how a long prompt is cut into chunks."""

from kvtier.scheduler.base import MigrationPlan, Move, Ranking, Scheduler, page_info
from kvtier.scheduler.lookahead import LookaheadScheduler

__all__ = ["LookaheadScheduler", "MigrationPlan", "Move", "Ranking", "Scheduler", "page_info"]
