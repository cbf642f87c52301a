"""Which SGLang is installed, and which versions the backend is written for.

Its own module so that the classes SGLang instantiates (``manager.py``) can name the
version in their contract without importing ``patches.py``, which imports them
(lazily) when SGLang asks ``get_kv_class`` for them: imports point one way,
``patches -> backend -> manager -> version``.
"""

from __future__ import annotations

SUPPORTED_VERSIONS = ("0.5.23",)


def sglang_version() -> str:
    """The installed SGLang's version ('' when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return ""
