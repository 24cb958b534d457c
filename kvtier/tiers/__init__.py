"""Tiers of the hierarchy: where pages are stored (the mover, :mod:`kvtier.mover`, moves them)."""

from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import DeviceTier, HostTier
from kvtier.tiers.mooncake import MooncakeTier
from kvtier.tiers.redis import RedisTier

__all__ = ["DeviceTier", "DiskTier", "HostTier", "MooncakeTier", "RedisTier", "Tier"]
