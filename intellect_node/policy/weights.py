"""The canonical file of one policy version (its weights) and the content hash that names it.

Checkpoint format (``intellect-node/checkpoint/1``)
    A valid safetensors file, written one way only so that "the hash of version v" is well defined:

    - 8 bytes: little-endian u64 ``N``, the header length;
    - ``N`` bytes: JSON, ``json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True)``,
      right-padded with spaces so that ``8 + N`` is a multiple of 8; ``header`` maps every tensor name to
      ``{"data_offsets": [begin, end], "dtype": <code>, "shape": [...]}`` and ``"__metadata__"`` to
      ``{"format": "intellect-node/checkpoint/1"}`` (nothing else: no step, no time, no host);
    - the data: tensors back to back, no holes, ordered by element size (largest first) and then by name,
      so each tensor starts at a multiple of its element size (the order safetensors itself uses).

    The content hash is the CIDv1 (raw, sha2-256) of those bytes. Any file that is not exactly this
    encoding of its own contents is refused by :meth:`PolicyWeights.parse`.

"Checkpoint" in the wire names (``checkpoint_hash``, ``max_checkpoint_bytes``) means this file. It is not
the trainer's crash-safe checkpoint (:mod:`intellect_node.trainer.checkpoint`: weights in plain
safetensors, optimizer state and the consumed batches, read back only by the trainer that wrote them).
The deltas between two versions are :mod:`intellect_node.policy.delta`.

Memory: a checkpoint of several GB is never held twice. :meth:`PolicyWeights.write` streams a state dict
to the file tensor by tensor (hashing as it goes), :meth:`PolicyWeights.load` maps the file read-only
(pages the kernel can drop, not process memory), and :meth:`PolicyWeights.build` can fill a file-backed
mapping (what applying a delta into a file uses). ``parse`` of bytes received in memory and
``from_state_dict`` still build an in-memory copy (small models, tests); :meth:`PolicyWeights.tensor` copies
one tensor out of a mapped file, so a model is loaded from one with a tensor's memory to spare.
:func:`file_size` gives a layout's exact size from the model alone, so a fetch can refuse any other.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from intellect_node.errors import IntegrityError, ProtocolError
from intellect_node.fsutil import atomic_replace_file, atomic_write_bytes
from intellect_node.protocol.ids import cid_from_digest

CHECKPOINT_FORMAT = "intellect-node/checkpoint/1"
MAX_HEADER_BYTES = 16 * 1024 * 1024
"""A header this large already describes ~100k tensors; bigger is refused before json parsing."""

_METADATA = {"format": CHECKPOINT_FORMAT}

# safetensors dtype code -> (element size in bytes, torch dtype)
DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "F64": (8, torch.float64), "F32": (4, torch.float32), "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16), "I64": (8, torch.int64), "I32": (4, torch.int32),
    "I16": (2, torch.int16), "I8": (1, torch.int8), "U8": (1, torch.uint8), "BOOL": (1, torch.bool),
}
_CODE_OF = {tdt: code for code, (_, tdt) in DTYPES.items()}
UINT: dict[int, np.dtype[Any]] = {n: np.dtype(f"<u{n}") for n in (1, 2, 4, 8)}
"""Element size in bytes -> the unsigned integer dtype a tensor's raw bit patterns are read as."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors code, a key of DTYPES
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the checkpoint file
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def numel(self) -> int:
        return self.nbytes // self.itemsize


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _layout(specs: Iterable[tuple[str, str, tuple[int, ...]]]) -> tuple[bytes, dict[str, TensorInfo], int]:
    """The canonical header bytes, tensor table and total file size for ``(name, dtype, shape)`` specs."""
    ordered = sorted(specs, key=lambda s: (-DTYPES[s[1]][0], s[0]))
    if any(name == "__metadata__" for name, _, _ in ordered):
        raise ProtocolError("'__metadata__' is reserved in safetensors and cannot name a tensor")
    entries: dict[str, object] = {"__metadata__": _METADATA}
    spans: list[tuple[str, str, tuple[int, ...], int, int]] = []
    pos = 0
    for name, dtype, shape in ordered:
        nbytes = _numel(shape) * DTYPES[dtype][0]
        entries[name] = {"data_offsets": [pos, pos + nbytes], "dtype": dtype, "shape": list(shape)}
        spans.append((name, dtype, shape, pos, nbytes))
        pos += nbytes
    text = json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * (-(8 + len(text)) % 8)
    header = len(text).to_bytes(8, "little") + text
    table = {name: TensorInfo(name, dtype, shape, len(header) + begin, nbytes)
             for name, dtype, shape, begin, nbytes in spans}
    return header, table, len(header) + pos


