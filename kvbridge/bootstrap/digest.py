"""Source digest: a hash over the runtime source files that define what the
bytes mean (the "source" section of the runtime contract).

kvbridge always declares its own geometry and wire modules; an engine adds the
files that decide its own page layout (its KV pool, its attention backend glue):

    kvbridge/layout/*.py, kvbridge/transfer/channel/{wire,envelope}.py   always
    + files the engine declares                            source_digest(extra=...)

Each file is named by a *stable* name (never an absolute path, which differs
between machines) and hashed with SHA-256 over its raw bytes. A declared file
that does not exist is kept, with the hash ``"missing"``, so that one side
missing a file still changes the digest. The digest is SHA-256 over the sorted
lines ``name NUL hash LF``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Union

from kvbridge.errors import ContractError

MISSING = "missing"

# The package's parent directory: names are relative to it ("kvbridge/layout/pools.py").
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent

StrPath = Union[str, "os.PathLike[str]"]
ExtraFiles = Union[Mapping[str, StrPath], Iterable[StrPath]]


def kvbridge_source_files() -> dict[str, Path]:
    """kvbridge's own byte-meaning modules, resolved from the installed package:
    every ``kvbridge/layout/*.py`` that exists now, and the control codec (``kvbridge/transfer/channel/``
    ``wire.py`` and ``envelope.py``, declared even when missing)."""
    files = {f"kvbridge/layout/{p.name}": p for p in sorted((_PACKAGE_ROOT / "kvbridge" / "layout").glob("*.py"))}
    for name in ("wire.py", "envelope.py"):
        files[f"kvbridge/transfer/channel/{name}"] = _PACKAGE_ROOT / "kvbridge" / "transfer" / "channel" / name
    return files


def _declared(extra: ExtraFiles | None) -> dict[str, Path]:
    """Engine-declared files as ``{stable name: path}``. A mapping gives the names;
    a plain list uses each path as written (so declare relative paths)."""
    if extra is None:
        return {}
    if isinstance(extra, Mapping):
        items = [(str(name), Path(path)) for name, path in extra.items()]
    else:
        items = [(Path(path).as_posix(), Path(path)) for path in extra]
    out: dict[str, Path] = {}
    for name, path in items:
        if not name or name.startswith("/"):
            raise ContractError(
                f"declared source file name {name!r} must be a non-empty relative name "
                "(absolute paths differ between machines); pass {name: path}",
                field="source.files",
            )
        out[name] = path
    return out


def file_hash(path: Path) -> str:
    """SHA-256 hex of a file's bytes, or ``"missing"`` when it does not exist."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return MISSING
    except IsADirectoryError as exc:
        raise ContractError(f"declared source file {str(path)!r} is a directory", field="source.files") from exc
    return hashlib.sha256(data).hexdigest()


def combine(files: Mapping[str, str]) -> str:
    """The digest over ``{name: file hash}``: SHA-256 of sorted ``name\\0hash\\n`` lines."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode("utf-8") + b"\0" + files[name].encode("ascii") + b"\n")
    return h.hexdigest()


def source_files(extra: ExtraFiles | None = None) -> dict[str, str]:
    """``{name: sha256 hex | "missing"}`` over kvbridge's files plus ``extra``."""
    declared = kvbridge_source_files()
    for name, path in _declared(extra).items():
        if name in declared:
            raise ContractError(f"declared source file {name!r} is already one of kvbridge's own", field="source.files")
        declared[name] = path
    return {name: file_hash(path) for name, path in sorted(declared.items())}
