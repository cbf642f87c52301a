"""G7: with ``--tokenizer-worker-num > 1`` SGLang's HTTP server starts worker processes that
import the app named by ``SGLANG_HTTP_SERVER_APP_PATH`` and never run the plugin loader; each
builds a ``TokenizerWorker``, which calls ``TransferBackend(--disaggregation-transfer-backend)``.
``install()`` in the launching process points that variable at kvbridge's app, so the name
resolves there too. Each side is a process of its own, as SGLang's are.

SGLang's HTTP server module itself (``sglang.srt.entrypoints.http_server``) does not import in
the CPU test venv (it needs uvloop, xgrammar and audio libraries of a GPU install): the worker
finds a stand-in module with an ``app`` under its name. Everything else is SGLang's own: its
environment variable, uvicorn's importer, ``TransferBackend``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("sglang.srt.disaggregation.utils", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

# What a worker process does before and while it builds its TokenizerWorker (SGLang 0.5.23:
# uvicorn/Granian import the app path; init_multi_tokenizer -> TokenizerWorker.__init__ ->
# TransferBackend(get_disagg().disaggregation_transfer_backend)).
WORKER = textwrap.dedent("""
    import sys, types
    stand_in = types.ModuleType("sglang.srt.entrypoints.http_server")
    stand_in.app = object()
    sys.modules[stand_in.__name__] = stand_in
    from uvicorn.importer import import_from_string
    from sglang.srt.environ import envs
    path = envs.SGLANG_HTTP_SERVER_APP_PATH.get()
    app = import_from_string(path)
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.entrypoints.http_server import app as sglang_app
    try:
        member = TransferBackend("kvbridge").name
    except ValueError as exc:
        member = f"ValueError: {exc}"
    print(path); print(app is sglang_app); print(member)
""")


def _run(code: str, env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def _env(**kw: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_HTTP_SERVER_APP_PATH"}
    return {**env, **kw}


def test_a_tokenizer_worker_process_resolves_the_backend():
    # the launching process: SGLang's plugin loader runs kvbridge's plugin()
    launcher = _run("import os; from sglang.srt.plugins import load_plugins; load_plugins(); "
                    "print(os.environ['SGLANG_HTTP_SERVER_APP_PATH'])", _env())
    assert launcher == ["kvbridge.integrations.sglang.http_app:app"]
    # a worker process it starts inherits the environment and runs no plugin loader
    got = _run(WORKER, _env(SGLANG_HTTP_SERVER_APP_PATH=launcher[0]))
    assert got == ["kvbridge.integrations.sglang.http_app:app", "True", "KVBRIDGE"]


def test_without_it_the_worker_fails_as_the_issue_says():
    got = _run(WORKER, _env())
    assert got[0] == "sglang.srt.entrypoints.http_server:app" and got[1] == "True"
    assert got[2].startswith("ValueError: 'kvbridge' is not a valid TransferBackend")


def test_another_app_path_is_kept_with_a_warning():
    code = ("import logging, os; logging.basicConfig(level=logging.WARNING)\n"
            "from kvbridge.integrations.sglang import install; install()\n"
            "print(os.environ['SGLANG_HTTP_SERVER_APP_PATH'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=_env(SGLANG_HTTP_SERVER_APP_PATH="myco.app:app"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["myco.app:app"]
    assert "myco.app:app: with --tokenizer-worker-num > 1 that app's worker processes must call" in out.stderr