class PolicyWeights:
    """The canonical bytes of one policy version and the table of its tensors; immutable once built."""

    __slots__ = ("_buf", "tensors", "_hash")

    def __init__(self, buf: bytearray | mmap.mmap, tensors: Mapping[str, TensorInfo]) -> None:
        # Private: use parse / from_state_dict / load / write. ``buf`` (memory, or a read-only mapping of
        # the file) is never handed out writable.
        self._buf = buf
        self.tensors: dict[str, TensorInfo] = dict(sorted(tensors.items()))
        self._hash: str | None = None

    # ----- construction
    @classmethod
    def build(cls, specs: list[tuple[str, str, tuple[int, ...]]], *, max_size: int,
              fill: Callable[[TensorInfo, memoryview], None],
              path: str | os.PathLike[str] | None = None) -> "PolicyWeights":
        """Allocate the canonical layout for ``specs`` (refusing more than ``max_size`` bytes first) and
        let ``fill(info, dest)`` write each tensor's raw bytes into ``dest``.

        With ``path`` the layout is a file (written under a temporary name, fsynced, renamed into place)
        filled through a shared mapping, and the result maps it read-only: nothing model-sized is held
        in process memory."""
        header, table, total = _layout(specs)
        if total > max_size:
            raise ProtocolError(f"checkpoint of {total} bytes exceeds the limit of {max_size}")
        if path is None:
            buf = bytearray(total)
            buf[:len(header)] = header
            view = memoryview(buf)
            for info in table.values():
                fill(info, view[info.offset:info.offset + info.nbytes])
            view.release()
            return cls(buf, table)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb+") as f:
                f.truncate(total)
                with mmap.mmap(f.fileno(), total, access=mmap.ACCESS_WRITE) as m:
                    m[:len(header)] = header
                    view = memoryview(m)
                    try:
                        for info in table.values():
                            fill(info, view[info.offset:info.offset + info.nbytes])
                    finally:
                        view.release()
                    m.flush()
            atomic_replace_file(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return cls(_map(path), table)

    @classmethod
    def write(cls, path: str | os.PathLike[str], state: Mapping[str, torch.Tensor]) -> "PolicyWeights":
        """Write ``state`` to ``path`` in the canonical format one tensor at a time (atomically: a
        temporary file, fsynced, renamed) and return it mapped read-only, its hash computed on the way.

        Peak extra memory is one tensor (its CPU copy when it lives elsewhere), not the model."""
        specs = _specs(state)
        header, table, total = _layout(specs)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        digest = hashlib.sha256(header)
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                for info in sorted(table.values(), key=lambda i: i.offset):
                    if not info.nbytes:
                        continue
                    raw = _raw_bytes(state[info.name])
                    digest.update(raw)
                    f.write(raw)
            atomic_replace_file(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        out = cls(_map(path), table)
        if out.nbytes != total:
            raise OSError(f"{path}: wrote {out.nbytes} bytes, expected {total} (changed while writing?)")
        out._hash = cid_from_digest(digest.digest())
        return out

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor]) -> "PolicyWeights":
        """The canonical bytes of ``state`` in memory (use :meth:`write` for a large model)."""

        def fill(info: TensorInfo, dest: memoryview) -> None:
            if info.nbytes:
                np.frombuffer(dest, dtype=np.uint8)[:] = np.frombuffer(_raw_bytes(state[info.name]), np.uint8)

        return cls.build(_specs(state), max_size=1 << 62, fill=fill)

    @classmethod
    def parse(cls, data: bytes | bytearray | memoryview, *, max_size: int) -> "PolicyWeights":
        """Strictly parse canonical checkpoint bytes (copied); anything else raises ProtocolError."""
        table, _ = cls.parse_mapped(data, max_size=max_size)
        return cls(bytearray(data), table)

    @classmethod
    def parse_mapped(cls, data: bytes | bytearray | memoryview | mmap.mmap, *,
                     max_size: int) -> tuple[dict[str, TensorInfo], int]:
        """The tensor table of canonical bytes (not copied); ProtocolError unless they are canonical."""
        if len(data) > max_size:
            raise ProtocolError(f"checkpoint of {len(data)} bytes exceeds the limit of {max_size}")
        if len(data) < 8:
            raise ProtocolError("checkpoint shorter than its header length field")
        n = int.from_bytes(bytes(data[:8]), "little")
        if n > MAX_HEADER_BYTES or 8 + n > len(data):
            raise ProtocolError(f"checkpoint header length {n} is out of range")
        try:
            header = json.loads(bytes(data[8:8 + n]).decode("ascii"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ProtocolError(f"checkpoint header is not JSON: {exc}") from exc
        if not isinstance(header, dict) or header.get("__metadata__") != _METADATA:
            raise ProtocolError(f"checkpoint is not {CHECKPOINT_FORMAT}")
        specs = []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(entry, dict) or set(entry) != {"data_offsets", "dtype", "shape"}:
                raise ProtocolError(f"tensor {name[:80]!r}: malformed header entry")
            specs.append((name, check_dtype(entry["dtype"]), check_shape(entry["shape"])))
        canon, table, total = _layout(specs)
        # Offsets, key order, spacing and padding are all implied: compare the bytes, not the fields.
        if bytes(data[:len(canon)]) != canon or total != len(data):
            raise ProtocolError("checkpoint is not canonically encoded")
        return table, total

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, max_size: int) -> "PolicyWeights":
        """The canonical file at ``path``, mapped read-only (the file must not be rewritten in place;
        every writer here replaces files by rename, which leaves a mapping intact)."""
        path = Path(path)
        size = path.stat().st_size
        if size > max_size:
            raise ProtocolError(f"{path} of {size} bytes exceeds the limit of {max_size}")
        if size == 0:
            raise ProtocolError(f"{path} is empty")
        m = _map(path)
        table, _ = cls.parse_mapped(m, max_size=max_size)
        return cls(m, table)

    # ----- access
    @property
    def nbytes(self) -> int:
        return len(self._buf)

    @property
    def content_hash(self) -> str:
        """CIDv1 (raw, sha2-256) of the canonical bytes: the hash announced for this version."""
        if self._hash is None:
            self._hash = cid_from_digest(hashlib.sha256(self._buf).digest())
        return self._hash

    def to_bytes(self) -> memoryview:
        return memoryview(self._buf).toreadonly()

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_bytes(path, self.to_bytes())

    def bits(self, name: str) -> np.ndarray:
        """The raw bit patterns of tensor ``name`` as a read-only flat unsigned-integer array."""
        info = self.tensors[name]
        arr = np.frombuffer(self._buf, dtype=UINT[info.itemsize], count=info.numel, offset=info.offset)
        arr.flags.writeable = False
        return arr

    def tensor(self, name: str) -> torch.Tensor:
        """A fresh tensor (a copy) of ``name``, with its dtype and shape: one tensor's memory at a time
        when a mapped file is loaded into a model tensor by tensor."""
        info = self.tensors[name]
        tdt = DTYPES[info.dtype][1]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=tdt)
        # torch.tensor copies (frombuffer would alias, and warns on a read-only mapping).
        raw = torch.tensor(np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset))
        return raw.view(tdt).reshape(info.shape)

    def to_state_dict(self) -> dict[str, torch.Tensor]:
        """Fresh tensors (copies) with the checkpoint's names, dtypes and shapes."""
        return {name: self.tensor(name) for name in self.tensors}



