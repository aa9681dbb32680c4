"""`python -m residual`: its help, its commands, and its errors for bad arguments."""

from __future__ import annotations

import jax
import pytest

from residual.__main__ import main

from ..helpers import RUNNING_PLATFORM

_MODEL = '''
import jax
import jax.numpy as jnp


def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def classify(params, x, labels):
    logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(x.shape[0]), labels])


def classify_flat(w1, w2, x, labels):
    return classify({"w1": w1, "w2": w2}, x, labels)


def example_args():
    params = {"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32),
              "w2": jax.ShapeDtypeStruct((256, 10), jnp.float32)}
    return (params, jax.ShapeDtypeStruct((128, 64), jnp.float32),
            jax.ShapeDtypeStruct((128,), jnp.int32))


not_a_tuple = [1, 2]
'''


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    (tmp_path / "tinymodel.py").write_text(_MODEL)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _error(capsys, *argv: str) -> str:
    """The message of a command line that must fail as argparse does: status 2, no traceback."""
    with pytest.raises(SystemExit, match=r"^2$"):
        main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_help_describes_the_commands_with_examples(capsys):
    with pytest.raises(SystemExit, match=r"^0$"):
        main(["--help"])
    out = capsys.readouterr().out
    assert "demo" in out and "inspect" in out and "examples:" in out
    assert "--arg i32[256] --policy int8" in out and "--args mymodel:example_args" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_inspect_with_dtype_specs(model_dir, capsys):
    assert main(["inspect", "tinymodel:loss", "--arg", "f32[128,128]", "--arg", "256x128",
                 "--policy", "int8"]) == 0
    out = capsys.readouterr().out
    assert "under Quantize(bits=8)" in out and " packed " in out
    assert f"peak memory on {RUNNING_PLATFORM}" in out
    assert "f32[256,128]" in out and "tinymodel.py:7 (loss)" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_inspect_pytree_and_integer_arguments(model_dir, capsys):
    assert main(["inspect", "tinymodel:classify", "--args", "tinymodel:example_args",
                 "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "f32[128,256]" in out and "peak memory" not in out
    assert main(["inspect", "tinymodel:classify_flat", "--arg", "f32[64,256]", "--arg",
                 "f32[256,10]", "--arg", "f32[128,64]", "--arg", "i32[128]", "--no-compile"]) == 0
    assert "f32[128,256]" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "tinymodel", "--arg", "f32[4]"], r"expected MODULE:FUNCTION"),
        (["inspect", "nosuchmodule:loss", "--arg", "f32[4]"], r"cannot import 'nosuchmodule'"),
        (["inspect", "tinymodel:nope", "--arg", "f32[4]"], r"has no 'nope'"),
        (["inspect", "tinymodel:not_a_tuple", "--arg", "f32[4]"], r"must be a function"),
        (["inspect", "tinymodel:loss"], r"give the function's arguments"),
        (["inspect", "tinymodel:loss", "--arg", "f32(4)"], r"expected dtype\[shape\]"),
        (["inspect", "tinymodel:loss", "--arg", "q7[4]"], r"unknown dtype 'q7'"),
        (["inspect", "tinymodel:loss", "--args", "tinymodel:not_a_tuple"],
         r"must be a tuple of arguments"),
        (["inspect", "tinymodel:loss", "--args", "tinymodel:example_args", "--arg", "f32[4]"],
         r"either with --arg or with --args"),
        (["inspect", "tinymodel:loss", "--arg", "f32[4,8]", "--arg", "f32[3,3]"],
         r"tinymodel:loss\(float32\[4,8\], float32\[3,3\]\) failed: TypeError: .*"
         r"one argument per parameter"),
        (["inspect", "tinymodel:loss", "--arg", "f32[4]", "--policy", "int3"],
         r"invalid choice: 'int3'"),
        (["inspect", "tinymodel:loss", "--arg", "f32[4]", "--target", "v9"],
         r"--target v9: Unknown `target` 'v9'.*v5e:2x2"),
        (["demo", "--steps", "0"], r"expected a positive integer, got '0'"),
        (["frobnicate"], r"invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_end_in_a_clear_message(model_dir, capsys, argv, message):
    import re

    err = _error(capsys, *argv)
    assert re.search(message, err, flags=re.S), err


@pytest.mark.slow
def test_demo_runs_and_ends_on_its_summary(capsys):
    with jax.numpy_dtype_promotion("standard"):  # optax's losses mix dtypes
        assert main(["demo", "--steps", "3", "--width", "32", "--depth", "2",
                     "--batch", "64"]) == 0
    out = capsys.readouterr().out
    lines = out.rstrip().splitlines()
    assert max(len(line) for line in lines) <= 100
    assert lines[-4].lstrip().startswith("memory") and "x  compiled jit(grad)" in lines[-4]
    assert "beyond arguments and outputs" in lines[-3]
    assert lines[-2].lstrip().startswith("step time") and lines[-1].lstrip().startswith("loss")
    assert "gradcheck OK" in out
    # Each figure once: the compiled memory appears in the report and in the summary only.
    assert out.count("MiB against") == 1
