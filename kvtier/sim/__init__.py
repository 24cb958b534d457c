"""kvtier.sim: a discrete-event simulator of a serving cluster with tiered KV, its step costs an operator roofline
at measured rates plus kvtier's engine overheads fitted on its benches (validated on held-out rows and across
GPU kinds: ``python -m kvtier.sim.validate``).

``Cluster(ClusterSpec([...]), requests).run()`` -> a :class:`Ledger`; step costs from :class:`StepCosts` over a
:class:`Calibration` (:func:`load_calibration`); the seeds' claims as ``kvtier-run experiment=sim_<scenario>``
(``long_context_offload``, ``pd_disaggregation``, ``memory_managers``); a cluster with a shared KV pool as
``python -m kvtier.sim.kv_pool_cluster``.
"""

from kvtier.sim.calibration import Calibration, load_calibration
from kvtier.sim.cluster import Cluster, ClusterSpec, InstanceSpec, Offload
from kvtier.sim.costs import StepCosts
from kvtier.sim.ledger import Ledger

__all__ = ["Calibration", "Cluster", "ClusterSpec", "InstanceSpec", "Ledger", "Offload", "StepCosts",
           "load_calibration"]
