"""SimSeed: the ``sim_seed000|001|002`` experiments' task. It loads no model (``needs_model``: the run path skips
the model, engine and cache) and simulates one seed's scenario with a calibration file."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kvtier.errors import ConfigError
from kvtier.sim.calibration import load_calibration
from kvtier.sim.seed000 import Seed000
from kvtier.sim.seed001 import Seed001
from kvtier.sim.seed002 import Seed002

SCENARIOS = {"000": Seed000, "001": Seed001, "002": Seed002}


@dataclass
class SimSeed:
    """Seed ``seed``'s scenario (:mod:`kvtier.sim.seed000` ...), its fields overridden by ``options``, with the
    calibration in ``calibration`` (null: the shipped H200 one); ``plots``: write its sweep PNG in the run folder."""

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
