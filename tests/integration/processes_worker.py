"""One of two JAX processes training a data-parallel model with hooks (test_processes.py).

Run as `python -m tests.integration.processes_worker PROCESS_ID PORT`: it joins the other process
through `jax.distributed` on localhost (one CPU device each, collectives through gloo)
and prints what it measured as one JSON line; the test compares the two processes'
lines. Everything below runs alike on both, as a multi-host training script does.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import residual
from residual import policies as rp
from residual._measure import whole_gradient_error


def policies() -> dict:
    """Made after `join`: `Offload` reads the device's memories, which starts a backend."""
    return {"identity": rp.Identity(), "offload": rp.Offload(), "remat": rp.Remat(),
            "int8": rp.Quantize(bits=8, min_bytes=0)}


def layer(h, w):
    return jax.nn.gelu(h @ w), None


def loss(params, x):
    """A GELU MLP: a layer, then a scan over the others (its activations dominate)."""
    h, _ = layer(x, params["first"])
    h, _ = jax.lax.scan(layer, h, params["stack"])
    return jnp.mean(h**2)


def scoped_loss(params, x):
    """The first layer's residuals under int8 through a scope inside the function."""
    with residual.saved_tensors_hooks(policy=rp.Quantize(bits=8, min_bytes=0)):
        h, _ = layer(x, params["first"])
    h, _ = jax.lax.scan(layer, h, params["stack"])
    return jnp.mean(h**2)


def global_array(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def local(tree) -> list[list[float]]:
    """This process's shards of a replicated result, as plain numbers."""
    return [np.asarray(leaf.addressable_data(0)).ravel().tolist()
            for leaf in jax.tree.leaves(tree)]


def join(process_id: int, port: str) -> None:
    """Joins the other process before JAX starts a backend (collectives through gloo)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)


def main() -> None:
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(0)  # the same on both processes, as a seed is
    params = {"first": rng.standard_normal((128, 128)) / 11,
              "stack": rng.standard_normal((4, 128, 128)) / 11}
    params = {k: global_array(v.astype(np.float32), replicated) for k, v in params.items()}
    x = global_array(rng.standard_normal((512, 128)).astype(np.float32), batch)

    out: dict = {"process": jax.process_index(), "processes": jax.process_count(),
                 "local_devices": jax.local_device_count(), "devices": jax.device_count()}
    plain_step = jax.jit(jax.grad(loss))
    out["plain"] = local(plain_step(params, x))
    out["collectives"] = {"plain": residual.collectives(plain_step.lower(params, x).compile())}
    for name, policy in policies().items():
        step = jax.jit(jax.grad(residual.with_hooks(loss, policy=policy)))
        out[name] = local(step(params, x))
        out["collectives"][name] = residual.collectives(step.lower(params, x).compile())
    out["scoped"] = local(jax.jit(jax.grad(residual.with_hooks(scoped_loss)))(params, x))

    # A few optimizer steps: the losses as plain training has them, step by step.
    optimizer = optax.adam(1e-2)

    def train(fn):
        @jax.jit
        def update(params, state, x):
            value, grads = jax.value_and_grad(fn)(params, x)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        p, state, values = params, optimizer.init(params), []
        for _ in range(3):
            p, state, value = update(p, state, x)
            values.append(float(value))
        return values

    out["train_plain"] = train(loss)
    out["train_int8"] = train(residual.with_hooks(loss, policy=policies()["int8"]))

    # The planner's gradient error, on values sharded across the processes.
    out["sharded_error"] = whole_gradient_error(jax.jit(lambda x: x * 1.01)(x), x)

    report = residual.inspect(loss, params, x, policy=policies()["int8"])
    out["inspect"] = {k: report.totals[k] for k in ("stored_bytes", "residual_bytes",
                                                    "plain_peak_bytes", "hooked_peak_bytes")}
    chosen = residual.plan(loss, params, x, budget=0.6, actions=("int8", "remat"))
    out["plan"] = {"decisions": repr(chosen.decisions), "memory": chosen.memory,
                   "plain_memory": chosen.plain_memory, "grad_error": chosen.grad_error,
                   "gradient": local(jax.jit(jax.grad(
                       residual.with_hooks(loss, policy=chosen)))(params, x))}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    join(int(sys.argv[1]), sys.argv[2])
    main()
