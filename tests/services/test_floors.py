"""The packages' floors: each imports only packages below it, and the two model services never know each other."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# package -> the packages it may import (every import at any depth, typing-only ones too)
FLOORS: dict[str, set[str]] = {
    "protos": set(),
    "kernels": set(),
    "runtime": {"protos"},
    "draft_server": {"protos", "kernels", "runtime"},
    "verify_server": {"protos", "kernels", "runtime"},
    "gateway": {"protos", "runtime"},
    "training": {"protos", "kernels", "runtime", "draft_server"},
    "ddtree": {"protos", "kernels", "runtime", "draft_server", "verify_server", "gateway", "training"},
}


def imported_packages(package: str) -> dict[str, set[str]]:
    """project package -> the modules of `package` that import it."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        if "_pb2" in path.name:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in FLOORS and top != package:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_package_has_a_floor():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"}
    assert packages == set(FLOORS)


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_imports_only_lower_floors(package: str):
    above = {top: files for top, files in imported_packages(package).items() if top not in FLOORS[package]}
    assert not above, f"{package} imports packages on its floor or above: {above}"


@pytest.mark.parametrize(
    "module, foreign",
    [
        ("verify_server.server", ("draft_server", "gateway", "training", "ddtree", "matplotlib")),
        ("draft_server.server", ("verify_server", "gateway", "training", "ddtree", "matplotlib")),
        ("gateway.cli", ("verify_server", "draft_server", "kernels", "training", "ddtree", "matplotlib")),
    ],
)
def test_a_service_loads_none_of_the_others(module: str, foreign: tuple[str, ...]):
    """What a service's process actually imports, lazy imports at start-up included."""
    code = (f"import sys, {module}; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({foreign!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"{module} pulls in {out.strip()}"
