"""SimSeed: the task of the ``sim_long_context_offload``, ``sim_pd_disaggregation`` and ``sim_memory_managers``
experiments (seeds 000, 001, 002). It loads no model (``needs_model``: the run path skips
the model, engine and cache) and simulates the scenario a seed's claims describe, with a calibration."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kvtier.errors import ConfigError
from kvtier.sim.calibration import load_calibration
from kvtier.sim.long_context_offload import LongContextOffload
from kvtier.sim.memory_managers import MemoryManagers
from kvtier.sim.pd_disaggregation import PDDisaggregation

SCENARIOS = {"000": LongContextOffload, "001": PDDisaggregation, "002": MemoryManagers}


@dataclass
class SimSeed:
    """The scenario of seed ``seed``'s claims (:data:`SCENARIOS`), its fields overridden by ``options``, with the
    calibration ``calibration`` (null: the shipped H100 one, the seeds' GPU; H200; or a JSON path); ``plots``:
    write its sweep PNG in the run folder."""

    seed: str = "000"
    calibration: str | None = None
    plots: bool = True
    options: dict | None = None
    name: ClassVar[str] = "sim_seed"
    needs_model: ClassVar[bool] = False

    def __post_init__(self):
        self.seed = str(self.seed).zfill(3)
        if self.seed not in SCENARIOS:
            raise ConfigError("task.seed", f"use one of {sorted(SCENARIOS)}, got {self.seed!r}")
        self.options = dict(self.options or {})
        known = {f.name for f in dataclasses.fields(SCENARIOS[self.seed])} - {"cal"}
        unknown = set(self.options) - known
        if unknown:
            raise ConfigError("task.options", f"seed {self.seed} has no option {sorted(unknown)}; it takes "
                                              f"{sorted(known)}")
        self.cal = load_calibration(self.calibration)

    def run(self, run_dir: str | Path) -> dict:
        scenario = SCENARIOS[self.seed](self.cal, **self.options)
        result = scenario.run(Path(run_dir) if self.plots else None)
        source = f", from {self.cal.source}" if self.cal.source else ""
        print(f"\nseed {self.seed} against kvtier.sim ({self.cal.gpu} calibration{source}):\n")
        print(result["table"])
        if "plot" in result:
            print(f"\nplot: {result['plot']}")
        return {"task": f"sim_seed{self.seed}", **result}
