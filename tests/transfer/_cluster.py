"""Test cluster pieces: prefill CP ranks as real processes (``_prefill_proc.py``)
and decode ranks as in-process DecodeEndpoints with poisoned pools."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint
from kvbridge.transfer.engine import create_engine
from kvbridge.transfer.poll import KVPoll
from kvbridge.worker.resources import allocate_buffers, aux_schema_of, build_contract, build_specs
from kvbridge.worker.synthetic import SENTINEL_BYTE, as_bytes, verify_aux, verify_pages

from _models import kv_fp32, kv_heads, region_tensors, token_major_buffers

HERE = Path(__file__).parent
FINAL = (KVPoll.Success, KVPoll.Failed)


class ChildProc:
    """A test's child process driven by JSON lines on stdin and stdout (a prefill rank's harness),
    whose first line says it is ready; always ``stop()`` it. Its stderr is kept in a file of its
    own and quoted by every error; a child that ends is reported at once (``EOFError``), with its
    exit status. ``name``: how errors name it."""

    def __init__(self, cmd: list[str], name: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, env=dict(env or os.environ, PYTHONUNBUFFERED="1"))
        self._lines: queue.Queue[dict | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            first = self._first_line()
        except (TimeoutError, EOFError):
            self.stop()
            raise
        if not first.get("ready"):
            self.stop()
            raise RuntimeError(f"{name} did not start: {first}")
        self.ready = first

    def _first_line(self, patience: float = 60.0) -> dict:
        """The child's first line. A start that has not answered in ``patience`` seconds (a host
        loaded by the suites that share it) has its stacks written to its stderr (SIGUSR1: the
        child registers faulthandler for it first) and gets as long again; the error then shows
        where it stood."""
        try:
            return self._next(patience)
        except TimeoutError:
            if self.proc.poll() is not None:
                raise
            self.proc.send_signal(signal.SIGUSR1)
            print(f"{self.name} silent for {patience:.0f}s; stacks written to its stderr", file=sys.stderr)
            return self._next(patience)

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self._lines.put(json.loads(line))
            except ValueError:
                pass
        self._lines.put(None)  # end of its output: the process closed stdout or died

    def stderr_tail(self, limit: int = 8000) -> str:
        """The last ``limit`` bytes the child wrote to stderr."""
        try:
            self._stderr.seek(0, os.SEEK_END)
            self._stderr.seek(max(0, self._stderr.tell() - limit))
            return self._stderr.read().decode("utf-8", errors="replace")
        except (OSError, ValueError):
            return ""

    def _next(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no line from {self.name} (pid {self.proc.pid}) within {timeout:.0f}s, "
                               f"{self._status()}; its stderr ends:\n{self.stderr_tail()}") from None
        if line is None:
            self._lines.put(None)  # every later read sees the end too
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            raise EOFError(f"{self.name} closed its output, {self._status()}; its stderr ends:\n{self.stderr_tail()}")
        return line

    def _status(self) -> str:
        rc = self.proc.poll()
        return "still running" if rc is None else f"exited with {rc}"

    def command(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.command(op="quit")
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()
        self._stderr.close()
        try:  # a command buffered for a process that died is not flushed: closing says so
            self.proc.stdin.close() if not self.proc.stdin.closed else None
        except BrokenPipeError:
            pass


class PrefillProc(ChildProc):
    """One prefill CP rank in a child process (``_prefill_proc.py``); always ``stop()`` it."""

    def __init__(self, bootstrap: str, cp_rank: int, cp_size: int, *extra: str, instance: str = "prefill",
                 layers: int = 2, page_size: int = 4, engine: str = "mooncake", tp_rank: int = 0,
                 tp_size: int = 1, device: str = "cpu", pp_rank: int = 0, pp_size: int = 1,
                 pp_layers: tuple[int, int] | None = None) -> None:
        if pp_layers is not None:
            extra = (*extra, "--pp-rank", str(pp_rank), "--pp-size", str(pp_size), "--pp-layers",
                     f"{pp_layers[0]},{pp_layers[1]}")
        cmd = [sys.executable, str(HERE / "_prefill_proc.py"), "--bootstrap", bootstrap, "--instance", instance,
               "--cp-rank", str(cp_rank), "--cp-size", str(cp_size), "--tp-rank", str(tp_rank),
               "--tp-size", str(tp_size), "--layers", str(layers),
               "--page-size", str(page_size), "--engine", engine, "--device", device, *extra]
        self.engine, self.instance = engine, instance
        self.results: dict[int, dict] = {}
        super().__init__(cmd, f"prefill process {instance}/cp{cp_rank}")
        self.endpoint = self.ready["endpoint"]

    def send(self, room: int, num_tokens: int, chunks: list[int] | None = None, pause: float = 0.0,
             **extra: Any) -> None:
        self.command(op="send", room=room, num_tokens=num_tokens, chunks=chunks or [num_tokens], pause=pause, **extra)

    def result(self, room: int, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while room not in self.results:
            line = self._next(max(0.01, deadline - time.monotonic()))
            if "room" in line:
                self.results[line["room"]] = line
        return self.results[room]


class DecodeRank:
    """A decode rank in this process, pools filled with SENTINEL_BYTE (poison); ``device`` puts
    the pools on a GPU (preset and kv-heads models; the aux rows stay in host memory), checked
    through host copies (``host_buffers``)."""

    def __init__(self, bootstrap: str, *, tp_rank: int = 0, tp_size: int = 1, layers: int = 2, page_size: int = 4,
                 pages: int = 512, engine: str = "mooncake", instance: str = "decode", aux_rows: int = 64,
                 model: str = "", device: str = "cpu", raw_buffers: bool = False, **cfg: Any) -> None:
        if device != "cpu" and model == "kv-fp32":
            raise ValueError("the kv-fp32 test model keeps its pools in host memory")
        if model == "kv-fp32":  # public API only; aux rows in one tensor per region
            self.specs, self.contract, self.aux_schema = kv_fp32(layers, page_size)
            self.buffers = token_major_buffers(self.specs, pages)
            self.aux: Any = region_tensors(self.aux_schema, aux_rows)
        elif model == "kv-heads":  # head-sharded k/v: this decode TP rank's heads
            self.specs, self.contract, self.aux_schema = kv_heads(layers, page_size, tp_size, tp_rank)
            self.buffers = allocate_buffers(self.specs, pages, device=device)
            self.aux = torch.zeros((aux_rows, self.aux_schema.row_bytes), dtype=torch.uint8)
        else:
            self.specs = build_specs("deepseek-v3.2-fp8", layers, page_size, 1)
            self.contract = build_contract("deepseek-v3.2-fp8", layers, page_size, 1, "interleaved")
            self.aux_schema = aux_schema_of(self.contract)
            self.buffers = allocate_buffers(self.specs, pages, device=device)
            self.aux = torch.zeros((aux_rows, self.aux_schema.row_bytes), dtype=torch.uint8)
        self.bytes_per_page = {key: self.specs[key[0]].bytes_per_page for key in self.buffers}
        self.device = device
        for key, buf in self.buffers.items():
            if device == "cpu":
                as_bytes(buf, self.bytes_per_page[key])[:] = SENTINEL_BYTE
            else:
                buf.view(torch.uint8).fill_(SENTINEL_BYTE)
        if device != "cpu":
            torch.cuda.synchronize(device)
        cfg.setdefault("peer_timeout", 2.0)
        cfg.setdefault("ping_interval", 0.2)
        cfg.setdefault("transfer_timeout", 60.0)
        config = DecodeConfig(instance=instance, tp_rank=tp_rank, tp_size=tp_size, lease_ttl=2.0, **cfg)
        self.client = BootstrapClient(bootstrap)
        handed = self.buffers
        if raw_buffers:  # addresses only, as the SGLang backend hands them (the tensors stay alive here)
            from kvbridge.layout import RawBuffer
            from kvbridge.transfer.engine import tensor_region

            handed = {k: RawBuffer(*tensor_region(b), device=str(getattr(b, "device", "cpu")))
                      for k, b in self.buffers.items()}
        self.engine = create_engine(engine)
        self.ep = DecodeEndpoint(config, self.engine, self.specs, handed, self.contract, self.client,
                                 self.aux, self.aux_schema)
        self.ep.start()
        self.page_size = page_size
        self.pages = pages
        self._next_slot = 0

    def receive(self, room: int, num_tokens: int, page_ids: np.ndarray, prefill: str = "prefill", first_page: int = 0):
        slot = self._next_slot
        self._next_slot = (self._next_slot + 1) % self.ep.aux.capacity_rows
        r = self.ep.receiver(room, prefill)
        r.init(page_ids, slot, num_tokens, first_page=first_page)
        r.page_ids, r.num_tokens, r.first_page = page_ids, num_tokens, first_page  # for verify()
        return r

    def verify(self, r) -> list[str]:
        """Every byte of every pool and layer of the room (from its first page on), plus the aux row."""
        errors = []
        for (pool, layer), buf in self.host_buffers().items():
            v = verify_pages(self.specs[pool], buf, r.room, layer, r.page_ids, r.num_tokens, first_page=r.first_page)
            if not v.ok:
                errors.append(v.first_error)
        err = verify_aux(self.aux_schema, r.aux_regions, r.room, r.num_tokens)
        if err:
            errors.append(err)
        return errors

    def untouched_except(self, page_ids: np.ndarray) -> bool:
        """No byte outside ``page_ids`` changed (no stray write)."""
        mask = np.ones(self.pages, dtype=bool)
        mask[np.asarray(page_ids, dtype=np.int64)] = False
        return all(bool((as_bytes(b, self.bytes_per_page[k])[mask] == SENTINEL_BYTE).all())
                   for k, b in self.host_buffers().items())

    def host_buffers(self) -> dict:
        """The pools as host memory: the buffers themselves, or copies of GPU pools (taken now)."""
        if self.device == "cpu":
            return self.buffers
        torch.cuda.synchronize(self.device)
        return {k: b.cpu() for k, b in self.buffers.items()}

    def close(self) -> None:
        self.ep.close(timeout=3)
        self.client.close()
        self.engine.close()


def wait_final(receivers, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    pending = list(receivers)
    while pending and time.monotonic() < deadline:
        pending = [r for r in pending if r.poll() not in FINAL]
        time.sleep(0.005)
    if pending:
        raise TimeoutError(f"rooms {[r.room for r in pending]} not final after {timeout}s")


def wait_until(pred, timeout: float = 30, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()
