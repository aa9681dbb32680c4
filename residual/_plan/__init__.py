"""The planner: an action per residual (keep, cast, quantize, recompute, offload) chosen
so that `jit(grad)` fits a memory budget, checked on the compiled program.

See README.md in this folder for how a plan is made and where to make a change.
"""

from .planner import plan as plan
from .sweep import PlanSweep as PlanSweep
from .sweep import plan_sweep as plan_sweep
from .value import Plan as Plan
from .value import PlanDecision as PlanDecision
