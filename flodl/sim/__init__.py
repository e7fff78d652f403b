"""Scale by simulation: N virtual ranks on a virtual clock driving the real controller and ElChe.

See :mod:`flodl.sim.engine` (the event loop and the virtual ranks) and :mod:`flodl.sim.costs`
(the ring all-reduce model, the speed scenarios and the yardsticks); ``bench/scale_sim.py``
runs the grid.
"""

from flodl.sim.costs import SCENARIOS, RingAllReduce, Scenario, Workload, make_scenario
from flodl.sim.engine import SimResult, Simulator

__all__ = [
    "SCENARIOS",
    "RingAllReduce",
    "Scenario",
    "SimResult",
    "Simulator",
    "Workload",
    "make_scenario",
]
