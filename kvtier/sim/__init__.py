"""kvtier.sim: a discrete-event simulator of a serving cluster with tiered KV, calibrated by kvtier's benches.

``Cluster(ClusterSpec([...]), requests).run()`` -> a :class:`Ledger`; step costs from :class:`StepCosts` over a
:class:`Calibration` (:func:`load_calibration`); seeds 000-002 as ``kvtier-run experiment=sim_seed000|001|002``.
"""

from kvtier.sim.calibration import Calibration, load_calibration
from kvtier.sim.cluster import Cluster, ClusterSpec, InstanceSpec, Offload
from kvtier.sim.costs import StepCosts
from kvtier.sim.ledger import Ledger

__all__ = ["Calibration", "Cluster", "ClusterSpec", "InstanceSpec", "Ledger", "Offload", "StepCosts",
           "load_calibration"]
