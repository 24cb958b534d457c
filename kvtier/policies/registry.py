"""``POLICIES``: the recipe name of each placement policy -> its class."""

from kvtier.policies.aspe import ASPE
from kvtier.policies.compose import Compose
from kvtier.policies.expected_attention import ExpectedAttention
from kvtier.policies.h2o import H2O
from kvtier.policies.knorm import Knorm
from kvtier.policies.lru import LRU
from kvtier.policies.quest import Quest
from kvtier.policies.scored import ScoredPolicy
from kvtier.policies.sink_window import SinkWindow
from kvtier.policies.snapkv import SnapKV
from kvtier.policies.tova import TOVA

POLICIES = {"lru": LRU, "sink_window": SinkWindow, "aspe": ASPE, "compose": Compose, "h2o": H2O, "tova": TOVA,
            "snapkv": SnapKV, "knorm": Knorm, "quest": Quest, "expected_attention": ExpectedAttention,
            "scored": ScoredPolicy}
