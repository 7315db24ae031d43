"""Canonical policy checkpoints and the deltas between consecutive versions.

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
    encoding of its own contents is refused by :meth:`Checkpoint.parse`.

Delta format (``intellect-node/delta/1``, structs in :mod:`intellect_node.protocol.policy`)
    For every tensor of the target, the smallest of:

    - ``same``: bit-identical to the base tensor; no payload;
    - ``xor``: the XOR of the raw bits of base and target, bytes split into planes (all first bytes of
      every element, then all second bytes, ...), zstd-compressed. With RL learning rates most elements
      do not change at all in low precision and the sign/exponent plane of those that do is zero, so the
      planes are long zero runs;
    - ``add``: the difference of the bit patterns as unsigned integers (mod 2^bits), zigzag-mapped so
      that -1, +1, -2, ... become 1, 2, 3, ..., in byte planes, zstd-compressed. For a float of fixed sign
      the bit pattern is monotonic in the value, so a small step is a small count of ulps, where XOR
      turns a carry into a run of ones: 4-12% smaller than ``xor`` on AdamW updates (bench/delta.py);
    - ``add_by_exp``: the same differences with the elements grouped by the exponent bits of their base
      value (a stable order both sides compute from the base), one zstd frame per group, ``frames``
      listing the frame sizes. AdamW moves every weight by about lr, i.e. by lr/ulp(w) ulps, so the
      exponent predicts the magnitude: each group gets its own entropy table (20-24% smaller than
      ``add`` for bf16 GRPO updates of the embedded model);
    - ``sparse``: the positions that changed (u32 gaps between them, byte planes) followed by the XOR
      values at those positions (byte planes), zstd-compressed; it wins when very few elements change;
    - ``raw``: the target tensor itself (byte planes, zstd), used when the base has no tensor of that
      name, dtype and shape.

    Applying is exact integer arithmetic on bit patterns, so the result is bit-identical for every dtype
    (fp32, bf16, ...). The delta names the content hashes of its base and target; the applier checks the
    base before and the result after, so integrity never rests on the delta itself.

Shortcuts: the whole checkpoint is held in memory (fine up to a few GiB; a streaming applier would work
tensor by tensor against a memory-mapped base), and each tensor is compressed as one zstd frame on one
thread. Trailing bytes after a zstd frame are ignored (the result is hash-checked anyway).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
import torch
import zstandard

from intellect_node.errors import IntegrityError, ProtocolError
from intellect_node.fsutil import atomic_write_bytes
from intellect_node.protocol import codec
from intellect_node.protocol.ids import cid_from_digest
from intellect_node.protocol.policy import DELTA_FORMAT, DeltaFile, TensorDelta

CHECKPOINT_FORMAT = "intellect-node/checkpoint/1"
MAX_HEADER_BYTES = 16 * 1024 * 1024
"""A header this large already describes ~100k tensors; bigger is refused before json parsing."""
ZSTD_LEVEL = 1
"""Measured on AdamW deltas in byte planes (24.6M elements, bench/delta.py's machine): level 1 was 2-4x
faster than the default level 3 and 1-5% *smaller*; the planes are near-random low bits and zero runs,
where the longer searches of higher levels find nothing."""

_METADATA = {"format": CHECKPOINT_FORMAT}

# safetensors dtype code -> (element size in bytes, torch dtype)
DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "F64": (8, torch.float64), "F32": (4, torch.float32), "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16), "I64": (8, torch.int64), "I32": (4, torch.int32),
    "I16": (2, torch.int16), "I8": (1, torch.int8), "U8": (1, torch.uint8), "BOOL": (1, torch.bool),
}
_CODE_OF = {tdt: code for code, (_, tdt) in DTYPES.items()}
_UINT = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


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


class Checkpoint:
    """The canonical bytes of one policy version and the table of its tensors; immutable once built."""

    __slots__ = ("_buf", "tensors", "_hash")

    def __init__(self, buf: bytearray, tensors: Mapping[str, TensorInfo]) -> None:
        # Private: use parse / from_state_dict / load. ``buf`` is never handed out writable.
        self._buf = buf
        self.tensors: dict[str, TensorInfo] = dict(sorted(tensors.items()))
        self._hash: str | None = None

    # ----- construction
    @classmethod
    def build(cls, specs: list[tuple[str, str, tuple[int, ...]]], *, max_size: int,
              fill: Callable[[TensorInfo, memoryview], None]) -> "Checkpoint":
        """Allocate the canonical layout for ``specs`` (refusing more than ``max_size`` bytes first) and
        let ``fill(info, dest)`` write each tensor's raw bytes into ``dest``."""
        header, table, total = _layout(specs)
        if total > max_size:
            raise ProtocolError(f"checkpoint of {total} bytes exceeds the limit of {max_size}")
        buf = bytearray(total)
        buf[:len(header)] = header
        view = memoryview(buf)
        for info in table.values():
            fill(info, view[info.offset:info.offset + info.nbytes])
        return cls(buf, table)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor]) -> "Checkpoint":
        specs = []
        for name, t in state.items():
            if not isinstance(name, str):
                raise TypeError(f"tensor names must be str, got {name!r}")
            if t.dtype not in _CODE_OF:
                raise TypeError(f"tensor {name!r} has unsupported dtype {t.dtype}")
            specs.append((name, _CODE_OF[t.dtype], tuple(int(d) for d in t.shape)))

        def fill(info: TensorInfo, dest: memoryview) -> None:
            if info.nbytes:
                src = state[info.name].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                np.frombuffer(dest, dtype=np.uint8)[:] = src.numpy()

        return cls.build(specs, max_size=1 << 62, fill=fill)

    @classmethod
    def parse(cls, data: bytes | bytearray | memoryview, *, max_size: int) -> "Checkpoint":
        """Strictly parse canonical checkpoint bytes; anything else raises ProtocolError."""
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
            specs.append((name, _check_dtype(entry["dtype"]), _check_shape(entry["shape"])))
        canon, table, total = _layout(specs)
        # Offsets, key order, spacing and padding are all implied: compare the bytes, not the fields.
        if bytes(data[:len(canon)]) != canon or total != len(data):
            raise ProtocolError("checkpoint is not canonically encoded")
        return cls(bytearray(data), table)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, max_size: int) -> "Checkpoint":
        path = Path(path)
        size = path.stat().st_size
        if size > max_size:
            raise ProtocolError(f"{path} of {size} bytes exceeds the limit of {max_size}")
        return cls.parse(path.read_bytes(), max_size=max_size)

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
        arr = np.frombuffer(self._buf, dtype=_UINT[info.itemsize], count=info.numel, offset=info.offset)
        arr.flags.writeable = False
        return arr

    def to_state_dict(self) -> dict[str, torch.Tensor]:
        """Fresh tensors (copies) with the checkpoint's names, dtypes and shapes."""
        out: dict[str, torch.Tensor] = {}
        for name, info in self.tensors.items():
            tdt = DTYPES[info.dtype][1]
            if info.nbytes == 0:
                out[name] = torch.empty(info.shape, dtype=tdt)
                continue
            raw = torch.frombuffer(self._buf, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
            out[name] = raw.clone().view(tdt).reshape(info.shape)
        return out

    def same_layout(self, other: "Checkpoint") -> bool:
        return [(i.name, i.dtype, i.shape) for i in self.tensors.values()] == \
            [(i.name, i.dtype, i.shape) for i in other.tensors.values()]


def _check_dtype(value: object) -> str:
    if not isinstance(value, str) or value not in DTYPES:
        raise ProtocolError(f"unsupported dtype {str(value)[:20]!r}")
    return value


def _check_shape(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > 16:
        raise ProtocolError("a shape is a list of at most 16 dimensions")
    dims = []
    for d in value:
        if type(d) is not int or d < 0 or d >= 1 << 40:
            raise ProtocolError(f"bad dimension {str(d)[:20]!r}")
        dims.append(d)
    return tuple(dims)


# ----------------------------------------------------------------------------------------- byte planes
def _to_planes(arr: np.ndarray) -> bytes:
    """Element bytes regrouped plane by plane (all byte 0s, then all byte 1s, ...)."""
    s = arr.dtype.itemsize
    if s == 1:
        return arr.tobytes()
    return np.ascontiguousarray(arr.view(np.uint8).reshape(-1, s).T).tobytes()


def _from_planes(buf: bytes, itemsize: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`_to_planes`, written into ``out`` (a flat unsigned array) when given."""
    planes = np.frombuffer(buf, dtype=np.uint8, count=itemsize * count).reshape(itemsize, count)
    if out is None:
        out = np.empty(count, dtype=_UINT[itemsize])
    # One strided write per plane: measured ~2-7x faster than a transposing copy of the whole array.
    dst = out.view(np.uint8).reshape(count, itemsize)
    for k in range(itemsize):
        dst[:, k] = planes[k]
    return out


def _compress(data: bytes, level: int) -> bytes:
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)


def _decompress(data: bytes | memoryview, expected: int, what: str) -> bytes:
    """Decompress one zstd frame that must declare exactly ``expected`` bytes (checked before allocating)."""
    try:
        declared = zstandard.get_frame_parameters(data).content_size
        if declared != expected:
            raise ProtocolError(f"{what}: frame declares {declared} bytes, expected {expected}")
        out = zstandard.ZstdDecompressor().decompress(data)
    except zstandard.ZstdError as exc:
        raise ProtocolError(f"{what}: bad zstd frame: {exc}") from exc
    if len(out) != expected:
        raise ProtocolError(f"{what}: decompressed to {len(out)} bytes, expected {expected}")
    return out


# ----------------------------------------------------------------------------------------- encode
_SPARSE_MAX_NUMEL = 1 << 32  # gaps are u32
DENSE_KINDS = ("xor", "add")
"""The dense encodings tried by default. ``add_by_exp`` is opt-in: 20-35% fewer bytes, but its stable
sort by exponent made applying a 106M-parameter bf16 delta 2-3x slower here (bench/delta.py: 4 peers
behind emulated 1 Gbit/s links held the new version later than with ``add`` alone)."""
ALL_DENSE_KINDS = ("xor", "add", "add_by_exp")
_EXPONENT_FIELD = {"BF16": (7, 0xFF), "F16": (10, 0x1F), "F32": (23, 0xFF), "F64": (52, 0x7FF)}
"""(shift, mask) of the exponent bits of each float dtype: the key ``add_by_exp`` groups elements by."""


def _exponent_groups(base: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Positions of ``base``'s elements ordered by their exponent (stable), and the nonempty group sizes.

    Both sides compute this from the base alone, so the grouping costs no bytes on the wire.
    """
    shift, mask = _EXPONENT_FIELD[dtype]
    # 8-bit keys where the exponent fits: numpy's stable argsort is a radix sort, one pass per key byte.
    key = (np.right_shift(base, base.dtype.type(shift)) & base.dtype.type(mask)).astype(
        np.uint8 if mask <= 0xFF else np.uint16)
    order = np.argsort(key, kind="stable")
    # Group sizes from the sorted keys; the needles share the keys' dtype so nothing is widened.
    ends = np.searchsorted(key[order], np.arange(mask + 1, dtype=key.dtype), side="right")
    sizes = np.diff(ends, prepend=0)
    return order, sizes[sizes > 0]


def _zigzag_inplace(d: np.ndarray) -> np.ndarray:
    """Unsigned differences (mod 2^bits) to zigzag form, in place: 0, -1, 1, -2, ... -> 0, 1, 2, 3, ..."""
    sign = np.right_shift(d.view(np.dtype(f"<i{d.dtype.itemsize}")), 8 * d.dtype.itemsize - 1).view(d.dtype)
    np.left_shift(d, d.dtype.type(1), out=d)
    d ^= sign
    return d


def _unzigzag_inplace(z: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_zigzag_inplace`, in place: ``(z >> 1) ^ -(z & 1)`` in unsigned arithmetic."""
    sign = z & z.dtype.type(1)
    np.negative(sign, out=sign)  # 0 or all ones (unsigned wrap-around)
    np.right_shift(z, z.dtype.type(1), out=z)
    z ^= sign
    return z


def _encode_tensor(name: str, info: TensorInfo, base: np.ndarray | None, target: np.ndarray,
                   level: int, dense: tuple[str, ...]) -> TensorDelta:
    shape = list(info.shape)
    if base is None:
        return TensorDelta(name=name, kind="raw", dtype=info.dtype, shape=shape,
                           data=_compress(_to_planes(target), level))
    x = np.bitwise_xor(base, target)
    nnz = int(np.count_nonzero(x))
    if nnz == 0:
        return TensorDelta(name=name, kind="same", dtype=info.dtype, shape=shape)
    candidates = []
    if "xor" in dense:
        candidates.append(TensorDelta(name=name, kind="xor", dtype=info.dtype, shape=shape,
                                      data=_compress(_to_planes(x), level)))
    if "add" in dense or "add_by_exp" in dense:
        z = _zigzag_inplace(target - base)
        if "add" in dense:
            candidates.append(TensorDelta(name=name, kind="add", dtype=info.dtype, shape=shape,
                                          data=_compress(_to_planes(z), level)))
        if "add_by_exp" in dense and info.dtype in _EXPONENT_FIELD:
            # The step of a weight in ulps scales with 1/|w| (AdamW moves every weight by about lr), so
            # the base's exponent predicts the size of the difference: one frame per exponent gives
            # each its own entropy table (bf16: 20-24% smaller than ``add`` on GRPO updates).
            order, sizes = _exponent_groups(base, info.dtype)
            grouped = z[order]
            frames, pos = [], 0
            for c in sizes.tolist():
                frames.append(_compress(_to_planes(grouped[pos:pos + c]), level))
                pos += c
            candidates.append(TensorDelta(name=name, kind="add_by_exp", dtype=info.dtype, shape=shape,
                                          frames=[len(f) for f in frames], data=b"".join(frames)))
    # Sparse only stands a chance when its uncompressed form is smaller than the dense one.
    if info.numel < _SPARSE_MAX_NUMEL and nnz * (4 + info.itemsize) < x.nbytes:
        changed = np.flatnonzero(x)
        gaps = np.diff(changed, prepend=0).astype("<u4")
        candidates.append(TensorDelta(name=name, kind="sparse", dtype=info.dtype, shape=shape, count=nnz,
                                      data=_compress(_to_planes(gaps) + _to_planes(x[changed]), level)))
    if not candidates:
        raise ValueError(f"no encoding left for tensor {name!r}: dense kinds {dense} (of {ALL_DENSE_KINDS})")
    return min(candidates, key=lambda t: len(t.data))


def encode_delta(base: Checkpoint, target: Checkpoint, *, level: int = ZSTD_LEVEL,
                 dense: tuple[str, ...] = DENSE_KINDS) -> bytes:
    """The delta that turns ``base`` into ``target`` (canonical msgpack of a DeltaFile).

    ``dense`` restricts the dense encodings tried per tensor (each costs one compression pass).
    """
    tensors = []
    for name, info in target.tensors.items():
        b = base.tensors.get(name)
        same_kind = b is not None and b.dtype == info.dtype and b.shape == info.shape
        tensors.append(_encode_tensor(name, info, base.bits(name) if same_kind else None,
                                      target.bits(name), level, dense))
    return codec.encode(DeltaFile(format=DELTA_FORMAT, base_hash=base.content_hash,
                                  target_hash=target.content_hash, tensors=tensors))


# ----------------------------------------------------------------------------------------- apply
def read_delta(data: bytes | bytearray | memoryview, *, max_size: int) -> DeltaFile:
    """Strictly decode a delta blob (ProtocolError for anything malformed)."""
    d = codec.decode(data, DeltaFile, max_size=max_size)
    names = [t.name for t in d.tensors]
    if names != sorted(set(names)):
        raise ProtocolError("delta tensor names are not sorted and unique")
    return d


def _apply_tensor(t: TensorDelta, info: TensorInfo, base: Checkpoint, dest: memoryview) -> None:
    n, s = info.numel, info.itemsize
    out = np.frombuffer(dest, dtype=_UINT[s], count=n)
    what = f"tensor {t.name[:80]!r}"
    if t.kind == "raw":
        _from_planes(_decompress(t.data, n * s, what), s, n, out)
        return
    b = base.tensors.get(t.name)
    if b is None or b.dtype != info.dtype or b.shape != info.shape:
        raise ProtocolError(f"{what}: {t.kind} entry but the base has no such tensor")
    base_bits = base.bits(t.name)
    if t.kind == "same":
        out[:] = base_bits
    elif t.kind == "xor":
        _from_planes(_decompress(t.data, n * s, what), s, n, out)
        out ^= base_bits
    elif t.kind == "add":
        _unzigzag_inplace(_from_planes(_decompress(t.data, n * s, what), s, n, out))
        out += base_bits  # mod 2^bits
    elif t.kind == "add_by_exp":
        if info.dtype not in _EXPONENT_FIELD:
            raise ProtocolError(f"{what}: add_by_exp on a tensor of {info.dtype}")
        order, sizes = _exponent_groups(base_bits, info.dtype)
        if len(t.frames) != len(sizes) or any(f <= 0 for f in t.frames) or sum(t.frames) != len(t.data):
            raise ProtocolError(f"{what}: {len(t.frames)} frames do not fit {len(sizes)} exponent groups "
                                f"and {len(t.data)} bytes")
        grouped = np.empty(n, dtype=_UINT[s])
        pos = off = 0
        view = memoryview(t.data)
        for c, f in zip(sizes.tolist(), t.frames):
            _from_planes(_decompress(view[off:off + f], c * s, what), s, c, grouped[pos:pos + c])
            pos += c
            off += f
        out[order] = _unzigzag_inplace(grouped)
        out += base_bits
    else:  # sparse
        if not 0 < t.count <= n or n >= _SPARSE_MAX_NUMEL:
            raise ProtocolError(f"{what}: sparse count {t.count} out of range for {n} elements")
        raw = _decompress(t.data, t.count * (4 + s), what)
        gaps = _from_planes(raw[:4 * t.count], 4, t.count)
        values = _from_planes(raw[4 * t.count:], s, t.count)
        if t.count > 1 and not gaps[1:].all():
            raise ProtocolError(f"{what}: sparse positions repeat")
        idx = np.cumsum(gaps, dtype=np.uint64)
        if idx[-1] >= n:
            raise ProtocolError(f"{what}: sparse position {int(idx[-1])} beyond {n} elements")
        out[:] = base_bits
        out[idx] ^= values


def delta_size_limit(max_checkpoint_bytes: int) -> int:
    """The largest delta worth accepting for checkpoints up to ``max_checkpoint_bytes``: a delta of
    incompressible tensors is the checkpoint plus zstd's and msgpack's framing."""
    return max_checkpoint_bytes + max_checkpoint_bytes // 64 + (1 << 20)


def apply_delta(base: Checkpoint, delta: bytes | bytearray | memoryview, *, expected_hash: str,
                max_size: int) -> Checkpoint:
    """Apply ``delta`` to ``base`` and return the result, whose content hash must be ``expected_hash``.

    Raises ProtocolError for a malformed delta (over ``delta_size_limit(max_size)`` bytes, or a result
    over ``max_size`` bytes), IntegrityError when the delta is for another base or another target, or the
    result does not hash to ``expected_hash``.
    """
    d = read_delta(delta, max_size=delta_size_limit(max_size))
    if d.target_hash != expected_hash:
        raise IntegrityError(f"delta leads to {d.target_hash}, not the announced {expected_hash}")
    if d.base_hash != base.content_hash:
        raise IntegrityError(f"delta applies to {d.base_hash}, the base held is {base.content_hash}")
    by_name = {t.name: t for t in d.tensors}
    specs = [(t.name, _check_dtype(t.dtype), _check_shape(t.shape)) for t in d.tensors]
    result = Checkpoint.build(specs, max_size=max_size,
                              fill=lambda info, dest: _apply_tensor(by_name[info.name], info, base, dest))
    if result.content_hash != expected_hash:
        raise IntegrityError(f"delta result hashes to {result.content_hash}, announced {expected_hash}")
    return result


def delta_stats(delta: bytes | bytearray | memoryview, *, max_size: int) -> dict[str, int]:
    """Bytes per encoding kind in a delta (for benchmarks and logs)."""
    out: dict[str, int] = {"same": 0, "xor": 0, "add": 0, "add_by_exp": 0, "sparse": 0, "raw": 0}
    for t in read_delta(delta, max_size=max_size).tensors:
        out[t.kind] += len(t.data)
    return out


__all__ = ["ALL_DENSE_KINDS", "CHECKPOINT_FORMAT", "DENSE_KINDS", "DTYPES", "Checkpoint", "TensorInfo", "apply_delta", "delta_stats",
           "delta_size_limit", "encode_delta", "read_delta"]
