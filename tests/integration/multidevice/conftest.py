"""Eight simulated CPU devices, set before JAX starts (this directory runs in its own process)."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
