"""``kvbridge.worker.launch.tail_lines``: a process log's last lines, read from its end."""

from __future__ import annotations

import pytest

from kvbridge.worker.launch import tail_lines


def test_a_process_logs_tail_reads_only_the_files_end(tmp_path):
    """``tail_lines`` (a Proc's ``log_tail``, the peer benches' child errors) reads the last lines from
    the file's last bytes only: a line cut by that window is dropped, a missing file raises OSError."""
    log = tmp_path / "w.log"
    log.write_text("".join(f"line {i:05d}\n" for i in range(100_000)))  # 1.1 MB, 11 bytes a line
    assert tail_lines(log, 2) == ["line 99998", "line 99999"]
    assert tail_lines(log, 10**6, max_bytes=25) == ["line 99998", "line 99999"]  # "97" of line 99997: dropped
    assert tail_lines(log, 0) == []
    with pytest.raises(OSError):
        tail_lines(tmp_path / "missing.log", 5)
