"""The integration kit's one rule, pinned for every ``kvbridge/integrations/<engine>/``: an
integration imports kvbridge's public API (``kvbridge``, names in ``kvbridge.__all__``) and its
own package, nothing deeper (kvbridge/integrations/README.md). Lazy imports inside functions,
relative imports and ``importlib.import_module("kvbridge...")`` literals count too. A folder
added later (the vLLM proxy moving under ``integrations/vllm/``, a third engine) is checked
without touching this test."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvbridge

ROOT = Path(kvbridge.__file__).parent / "integrations"
ENGINES = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def _module_of(path: Path, root: Path) -> str:
    """``kvbridge.integrations.<engine>.<...>`` of a file under ``root`` (an integrations folder)."""
    rel = path.relative_to(root.parent.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, path: Path, root: Path) -> str:
    """The module an ImportFrom names, relative ones resolved against ``path``'s package."""
    if not node.level:
        return node.module or ""
    package = _module_of(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]  # a module's package
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def kvbridge_imports(path: Path, root: Path = ROOT) -> list[tuple[int, str, str | None]]:
    """Every import of a kvbridge module in ``path``: (line, module, name imported from it or None)."""
    out: list[tuple[int, str, str | None]] = []
    tree = ast.parse(path.read_text(), str(path))
    aliases = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for a in node.names if a.name == "kvbridge"}  # ``import kvbridge as kvb``
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node, path, root)
            out.extend((node.lineno, module, a.name) for a in node.names)
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, None) for a in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in
              ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            out.append((node.lineno, node.args[0].value, None))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            out.append((node.lineno, "kvbridge", node.attr))  # ``import kvbridge [as kvb]`` then ``kvb.X``
    return sorted((line, module, name) for line, module, name in out if module.split(".")[0] == "kvbridge")


def violations(engine: str, root: Path = ROOT) -> list[str]:
    own = f"kvbridge.integrations.{engine}"
    bad = []
    for path in sorted((root / engine).rglob("*.py")):
        for line, module, name in kvbridge_imports(path, root):
            if module == own or module.startswith(own + "."):
                continue
            if module == "kvbridge" and (name is None or name in kvbridge.__all__):
                continue  # ``import kvbridge`` (its attributes are checked as names), or a public name
            what = f"from {module} import {name}" if name is not None else f"import {module}"
            bad.append(f"{path.relative_to(root.parent.parent)}:{line}: {what}")
    return bad


def test_every_engine_folder_is_found():
    assert {"sglang", "transformers", "vllm"} <= set(ENGINES)


@pytest.mark.parametrize("engine", ENGINES)
def test_an_integration_imports_only_the_public_api_and_itself(engine: str):
    assert violations(engine) == [], "\n".join(violations(engine))


def test_the_rule_catches_what_it_must(tmp_path: Path):
    """A test that cannot fail is a defect: each way round the rule is caught, each allowed form passes."""
    pkg = tmp_path / "kvbridge" / "integrations" / "demo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from kvbridge import ConfigError, create_engine\nfrom . import sub\n")
    (pkg / "sub" / "__init__.py").write_text("from .. import helpers\nfrom ..helpers import x\n")
    (pkg / "helpers.py").write_text(
        "import importlib\n"
        "import kvbridge\n"
        "import kvbridge as kvb\n"
        "def f():\n"
        "    kvbridge.create_engine('local')\n"
        "    kvbridge.transfer.engine.registry\n"  # an attribute that is no public name
        "    kvb.layout.staging\n"  # the same through an alias
        "    from kvbridge.transfer.engine import JobEngine\n"  # a lazy import of an internal module
        "    import kvbridge.layout\n"
        "    from kvbridge import errors\n"  # a submodule, not a public name
        "    from kvbridge.integrations.sglang import settings\n"  # another integration
        "    from .. import sglang\n"  # the same, relative
        "    return importlib.import_module('kvbridge.transfer.shell')\n")
    found = violations("demo", tmp_path / "kvbridge" / "integrations")
    assert [v.split(": ", 1)[1] for v in found] == [
        "from kvbridge import transfer", "from kvbridge import layout", "from kvbridge.transfer.engine import JobEngine", "import kvbridge.layout", "from kvbridge import errors",
        "from kvbridge.integrations.sglang import settings", "from kvbridge.integrations import sglang",
        "import kvbridge.transfer.shell",
    ], found
