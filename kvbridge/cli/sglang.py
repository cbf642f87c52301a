"""``kvbridge sglang -- <SGLang server args>``: SGLang's server with kvbridge
registered as its PD transfer backend ``kvbridge``."""

from __future__ import annotations

import argparse
import importlib.util
import textwrap

from kvbridge.errors import ConfigError

SUPPORTED = "0.5.23"  # kvbridge.integrations.sglang.SUPPORTED_VERSIONS, without importing it
INSTALL_HINT = (
    f"SGLang {SUPPORTED} must be installed in this Python environment: pip install 'sglang=={SUPPORTED}' "
    "(with its GPU kernels, on a CUDA host), or pip install 'kvbridge[gpu,sglang]'. "
    "kvbridge's tests use a CPU-only environment instead: make setup-sglang"
)


def _environment() -> str:
    from kvbridge.integrations.sglang.settings import ENVIRONMENT  # pure: does not import SGLang

    width = max(len(name) for name, _ in ENVIRONMENT)
    lines = []
    for name, what in ENVIRONMENT:
        wrapped = textwrap.wrap(what, 96 - width - 4)
        lines += [f"  {name:<{width}}  {wrapped[0]}", *(f"  {'':<{width}}  {w}" for w in wrapped[1:])]
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sglang",
        help="run SGLang's server with kvbridge as its PD transfer backend",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Register kvbridge as SGLang's transfer backend 'kvbridge', then run SGLang's server in this process\n"
            "with the arguments after '--' (the same as `sglang serve`). Select the backend there, on the\n"
            "prefill and on the decode server:\n\n"
            "  kvbridge sglang -- --model-path deepseek-ai/DeepSeek-V3.2 --disaggregation-mode prefill \\\n"
            "      --disaggregation-transfer-backend kvbridge --disaggregation-bootstrap-port 8998 ...\n\n"
            "A prefill server starts a kvbridge bootstrap daemon on its bootstrap port (or every server uses\n"
            "one cluster daemon: KVBRIDGE_BOOTSTRAP_URL). `sglang serve` works as well where kvbridge is\n"
            "installed: its plugin loader registers the backend in every SGLang process.\n\n"
            f"Supported SGLang: {SUPPORTED}. `kvbridge sglang -- --help` prints SGLang's own options.\n\n"
            f"environment:\n{_environment()}"
        ),
        epilog=INSTALL_HINT,
    )
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, metavar="-- SGLANG_ARGS",
                   help="arguments for SGLang's server, after '--'")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    argv = list(args.sglang_args)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError(f"SGLang is not installed. {INSTALL_HINT}", field="sglang")
    from kvbridge.integrations.sglang.launch import serve

    return serve(argv)
