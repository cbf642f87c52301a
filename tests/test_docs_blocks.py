"""Every code block of README.md and docs/*.md that claims to be runnable runs as written.

A block claims it with an HTML comment on the line just above its fence (invisible once
rendered):

    <!-- runnable -->             the block runs alone, in a fresh process, within 120 s
    <!-- runnable timeout=300 --> the same, within 300 s

``python`` blocks run with this interpreter, ``sh``/``bash``/``shell`` blocks with
``bash -euo pipefail`` (the venv's ``bin`` first on ``PATH``, so ``kvbridge`` is this tree's);
each in a scratch directory, with this tree first on ``PYTHONPATH``, in a session of its own
that is killed when the block ends or times out, so nothing it started outlives it. Blocks
without the marker are never run. Files are found when the tests are collected: a new page
under docs/ is covered without touching this file.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!--\s*runnable(?:\s+timeout=(\d+))?\s*-->\s*$")
FENCE = re.compile(r"^```(\S*)")
LANGUAGES = {"python": "python", "py": "python", "sh": "sh", "bash": "sh", "shell": "sh"}
DEFAULT_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    timeout: int

    @property
    def name(self) -> str:
        shown = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{shown}:{self.line}"


class MarkerError(ValueError):
    pass


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def runnable_blocks(path: Path) -> list[Block]:
    """The marked blocks of one file; MarkerError for a marker not followed by a fence of a
    language we run, or a fence never closed."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    for i, line in enumerate(lines):
        m = MARKER.match(line.strip())
        if m is None:
            continue
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        where = f"{path.relative_to(ROOT)}:{i + 1}"
        if fence is None:
            raise MarkerError(f"{where}: a runnable marker must be followed by a fenced block on the next line")
        language = LANGUAGES.get(fence.group(1).lower())
        if language is None:
            raise MarkerError(f"{where}: cannot run a block of language {fence.group(1)!r} "
                              f"(runnable: {', '.join(sorted(LANGUAGES))})")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise MarkerError(f"{where}: the block's fence is never closed")
        blocks.append(Block(path, i + 2, language, "\n".join(lines[i + 2 : end]) + "\n",
                            int(m.group(1) or DEFAULT_TIMEOUT_S)))
    return blocks


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in runnable_blocks(p)]


def run_block(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    script = cwd / ("block.py" if block.language == "python" else "block.sh")
    script.write_text(block.code, encoding="utf-8")
    argv = [sys.executable, str(script)] if block.language == "python" else ["bash", "-euo", "pipefail", str(script)]
    log = cwd / "output.txt"  # a file, not a pipe: a background process keeping it open cannot hold us up
    with log.open("w") as sink:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=block.timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            pytest.fail(f"{block.name}: still running after {block.timeout} s; output:\n{log.read_text()[-4000:]}")
        finally:
            _kill_session(proc)  # whatever the block left running in the background ends with it
    out = log.read_text()
    return subprocess.CompletedProcess(argv, proc.returncode, out, None)


def _kill_session(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue


BLOCKS = all_blocks()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_runnable_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    done = run_block(block, tmp_path)
    assert done.returncode == 0, f"{block.name} exited {done.returncode}:\n{done.stdout[-4000:]}"


def test_the_quick_start_is_among_the_runnable_blocks() -> None:
    """The README's library quick start claims to run as written: it must be collected (a
    marker that stopped matching would otherwise run nothing and pass)."""
    readme = [b for b in BLOCKS if b.path.name == "README.md" and b.language == "python"]
    assert any("kvb.PrefillEndpoint(" in b.code and "receiver.wait(" in b.code for b in readme)


def test_markers_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("<!-- runnable timeout=7 -->\n```sh\necho hi\n```\n\n```python\nraise SystemExit(1)\n```\n")
    (block,) = runnable_blocks(page)  # the unmarked block is not collected
    assert (block.language, block.timeout, block.code, block.line) == ("sh", 7, "echo hi\n", 2)
    page.write_text("<!-- runnable -->\ntext\n```sh\necho hi\n```\n")
    with pytest.raises(MarkerError, match="followed by a fenced block"):
        runnable_blocks(page)
    page.write_text("<!-- runnable -->\n```rust\nfn main() {}\n```\n")
    with pytest.raises(MarkerError, match="language 'rust'"):
        runnable_blocks(page)
    page.write_text("<!-- runnable -->\n```python\nprint(1)\n")
    with pytest.raises(MarkerError, match="never closed"):
        runnable_blocks(page)


def test_a_failing_block_fails_and_what_it_started_is_stopped(tmp_path: Path) -> None:
    pidfile = tmp_path / "bg.pid"
    block = Block(tmp_path / "page.md", 1, "sh", f"sleep 300 &\necho $! > {pidfile}\nexit 3\n", 30)
    done = run_block(block, tmp_path)
    assert done.returncode == 3
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):  # the background sleep was killed with the block's session
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.1)
