"""Every module-level import of the service's packages comes from a declared dependency of pyproject.toml.

`make run` installs only [project].dependencies, while the tests run with every extra installed, so a module that
imports a test-only library passes every test and fails at start-up (the front processes once imported httpx,
which only the test and bench extras named). Imports inside functions, `try: ... except ImportError` blocks and
`if TYPE_CHECKING:` are optional (the GPU libraries, Ray) and are not checked here.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("service", "indexes", "spatial", "olap")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[;\s]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _module_level_imports(tree: ast.Module) -> set[str]:
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_every_module_level_import_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    providers = packages_distributions()
    own = set(PACKAGES) | {"loadtests"}
    missing = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for module in _module_level_imports(ast.parse(path.read_text())):
                if module in sys.stdlib_module_names or module in own or module == "__future__":
                    continue
                dists = {_name(d) for d in providers.get(module, [module])}
                if not dists & declared:
                    missing.setdefault(module, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"imported at module level but not in [project].dependencies: {missing}"


def test_the_check_sees_a_missing_dependency():
    tree = ast.parse("import os\nimport httpx\nfrom numpy import array\ntry:\n    import cupy\nexcept ImportError:\n"
                     "    cupy = None\ndef f():\n    import ray\n")
    assert _module_level_imports(tree) == {"os", "httpx", "numpy"}
