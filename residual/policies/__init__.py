"""Built-in residual policies: immutable values that decide how each residual is stored."""

from .cast import Cast as Cast
from .chain import Chain as Chain
from .identity import Identity as Identity
from .offload import Offload as Offload
from .offload import save_on_cpu as save_on_cpu
from .profile import Profile as Profile
from .profile import ProfileLog as ProfileLog
from .quantize import Quantize as Quantize
from .remat import Remat as Remat
from .select import select as select
from .where import where as where
