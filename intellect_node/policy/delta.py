"""The deltas between consecutive policy versions: encode one, check and apply it.

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

The versions themselves are :class:`~intellect_node.policy.weights.PolicyWeights` (canonical
safetensors bytes named by their content hash).

Memory: encoding and applying work tensor by tensor on the raw bits of the two versions, which may be
read-only mappings of their files (``PolicyWeights.load``/``write``); ``apply_delta(..., path=)`` builds the
result in a file. The delta itself is one buffer (compressed: a fraction of the model for RL updates,
about the model's size only when every tensor is ``raw``).

Shortcuts: each tensor is compressed as one zstd frame on one thread; the delta blob is encoded and
decoded whole. Trailing bytes after a zstd frame are ignored (the result is hash-checked anyway).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import zstandard

from intellect_node.errors import IntegrityError, ProtocolError
from intellect_node.policy.weights import UINT, PolicyWeights, TensorInfo, check_dtype, check_shape
from intellect_node.protocol import codec
from intellect_node.protocol.policy import DELTA_FORMAT, DeltaFile, TensorDelta

ZSTD_LEVEL = 1
"""Measured on AdamW deltas in byte planes (24.6M elements, bench/delta.py's machine): level 1 was 2-4x
faster than the default level 3 and 1-5% *smaller*; the planes are near-random low bits and zero runs,
where the longer searches of higher levels find nothing."""


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
        out = np.empty(count, dtype=UINT[itemsize])
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


class KindMemo:
    """The dense encoding that won for each tensor, so the next delta tries that one alone: consecutive
    optimizer updates look alike, and each extra kind tried costs a compression pass over the tensor (on
    the embedded model, 17 ms a delta with two kinds against 8 with one). Every ``refresh`` deltas all
    kinds are tried again, so a tensor whose updates change character moves to the better kind."""

    def __init__(self, refresh: int = 16) -> None:
        if refresh < 1:
            raise ValueError("refresh must be at least 1")
        self.refresh = refresh
        self.won: dict[str, str] = {}
        self.tried: dict[str, tuple[str, ...]] = {}
        """The kinds each tensor tried in the last delta."""
        self._count = 0

    def next_delta(self) -> None:
        if self._count % self.refresh == 0:
            self.won.clear()
        self._count += 1
        self.tried = {}

    def kinds(self, name: str, dense: tuple[str, ...]) -> tuple[str, ...]:
        kind = self.won.get(name)
        self.tried[name] = (kind,) if kind in dense else dense
        return self.tried[name]

    def record(self, name: str, chosen: TensorDelta) -> None:
        if chosen.kind in ALL_DENSE_KINDS:
            self.won[name] = chosen.kind


def encode_delta(base: PolicyWeights, target: PolicyWeights, *, level: int = ZSTD_LEVEL,
                 dense: tuple[str, ...] = DENSE_KINDS, memo: KindMemo | None = None) -> bytes:
    """The delta that turns ``base`` into ``target`` (canonical msgpack of a DeltaFile).

    ``dense`` restricts the dense encodings tried per tensor (each costs one compression pass); with
    ``memo`` a tensor tries only the kind that won its last delta (:class:`KindMemo`).
    """
    tensors = []
    if memo is not None:
        memo.next_delta()
    for name, info in target.tensors.items():
        b = base.tensors.get(name)
        same_kind = b is not None and b.dtype == info.dtype and b.shape == info.shape
        kinds = memo.kinds(name, dense) if memo is not None else dense
        t = _encode_tensor(name, info, base.bits(name) if same_kind else None, target.bits(name), level,
                           kinds)
        if memo is not None:
            memo.record(name, t)
        tensors.append(t)
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


def _apply_tensor(t: TensorDelta, info: TensorInfo, base: PolicyWeights, dest: memoryview) -> None:
    n, s = info.numel, info.itemsize
    out = np.frombuffer(dest, dtype=UINT[s], count=n)
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
        grouped = np.empty(n, dtype=UINT[s])
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


def apply_delta(base: PolicyWeights, delta: bytes | bytearray | memoryview, *, expected_hash: str,
                max_size: int, path: str | os.PathLike[str] | None = None) -> PolicyWeights:
    """Apply ``delta`` to ``base`` and return the result, whose content hash must be ``expected_hash``.

    With ``path`` the result is built in that file through a mapping (removed again if its hash is
    wrong), so a follower of a multi-GB policy holds no model-sized buffer besides its mapped base.

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
    specs = [(t.name, check_dtype(t.dtype), check_shape(t.shape)) for t in d.tensors]
    result = PolicyWeights.build(specs, max_size=max_size, path=path,
                                 fill=lambda info, dest: _apply_tensor(by_name[info.name], info, base, dest))
    if result.content_hash != expected_hash:
        if path is not None:
            Path(path).unlink(missing_ok=True)
        raise IntegrityError(f"delta result hashes to {result.content_hash}, announced {expected_hash}")
    return result


def delta_stats(delta: bytes | bytearray | memoryview, *, max_size: int) -> dict[str, int]:
    """Bytes per encoding kind in a delta (for benchmarks and logs)."""
    out: dict[str, int] = {"same": 0, "xor": 0, "add": 0, "add_by_exp": 0, "sparse": 0, "raw": 0}
    for t in read_delta(delta, max_size=max_size).tensors:
        out[t.kind] += len(t.data)
    return out



__all__ = ["ALL_DENSE_KINDS", "DENSE_KINDS", "ZSTD_LEVEL", "apply_delta", "delta_size_limit", "delta_stats",
           "encode_delta", "read_delta"]
