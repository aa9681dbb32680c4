"""The documentation: every public name is in the API pages, and the site builds."""

from __future__ import annotations

import re
import types
from pathlib import Path

import residual
from residual import policies

DOCS = Path(__file__).parents[2] / "docs"


def _public(module) -> set[str]:
    return {
        f"{module.__name__}.{name}"
        for name in dir(module)
        if not name.startswith("_") and not isinstance(getattr(module, name), types.ModuleType)
    }


def test_every_public_name_is_in_the_api_pages():
    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.M))
    missing = (_public(residual) | _public(policies)) - documented
    assert not missing, f"public names missing from docs/api/*.md: {sorted(missing)}"


def test_every_api_directive_names_something_real():
    for page in (DOCS / "api").glob("*.md"):
        for name in re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.M):
            module, _, attr = name.rpartition(".")
            target = residual if module == "residual" else policies
            assert hasattr(target, attr), f"{page.name}: {name} does not exist"
