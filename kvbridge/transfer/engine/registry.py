"""The engine registry: every transfer engine kvbridge knows, written once.

``ENGINES`` below: name -> how it is built (a factory imported only then), what kind of engine
it is, its transport label, whether it is direct only, the staging thresholds measured for it
(per transport where one was measured apart: Mooncake's TCP), a one-line description (the
workers' ``--engine`` help quotes it).

Everything else asks this table: :func:`~kvbridge.transfer.engine.create_engine` builds from
it, ``ENGINE_KINDS`` and every ``--engine`` choice, ``KVBRIDGE_ENGINE`` and the integrations'
settings are its names (:func:`engine_names`), the runtime contract's ``transport`` is the
entry's label (each engine class declares the same: ``TransferEngine.transport`` is
abstract, and a test pins that the two agree), and a prefill rank's staged-or-direct choice
takes the thresholds of the route's entry and transport (:func:`staging_thresholds`; the route
is what the engine's ``route(session)`` says, ``mooncake/tcp``, else its name;
``layout.choose_path`` receives them as data). Nobody matches a class name.

Adding an engine: one entry here, its adapter (a ``TransferEngine``, usually a
``JobEngine``: ``kvbridge.transfer.engine.jobs``) and its tests (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from kvbridge.errors import ConfigError
from kvbridge.layout.staging import PathThresholds

if TYPE_CHECKING:
    from kvbridge.transfer.engine.base import TransferEngine

__all__ = [
    "ENGINES",
    "EngineEntry",
    "KINDS",
    "engine_entry",
    "engine_names",
    "entry_of",
    "route_key",
    "staging_thresholds",
]

# what an engine is, as the rest of the code asks: "network" engines reach any host (Mooncake,
# NIXL); "same-host" only peers on this host (CUDA IPC); "composite" picks one of those per peer;
# "in-process" moves bytes inside one process (tests, fault injection, the demo's threads)
KINDS = ("network", "same-host", "composite", "in-process")

# ---- staging thresholds, measured per engine and transport (docs/staging.md, docs/engines.md) -------
# An engine's default rule (``staging``/``gpu_staging``), and per transport where one was measured
# apart (``transport_staging``: Mooncake's TCP is not its RDMA or NVLink).
# The default host rule: Mooncake's and the local engine's, for every transport without a rule of
# its own (Mooncake RDMA host pages: not measured). Measured once on Mooncake TCP, two engines in one
# process on a quiet machine (scripts/staging_bench.py): staging won from some thousands of
# page-sized slices (a 41,984 B fp8 latent page and below); with runs of several pages, or a few
# hundred slices, gather and scatter cost more than the per-slice overhead they save.
PAGE_SIZED = PathThresholds(min_slices=2048, max_mean_slice_bytes=64 << 10)
# GPU pages over Mooncake (NVLink, or RDMA from device memory): staging wins from some hundreds of
# page-sized slices on, since each posted slice costs far more than gathering it on the GPU, while runs
# of several pages stay direct by their size (scripts/gpu_bench.py's staged table; docs/performance.md).
GPU_PAGE_SIZED = PathThresholds(min_slices=512, max_mean_slice_bytes=64 << 10)
# NIXL/UCX on host memory (scripts/staging_bench.py --engine nixl; docs/engines.md, "Staging
# thresholds"): UCX moved scattered page-sized slices faster than gather + write + scatter at every
# count measured, so staging starts only past one NIXL request's worth of slices (65,536), beyond
# what was measured. GPU pages over NIXL: not measured, Mooncake's GPU rule.
NIXL_PAGE_SIZED = PathThresholds(min_slices=1 << 16, max_mean_slice_bytes=64 << 10)
# Mooncake TCP, host pages (docs/engines.md, "Mooncake TCP: staged from 64 slices"): measured between
# the engines' own processes, staging forced on and off. SGLang's fp8 latent pages (41,984 B slices)
# ran faster staged at every count measured down to a few dozen slices a target, vLLM's MLA pages
# (18,432 B) at every count its bench makes, and vLLM's GQA pages (64 KiB) slower at a few hundred
# and faster from about a thousand: staged from 64 slices of at most 48 KiB mean, or from 1,024 of at
# most 72 KiB (64 KiB blocks, a few of them merged with a neighbour by random allocation); larger
# slices direct (not measured). GPU pages over TCP: not measured, Mooncake's GPU rule.
TCP_PAGE_SIZED = PathThresholds(min_slices=64, max_mean_slice_bytes=48 << 10,
                                wider=PathThresholds(min_slices=1024, max_mean_slice_bytes=72 << 10))
# the route's transport part (``mooncake/tcp``) and the rules it has of its own: "tcp" host pages,
# "tcp-gpu" GPU pages; a transport not listed takes the engine's default rules
MOONCAKE_TRANSPORTS: Mapping[str, PathThresholds | None] = MappingProxyType({"tcp": TCP_PAGE_SIZED})
_DEFAULT = object()  # in ``transport_staging``: no rule of the transport's own


@dataclass(frozen=True)
class EngineEntry:
    """One transfer engine: how it is built and what the rest of kvbridge needs to know of it."""

    name: str
    # "module:attr" (attr: the class, or "Class.classmethod"), imported only when an engine is built
    factory: str
    kind: str  # one of KINDS
    transport: str  # its sessions' family: the runtime contract's ``transport`` (both sides share it)
    description: str
    options: tuple[str, ...]  # the create_engine keywords the factory takes (besides max_slices_per_call)
    max_slices_per_call: int  # default slices per call (per request, per kernel launch)
    direct_only: bool = False  # one call copies any number of scattered slices: never staged
    staging: PathThresholds | None = None  # host pages: staged from these on (None: direct only)
    gpu_staging: PathThresholds | None = None  # pages in GPU memory; None: the host thresholds
    # per transport where it differs (a Mooncake engine's protocol): "tcp" -> host pages' rule,
    # "tcp-gpu" -> GPU pages' rule (None there: never staged); the rest take the two above
    transport_staging: Mapping[str, PathThresholds | None] = field(default_factory=dict, hash=False)
    available: str = ""  # "module:function" -> bool, where the engine needs a package
    missing: str = ""  # the EngineError's message when ``available`` says no

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"engine {self.name!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}",
                              field="kind")
        if self.direct_only and (self.staging is not None or self.gpu_staging is not None or self.transport_staging):
            raise ConfigError(f"engine {self.name!r} is direct only and has staging thresholds", field="staging")

    def load(self) -> Callable[..., TransferEngine]:
        """The factory, imported now."""
        module, _, attr = self.factory.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj

    @property
    def class_path(self) -> str:
        """``module:Class`` of the engines it builds (the factory without a classmethod)."""
        module, _, attr = self.factory.partition(":")
        return f"{module}:{attr.split('.')[0]}"

    def is_available(self) -> bool:
        """True when what the engine needs imports on this host (always, for kvbridge's own)."""
        if not self.available:
            return True
        module, _, func = self.available.partition(":")
        return bool(getattr(importlib.import_module(module), func)())


def _entries(*entries: EngineEntry) -> dict[str, EngineEntry]:
    return {e.name: e for e in entries}


_PKG = "kvbridge.transfer.engine"

ENGINES: dict[str, EngineEntry] = _entries(
    EngineEntry(
        "mooncake", f"{_PKG}.mooncake:MooncakeEngine", "network", "mooncake",
        "Mooncake's transfer engine: TCP, RDMA, intra-node NVLink (protocol and device as given)",
        options=("host", "protocol", "device"), max_slices_per_call=1024,
        staging=PAGE_SIZED, gpu_staging=GPU_PAGE_SIZED, transport_staging=MOONCAKE_TRANSPORTS,
        available=f"{_PKG}:mooncake_available",
        missing="the Mooncake transfer engine is not importable: install mooncake-transfer-engine-non-cuda "
                "(CPU hosts, needs libibverbs1) or mooncake-transfer-engine (CUDA 12)"),
    EngineEntry(
        "nixl", f"{_PKG}.nixl:NixlEngine", "network", "nixl",
        "NVIDIA NIXL with its UCX backend (kvbridge[nixl]); peers are introduced with add_peer",
        options=("host",), max_slices_per_call=1 << 16,
        staging=NIXL_PAGE_SIZED, gpu_staging=GPU_PAGE_SIZED,
        available=f"{_PKG}:nixl_available",
        missing="NIXL is not importable: install kvbridge[nixl] (nixl-cu12 1.5.1 with --no-deps; "
                "scripts/setup.sh does), or nixl-cu13 on CUDA 13 hosts"),
    EngineEntry(
        "ipc", f"{_PKG}.ipc.engine:IpcEngine", "same-host", "ipc",
        "CUDA IPC into peer processes on this host, many slices per kernel launch (same host only)",
        options=(), max_slices_per_call=1 << 20, direct_only=True),
    EngineEntry(
        "auto", f"{_PKG}.auto:AutoEngine.create", "composite", "mooncake",
        "Mooncake's session with an IPC engine beside it: IPC to peers on this host, Mooncake to the rest",
        options=("host", "protocol", "device"), max_slices_per_call=1024,
        staging=PAGE_SIZED, gpu_staging=GPU_PAGE_SIZED, transport_staging=MOONCAKE_TRANSPORTS,
        available=f"{_PKG}:mooncake_available",
        missing="the auto engine needs Mooncake: install mooncake-transfer-engine-non-cuda (CPU hosts) "
                "or mooncake-transfer-engine (CUDA 12)"),
    EngineEntry(
        "local", f"{_PKG}.local:LocalEngine.create", "in-process", "local",
        "memcpy between engines of one process (tests, fault injection, the demo's threads)",
        options=("fabric",), max_slices_per_call=1024, staging=PAGE_SIZED),
)


def engine_names(*kinds: str) -> tuple[str, ...]:
    """The registered names, in the table's order; only those of ``kinds`` when given."""
    for kind in kinds:
        if kind not in KINDS:
            raise ConfigError(f"unknown engine kind {kind!r}; choose one of {', '.join(KINDS)}", field="kind")
    return tuple(name for name, e in ENGINES.items() if not kinds or e.kind in kinds)


def engine_entry(name: str) -> EngineEntry:
    """The entry of ``name``; ConfigError naming the known ones otherwise."""
    entry = ENGINES.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ConfigError(f"unknown transfer engine {name!r}; choose one of {', '.join(ENGINES)}", field="engine")
    return entry


def entry_of(engine: TransferEngine) -> EngineEntry:
    """The entry whose class built ``engine`` (a subclass counts as its registered base)."""
    by_class = {e.class_path: e for e in ENGINES.values()}
    for cls in type(engine).__mro__:
        entry = by_class.get(f"{cls.__module__}:{cls.__qualname__}")
        if entry is not None:
            return entry
    raise ConfigError(f"{type(engine).__name__} is not a registered transfer engine (known: {', '.join(ENGINES)}); "
                      "add its entry to kvbridge/transfer/engine/registry.py", field="engine")


def route_key(route: str, on_gpu: bool) -> str:
    """What :func:`staging_thresholds` takes for a route: ``route`` is an engine's name, or its name
    and transport (``mooncake/tcp``: what a Mooncake engine's ``route`` says), then ``-gpu`` for pages
    in GPU memory."""
    name, sep, transport = route.partition("/") if isinstance(route, str) else (route, "", "")
    engine_entry(name)
    if sep and (not transport or "/" in transport or transport.endswith("-gpu")):
        raise ConfigError(f"route {route!r}: want an engine's name, or name/transport (mooncake/tcp)", field="engine")
    return f"{route}-gpu" if on_gpu else route


def staging_thresholds(route: str) -> PathThresholds | None:
    """The thresholds from which a target over ``route`` (:func:`route_key`: ``mooncake``,
    ``mooncake/tcp-gpu``...) is staged; None: always direct (``layout.choose_path`` takes them as
    they are). A transport with a rule of its own in the entry's ``transport_staging`` takes it;
    the rest take the engine's."""
    base, gpu = (route[: -len("-gpu")], True) if route.endswith("-gpu") else (route, False)
    name, _, transport = base.partition("/")
    entry = engine_entry(name)
    if entry.direct_only:
        return None
    if transport:
        own = entry.transport_staging.get(f"{transport}-gpu" if gpu else transport, _DEFAULT)
        if own is not _DEFAULT:
            return own  # type: ignore[return-value]
    if gpu and entry.gpu_staging is not None:
        return entry.gpu_staging
    return entry.staging
