"""Tiers of the hierarchy and the engine that moves pages between them."""

from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import DeviceTier, HostTier
from kvtier.tiers.mooncake import MooncakeTier
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.transfer import TransferEngine

__all__ = ["DeviceTier", "DiskTier", "HostTier", "MooncakeTier", "RedisTier", "Tier", "TransferEngine"]