def file_size(state: Mapping[str, torch.Tensor]) -> int:
    """The exact size in bytes of the canonical file of ``state``: the header is implied by the names,
    dtypes and shapes alone, so only those are read (meta tensors will do). What a peer's file of that
    layout must measure, known before any byte of it moves."""
    return _layout(_specs(state))[2]


def require_finite(state: Mapping[str, torch.Tensor]) -> None:
    """IntegrityError naming the first floating-point tensor that holds NaN or inf. The trainer calls it
    before it publishes or checkpoints a version: a step that went wrong must not reach every node. (The
    format itself holds any bits: deltas and tests round-trip arbitrary values.)"""
    for name, t in state.items():
        if t.is_floating_point() and not _finite(t):
            raise IntegrityError(f"tensor {name!r} holds NaN or inf: a policy that is not finite is never "
                                 "published or checkpointed")


FINITE_SLICE = 1 << 20
"""Elements checked at a time: a mask of a few MB, not one as large as the tensor (a multi-GB model's
publication must not hold a second copy, tests/trainer/test_policy_memory.py)."""


def _finite(t: torch.Tensor) -> bool:
    flat = t.detach().reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + FINITE_SLICE]).all())
               for i in range(0, flat.numel(), FINITE_SLICE))


def _specs(state: Mapping[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...]]]:
    specs = []
    for name, t in state.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if t.dtype not in _CODE_OF:
            raise TypeError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        specs.append((name, _CODE_OF[t.dtype], tuple(int(d) for d in t.shape)))
    return specs


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes without a copy when it is a contiguous CPU tensor (one copy otherwise)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs say otherwise


def _map(path: Path) -> mmap.mmap:
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def check_dtype(value: object) -> str:
    """A dtype code read from a header or a delta; ProtocolError unless it is a key of :data:`DTYPES`."""
    if not isinstance(value, str) or value not in DTYPES:
        raise ProtocolError(f"unsupported dtype {str(value)[:20]!r}")
    return value


def check_shape(value: object) -> tuple[int, ...]:
    """A shape read from a header or a delta: at most 16 dimensions, each an int in [0, 2^40)."""
    if not isinstance(value, list) or len(value) > 16:
        raise ProtocolError("a shape is a list of at most 16 dimensions")
    dims = []
    for d in value:
        if type(d) is not int or d < 0 or d >= 1 << 40:
            raise ProtocolError(f"bad dimension {str(d)[:20]!r}")
        dims.append(d)
    return tuple(dims)


__all__ = ["CHECKPOINT_FORMAT", "DTYPES", "UINT", "PolicyWeights", "TensorInfo", "check_dtype", "check_shape",
           "file_size"]
