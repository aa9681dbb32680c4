"""A Fourier neural operator's complex spectra: packed or stored as they are.

Each layer of a 1-D Fourier neural operator (Li et al., 2021) takes the FFT of its
input along the grid, mixes the lowest modes' channels by a complex weight, and adds
the inverse FFT to a pointwise linear map before a GELU. Its residuals include the
truncated spectra, complex. This benchmark compiles `jax.grad` of it, scanned over
layers and unrolled, under each packing policy as it is and with the complex residuals
kept as they are (`select(where(dtype=jnp.complexfloating) -> Identity)`), as ratios to
plain's peak / peak beyond arguments and outputs measured in the same run, with each
one's gradient error against plain's on a small copy of the model (on the running
backend).

    python benchmarks/fourier.py                  # the running backend
    python benchmarks/fourier.py --target v5e     # pip install 'residual[tpu]'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(Path(__file__).parent))
from _errors import relative_error

import residual
from residual import policies as rp

POINTS, CHANNELS, MODES, LAYERS = 256, 64, 64, 4


def fourier_layer(h, layer):
    w, real, imag = layer
    spectra = jnp.fft.rfft(h, axis=1)[:, :MODES]  # complex [batch, modes, channels]
    mixed = jnp.einsum("bmi,mio->bmo", spectra, lax.complex(real, imag))
    return jax.nn.gelu(h @ w + jnp.fft.irfft(mixed, n=h.shape[1], axis=1))


def scanned(params, x):
    h, _ = lax.scan(lambda h, layer: (fourier_layer(h, layer), None), x, params)
    return jnp.mean(h**2)


def unrolled(params, x):
    for i in range(LAYERS):
        x = fourier_layer(x, jax.tree.map(lambda p, i=i: p[i], params))
    return jnp.mean(x**2)


def parameters(batch: int, points: int = POINTS):
    k = jax.random.split(jax.random.key(0), 4)
    spectral = (LAYERS, MODES, CHANNELS, CHANNELS)
    params = (jax.random.normal(k[0], (LAYERS, CHANNELS, CHANNELS)) / CHANNELS**0.5,
              jax.random.normal(k[1], spectral) / CHANNELS,
              jax.random.normal(k[2], spectral) / CHANNELS)
    return params, jax.random.normal(k[3], (batch, points, CHANNELS))


def complex_kept(policy):
    return rp.select([(rp.where(dtype=jnp.complexfloating), rp.Identity())], default=policy)


def main(target: str | None, batch: int) -> None:
    params, x = parameters(batch)
    small = parameters(8)
    for model in (scanned, unrolled):
        plain = residual.peak(jax.grad(model), params, x, target=target).memory
        exact = jax.jit(jax.grad(model))(*small)
        print(f"{model.__name__} Fourier operator, {LAYERS} layers, batch {batch}: plain "
              f"{plain.peak / 2**20:,.0f} MiB ({plain.beyond / 2**20:,.0f} beyond)")
        for label, policy in [("int8", rp.Quantize(bits=8)), ("int4", rp.Quantize(bits=4)),
                              ("bf16", rp.Cast(jnp.bfloat16))]:
            cells = []
            for policy_ in (policy, complex_kept(policy)):
                hooked = residual.with_hooks(model, policy=policy_)
                memory = residual.peak(jax.grad(hooked), params, x, target=target).memory
                error = relative_error(jax.jit(jax.grad(hooked))(*small), exact)
                cells.append(f"{memory.peak / plain.peak:.2f} / "
                             f"{memory.beyond / plain.beyond:.2f} (error {error:.1e})")
            print(f"  {label}: {cells[0]}; complex kept as they are {cells[1]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default=None,
                        help="compile for this hardware: v5e, v6e, h100, cpu (default: the "
                        "running backend)")
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    main(args.target, args.batch)
