"""``scripts/_child.py``, the peer benches' child processes: a child that does not answer in time,
or exits, raises with the tail of its log in the message (the log lies in a pytest temp folder,
which CI does not keep), read while the child may still be writing it. Real child processes here
(``python -c``), each stopped by its test."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from _timing import scaled

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

# a child as the benches run one: its config the last argument, log lines on stderr, a ready line on stdout,
# then one command a line on stdin until "quit" (what Child.stop() sends); with "exit" in its config it
# exits with that status instead of answering
CHILD = """
import json, sys, time
cfg = json.loads(sys.argv[-1])
for i in range(cfg["lines"]):
    print(f"log line {i}", file=sys.stderr, flush=True)
if "exit" in cfg:
    sys.exit(cfg["exit"])
if cfg.get("stray"):
    print("{not an answer", flush=True)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    if json.loads(line).get("op") == "quit":
        break
"""


@pytest.fixture()
def child_mod(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # as the benches import it: their sibling
    import _child

    return _child


@pytest.fixture()
def start(child_mod, tmp_path):
    started = []

    def start(name: str, **cfg: object):
        c = child_mod.Child([sys.executable, "-c", CHILD], cfg, tmp_path / f"{name}.log", {}, name)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()
        assert c.proc.poll() is not None and c.log.closed


def test_a_timeout_names_the_child_and_carries_its_logs_last_40_lines(start, tmp_path):
    c = start("nixl kv_consumer", lines=50)
    assert c.next(scaled(60)) == {"ready": True}  # its log lines are written by now
    with pytest.raises(TimeoutError) as err:
        c.next(1)
    msg = str(err.value)
    head, *tail = msg.splitlines()
    log = tmp_path / "nixl kv_consumer.log"
    assert head == f"no answer from nixl kv_consumer (pid {c.proc.pid}) within 1s; last 40 lines of {log}:"
    assert tail == [f"    log line {i}" for i in range(10, 50)]
    assert c.proc.poll() is None  # still running: the fixture's stop() ends it through "quit"


def test_an_exit_carries_the_status_and_the_whole_short_log(start, tmp_path):
    c = start("decode child", lines=3, exit=3)
    with pytest.raises(RuntimeError) as err:
        c.next(scaled(60))
    assert str(err.value).splitlines() == [
        f"decode child (pid {c.proc.pid}) exited with status 3; last 3 lines of {tmp_path}/decode child.log:",
        "    log line 0", "    log line 1", "    log line 2"]  # fmt: skip


def test_a_killed_child_is_named_by_its_signal_and_an_empty_log_said_so(start, tmp_path):
    c = start("prefill child", lines=0)
    assert c.next(scaled(60)) == {"ready": True}
    c.proc.send_signal(signal.SIGKILL)
    with pytest.raises(RuntimeError) as err:
        c.next(scaled(60))
    assert str(err.value) == (f"prefill child (pid {c.proc.pid}) exited: killed by SIGKILL; "
                              f"log {tmp_path}/prefill child.log is empty")  # fmt: skip


def test_a_stray_line_that_looks_like_an_answer_is_skipped_and_named_in_an_error(start, tmp_path):
    """A stdout line that begins like an answer but is not JSON neither kills the reader (the next
    answer still comes) nor passes unseen: a later error names it."""
    c = start("stray child", lines=1, stray=True)
    assert c.next(scaled(60)) == {"ready": True}
    with pytest.raises(TimeoutError) as err:
        c.next(1)
    assert str(err.value).endswith("; its stdout's last line that was not JSON: '{not an answer'")


def test_log_tail_of_a_missing_a_long_and_an_undecodable_log(child_mod, tmp_path):
    missing = tmp_path / "gone.log"
    assert child_mod.log_tail(missing).startswith(f"log {missing} unreadable: [Errno 2] No such file")
    log = tmp_path / "long.log"
    log.write_text("".join(f"line {i:05d}\n" for i in range(10000)))  # 110,000 bytes: past the window
    assert child_mod.log_tail(log, lines=3).splitlines()[1:] == ["    line 09997", "    line 09998", "    line 09999"]
    window = child_mod.log_tail(log, lines=10**6, max_bytes=100)  # starts mid-line: that part dropped
    assert window.splitlines()[1:] == [f"    line {i:05d}" for i in range(9991, 10000)]
    assert window.splitlines()[0] == f"last 9 lines of {log}:"
    log.write_bytes(b"ok\n\xff\xfe bytes\n")  # a child's stray bytes do not hide the rest
    assert child_mod.log_tail(log).splitlines()[1:] == ["    ok", "    \ufffd\ufffd bytes"]
