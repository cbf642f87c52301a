"""``kvbridge sglang -- <SGLang server args>``: SGLang's server with kvbridge
registered as its PD transfer backend ``kvbridge``."""

from __future__ import annotations

import argparse
import importlib.util

from kvbridge.errors import ConfigError

SUPPORTED = "0.5.23"  # kvbridge.integrations.sglang.SUPPORTED_VERSIONS, without importing it
INSTALL_HINT = (
    f"SGLang {SUPPORTED} must be installed in this Python environment: pip install 'sglang=={SUPPORTED}' "
    "(with its GPU kernels, on a CUDA host), or pip install 'kvbridge[gpu,sglang]'. "
    "kvbridge's tests use a CPU-only environment instead: make setup-sglang"
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sglang",
        help="run SGLang's server with kvbridge as its PD transfer backend",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Register kvbridge as SGLang's transfer backend 'kvbridge', then run SGLang's server in this process\n"
            "with the arguments after '--' (the same as `sglang serve`). Select the backend there:\n\n"
            "  kvbridge sglang -- --model-path deepseek-ai/DeepSeek-V3.2 --disaggregation-mode prefill \\\n"
            "      --disaggregation-transfer-backend kvbridge ...\n\n"
            f"Supported SGLang: {SUPPORTED}. `kvbridge sglang -- --help` prints SGLang's own options."
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
