"""Every file docs/ARCHITECTURE.md names exists (its walk once named modules long gone).

Two ways a path is named there:
- the module map, a fenced block whose first line is ``kvbridge/``: entries indented two
  spaces per level (``name/`` a folder, ``name.py`` a module; ``a.py, b/`` several), each
  resolved under the folders above it; deeper lines are the description's continuation;
- anywhere else, a word ending in ``.py`` (``decode/machine.py``, ``rooms.py``): it must be a
  module of the repository, matched by its trailing path (``decode/machine.py`` matches
  ``kvbridge/transfer/decode/machine.py``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
ENTRY = re.compile(r"^(\s*)([\w.]+/|[\w.]+\.py)((?:,\s*[\w.]+/?|,\s*[\w.]+\.py)*)(\s|$)")
MODULE = re.compile(r"(?<![\w/.])((?:[\w.-]+/)*[\w-]+\.py)\b")


def tree_paths(text: str) -> list[str]:
    """The module map's entries as paths from the repository root."""
    out: list[str] = []
    for block in re.findall(r"```\n(kvbridge/\n.*?)```", text, flags=re.S):
        stack: list[tuple[int, str]] = [(-2, "kvbridge")]  # (indent, folder)
        last_indent = 0
        for line in block.splitlines()[1:]:
            m = ENTRY.match(line)
            indent = len(line) - len(line.lstrip())
            if m is None or indent > last_indent + 2 or indent % 2:
                continue  # a description's continuation
            last_indent = indent
            while stack[-1][0] >= indent:
                stack.pop()
            names = [m.group(2), *(n.strip() for n in m.group(3).split(",") if n.strip())]
            parent = "/".join(s for _, s in stack)
            for name in names:
                out.append(f"{parent}/{name}".rstrip("/"))
            if m.group(2).endswith("/"):
                stack.append((indent, m.group(2).rstrip("/")))
    return out


def named_modules(text: str) -> set[str]:
    return set(MODULE.findall(text))


def repo_modules() -> list[str]:
    """Every .py file of the checkout; hidden folders (.git, the .venv* of each suite: a walk into
    the engines' venvs took 14 s) and node_modules are never entered."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "node_modules"]
        out += [(Path(folder) / f).relative_to(ROOT).as_posix() for f in files if f.endswith(".py")]
    return out


def test_every_entry_of_the_module_map_exists() -> None:
    paths = tree_paths(DOC.read_text(encoding="utf-8"))
    assert len(paths) > 50, "the module map was not found (its fence starts with a line 'kvbridge/')"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/ARCHITECTURE.md's module map names paths that do not exist: {missing}"


def test_every_module_named_in_the_text_exists() -> None:
    modules = repo_modules()
    named = named_modules(DOC.read_text(encoding="utf-8"))
    missing = sorted(n for n in named if not any(m == n or m.endswith("/" + n) for m in modules))
    assert not missing, f"docs/ARCHITECTURE.md names modules that do not exist: {missing}"


def test_the_checks_see_a_wrong_name() -> None:
    text = "```\nkvbridge/\n  transfer/\n    gone.py      no more\n    rooms.py\n```\nsee `channel_client.py`\n"
    assert tree_paths(text) == ["kvbridge/transfer", "kvbridge/transfer/gone.py", "kvbridge/transfer/rooms.py"]
    assert named_modules(text) >= {"channel_client.py", "gone.py"}
