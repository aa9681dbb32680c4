"""`residual`: saved-tensor hooks for JAX. Pack, quantize, offload or recompute the
residuals your gradients save."""

from . import policies as policies
from ._collectives import collectives as collectives
from ._engine.transform import with_hooks as with_hooks
from ._errors import HookError as HookError
from ._errors import TargetUnavailableError as TargetUnavailableError
from ._gradcheck import GradcheckResult as GradcheckResult
from ._gradcheck import gradcheck as gradcheck
from ._info import ResidualInfo as ResidualInfo
from ._inspect.analysis import inspect as inspect
from ._inspect.peak import Peak as Peak
from ._inspect.peak import PeakRow as PeakRow
from ._inspect.peak import peak as peak
from ._inspect.report import Report as Report
from ._memory import Memory as Memory
from ._memory import compiled_memory as compiled_memory
from ._plan import Plan as Plan
from ._plan import PlanDecision as PlanDecision
from ._plan import PlanSweep as PlanSweep
from ._plan import plan as plan
from ._plan import plan_sweep as plan_sweep
from ._policy import Policy as Policy
from ._scope import disable_saved_tensors_hooks as disable_saved_tensors_hooks
from ._scope import saved_tensors_hooks as saved_tensors_hooks
from ._target import DoesNotFitError as DoesNotFitError
from .policies.offload import save_on_cpu as save_on_cpu

__version__ = "0.1.0"
