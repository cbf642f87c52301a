"""The weights identity of the runtime contract: a digest of a checkpoint cheap enough for a
700 GB model, so that another checkpoint under the same served name is refused at start-up.

    weights_digest(folder) = "wd1:" + sha256 over, per weight file in name order:
        name, size,
        safetensors: its JSON header (every tensor's name, dtype, shape and byte offsets)
        SAMPLES chunks of CHUNK bytes at evenly spaced offsets of the file (the first and
        the last included)

Cost: the headers (a few hundred KiB per file for a large model) plus SAMPLES x CHUNK per
file: DeepSeek-V3's 163 files read about 163 x (0.1 + 0.5) MiB, about 100 MB, in about a
second from a local disk; nothing is loaded onto a device.

What it catches: another architecture or size, another dtype or quantisation, other tensor
names or shapes (the headers), a re-trained or re-initialised checkpoint of the same shapes
(its bytes differ at every sampled offset), a truncated or partly downloaded file (sizes).
What it can miss: a checkpoint that differs from another only in bytes no sample touches (a
fine-tune of a few tensors, an edit of single values); compare ``full=True`` digests (every
byte read) when that matters.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

from kvbridge.errors import ConfigError

__all__ = ["WEIGHT_SUFFIXES", "contract_weights", "weights_digest"]

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLES = 8
CHUNK = 64 << 10
MAX_HEADER = 100 << 20  # safetensors' own limit for its JSON header


def weights_digest(folder: str | os.PathLike[str], *, full: bool = False) -> str:
    """The digest of the checkpoint in ``folder`` (its weight files, module docstring);
    ConfigError naming the folder when it holds no weight file."""
    root = Path(folder)
    files = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)) \
        if root.is_dir() else []
    if not files:
        raise ConfigError(f"{root} holds no weight files ({', '.join(WEIGHT_SUFFIXES)})", field="model.weights")
    h = hashlib.sha256(b"kvbridge-weights1|full" if full else b"kvbridge-weights1")
    for path in files:
        size = path.stat().st_size
        h.update(f"|{path.name}|{size}|".encode())
        with path.open("rb") as f:
            if path.suffix == ".safetensors" and size >= 8:
                n = int.from_bytes(f.read(8), "little")
                if n > min(MAX_HEADER, size - 8):
                    raise ConfigError(f"{path}: safetensors header of {n} bytes in a file of {size}",
                                      field="model.weights")
                h.update(f.read(n))
            if full:
                f.seek(0)
                for block in iter(lambda: f.read(8 << 20), b""):
                    h.update(block)
                continue
            for offset in _offsets(size):
                f.seek(offset)
                h.update(f.read(CHUNK))
    return "wd1:" + h.hexdigest()


def _offsets(size: int) -> list[int]:
    """SAMPLES offsets spread over ``[0, size - CHUNK]`` (fewer when the file is small)."""
    last = max(0, size - CHUNK)
    return sorted({last * i // (SAMPLES - 1) for i in range(SAMPLES)})


def contract_weights(setting: str, model_path: str, revision: str = "unspecified") -> str:
    """The runtime contract's ``model.weights`` for an engine's ``weights`` setting: with "auto",
    :func:`weights_digest` of ``model_path`` (a local folder, or a hub id's cached snapshot at
    ``revision``, never downloaded); "unspecified" with "off", or when there is no local copy or no
    weight file (logged: the contract then carries no weights identity); any other string as given
    (an operator's own identity). The integrations' one rule (vLLM's and SGLang's settings)."""
    if setting == "off":
        return "unspecified"
    if setting != "auto":
        return setting
    folder = model_path
    if not folder:
        return "unspecified"
    if not os.path.isdir(folder):
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(folder, revision=None if revision == "unspecified" else revision,
                                       local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure to resolve means: no local copy to digest
            log.warning("kvbridge: no local copy of %s to digest (%s): the contract carries no weights identity",
                        model_path, exc)
            return "unspecified"
    started = time.monotonic()
    try:
        digest = weights_digest(folder)
    except ConfigError as exc:  # no weight files (a dummy load format, a test model): nothing to name
        log.warning("kvbridge: %s: the contract carries no weights identity", exc)
        return "unspecified"
    log.info("kvbridge: weights of %s: %s (%.2fs)", folder, digest, time.monotonic() - started)
    return digest
