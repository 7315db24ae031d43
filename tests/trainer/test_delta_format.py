"""Canonical checkpoints and deltas: bit-exact chains (fp32, bf16), each encoding, hostile deltas."""

from __future__ import annotations

import json
import struct
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from intellect_node.errors import IntegrityError, ProtocolError
from intellect_node.policy.delta import DENSE_KINDS, apply_delta, delta_stats, encode_delta, read_delta
from intellect_node.policy.weights import PolicyWeights
from intellect_node.protocol import codec
from intellect_node.protocol.policy import DeltaFile
from tests.support.delta import policy_versions

torch.set_num_threads(1)
MAX = 1 << 26


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_from_any_full_checkpoint_is_bit_exact(dtype: torch.dtype) -> None:
    versions = policy_versions(dtype, 6)
    assert len({v.content_hash for v in versions}) == 6  # every step changed the policy
    deltas = [encode_delta(a, b) for a, b in zip(versions, versions[1:])]
    for start in range(len(versions)):
        held = PolicyWeights.parse(versions[start].to_bytes(), max_size=MAX)  # as fetched in full
        for v in range(start + 1, len(versions)):
            held = apply_delta(held, deltas[v - 1], expected_hash=versions[v].content_hash, max_size=MAX)
            assert bytes(held.to_bytes()) == bytes(versions[v].to_bytes())
    loaded = held.to_state_dict()
    for name, t in versions[-1].to_state_dict().items():
        assert loaded[name].dtype == dtype
        assert torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8))
    if dtype == torch.bfloat16:
        # The point of deltas: a bf16 RL update is a fraction of the checkpoint.
        assert max(len(d) for d in deltas) < versions[-1].nbytes / 2


def test_special_values_and_every_encoding_kind_round_trip() -> None:
    big = torch.randn(4096)
    base = {"same": torch.randn(7, 3), "dense": torch.randn(64, 64).bfloat16(), "sparse": big,
            "reshaped": torch.randn(4, 6), "dropped": torch.ones(3), "ints": torch.arange(10),
            "flags": torch.tensor([True, False]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    target = {k: v.clone() for k, v in base.items() if k != "dropped"}
    target["dense"] = target["dense"] + torch.randn(64, 64).bfloat16()
    target["sparse"][[5, 1000, 4095]] = torch.tensor([float("nan"), -0.0, float("inf")])
    target["reshaped"] = target["reshaped"].reshape(6, 4)
    target["new"] = torch.randn(5, dtype=torch.float64)
    target["ints"][0] = -7
    a, b = PolicyWeights.from_state_dict(base), PolicyWeights.from_state_dict(target)
    delta = encode_delta(a, b)
    kinds = {t.name: t.kind for t in read_delta(delta, max_size=MAX).tensors}
    assert kinds["same"] == kinds["scalar"] == kinds["flags"] == kinds["empty"] == "same"
    assert kinds["dense"] in DENSE_KINDS and kinds["sparse"] == "sparse"
    assert kinds["reshaped"] == kinds["new"] == "raw" and "dropped" not in kinds
    out = apply_delta(a, delta, expected_hash=b.content_hash, max_size=MAX)
    assert bytes(out.to_bytes()) == bytes(b.to_bytes())
    assert delta_stats(delta, max_size=MAX)["sparse"] > 0
    # NaN payload and the sign of zero survive because the delta works on bits, not values.
    got = out.to_state_dict()["sparse"]
    assert torch.isnan(got[5]) and torch.signbit(got[1000]) and torch.isinf(got[4095])


@pytest.mark.parametrize("dense", [("xor",), ("add",), ("add_by_exp",)])
def test_each_dense_kind_is_bit_exact_across_signs_and_specials(dense: tuple[str, ...]) -> None:
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        if dtype.is_floating_point:
            a = (torch.randn(3000, generator=g) * 1e-3).to(dtype)
            b = a + (torch.randn(3000, generator=g) * 1e-3).to(dtype)  # many cross zero: sign flips
            b[:4] = torch.tensor([float("nan"), float("-inf"), -0.0, 65000.0])
        else:
            a = torch.randint(-2**62, 2**62, (3000,), generator=g)
            b = a + torch.randint(-3, 4, (3000,), generator=g)
        base, target = PolicyWeights.from_state_dict({"t": a}), PolicyWeights.from_state_dict({"t": b})
        if dense == ("add_by_exp",) and not dtype.is_floating_point:
            with pytest.raises(ValueError, match="no encoding"):  # integers have no exponent to group by
                encode_delta(base, target, dense=dense)
            continue
        delta = encode_delta(base, target, dense=dense)
        assert read_delta(delta, max_size=MAX).tensors[0].kind == dense[0]
        out = apply_delta(base, delta, expected_hash=target.content_hash, max_size=MAX)
        assert bytes(out.to_bytes()) == bytes(target.to_bytes())


_DT = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
       "U8": torch.uint8}


@given(st.lists(st.tuples(st.sampled_from(sorted(_DT)), st.integers(1, 300),
                          st.binary(min_size=8, max_size=8), st.floats(0, 1), st.booleans()),
                min_size=1, max_size=4))
@settings(max_examples=60, deadline=None)
def test_any_bits_round_trip(specs: list[tuple[str, int, bytes, float, bool]]) -> None:
    """Arbitrary bit patterns (NaNs, subnormals, sign flips), any fraction changed, shapes kept or not."""
    base, target = {}, {}
    for i, (code, n, seed, frac, reshape) in enumerate(specs):
        rng = np.random.default_rng(int.from_bytes(seed, "little"))
        size = torch.empty(0, dtype=_DT[code]).element_size()
        a = rng.integers(0, 256, n * size, dtype=np.uint8)
        b = a.copy()
        flip = rng.random(n * size) < frac
        b[flip] = rng.integers(0, 256, int(flip.sum()), dtype=np.uint8)
        base[f"t{i}"] = torch.from_numpy(a).view(_DT[code])
        target[f"t{i}"] = torch.from_numpy(b).view(_DT[code]).reshape((1, n) if reshape else (n,))
    a_ck, b_ck = PolicyWeights.from_state_dict(base), PolicyWeights.from_state_dict(target)
    out = apply_delta(a_ck, encode_delta(a_ck, b_ck), expected_hash=b_ck.content_hash, max_size=MAX)
    assert bytes(out.to_bytes()) == bytes(b_ck.to_bytes())


def test_checkpoint_is_canonical_and_plain_safetensors() -> None:
    sd = {"b": torch.randn(3, 2), "a": torch.randn(5).bfloat16(), "c": torch.arange(4)}
    one = PolicyWeights.from_state_dict(sd)
    two = PolicyWeights.from_state_dict(dict(reversed(list(sd.items()))))
    assert bytes(one.to_bytes()) == bytes(two.to_bytes()) and one.content_hash == two.content_hash
    loaded = st_load(bytes(one.to_bytes()))  # any safetensors reader opens it
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    assert PolicyWeights.parse(one.to_bytes(), max_size=MAX).content_hash == one.content_hash


def _rewrite_header(raw: bytes, edit: object) -> bytes:
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header = edit(header) if callable(edit) else header
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text + raw[8 + n:]


def test_non_canonical_or_malformed_checkpoints_refused() -> None:
    sd = {"w": torch.randn(4, 4), "h": torch.randn(4).bfloat16()}
    raw = bytes(PolicyWeights.from_state_dict(sd).to_bytes())

    def swap_dtype(h: dict[str, Any]) -> dict[str, Any]:
        h["w"]["dtype"] = "I32"
        return h

    bad = [
        st_save(sd),  # safetensors' own writer: other metadata and spacing
        _rewrite_header(raw, None),  # same header, default json spacing
        _rewrite_header(raw, swap_dtype),
        raw + b"\x00",
        raw[:-1],
        raw[:7],
        struct.pack("<Q", 1 << 40) + raw[8:],
        raw[:8] + b"[" + raw[9:],
    ]
    for data in bad:
        with pytest.raises(ProtocolError):
            PolicyWeights.parse(data, max_size=MAX)
    with pytest.raises(ProtocolError, match="exceeds"):
        PolicyWeights.parse(raw, max_size=len(raw) - 1)


@given(st.binary(max_size=400))
@settings(max_examples=200, deadline=None)
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    for blob in (data, len(data).to_bytes(8, "little") + data):
        try:
            PolicyWeights.parse(blob, max_size=MAX)
        except ProtocolError:
            pass
    base = PolicyWeights.from_state_dict({"w": torch.zeros(4)})
    try:
        apply_delta(base, data, expected_hash=base.content_hash, max_size=MAX)
    except (ProtocolError, IntegrityError):
        pass


def _pair() -> tuple[PolicyWeights, PolicyWeights]:
    torch.manual_seed(3)
    base = {"w": torch.randn(256, 64), "v": torch.randn(4096)}
    target = {"w": base["w"] + 1e-3 * torch.randn(256, 64), "v": base["v"].clone()}
    target["v"][[3, 77]] += 1.0
    return PolicyWeights.from_state_dict(base), PolicyWeights.from_state_dict(target)


def _tamper(delta: bytes, which: str, /, **changes: object) -> bytes:
    """Re-encode ``delta`` with fields of tensor ``which`` replaced (what a hostile peer could send)."""
    d = codec.decode(delta, DeltaFile, max_size=MAX)
    tensors = [msgspec.structs.replace(t, **changes) if t.name == which else t for t in d.tensors]
    return codec.encode(msgspec.structs.replace(d, tensors=tensors))


def test_wrong_base_and_wrong_target_are_integrity_errors() -> None:
    base, target = _pair()
    delta = encode_delta(base, target)
    with pytest.raises(IntegrityError, match="applies to"):
        apply_delta(target, delta, expected_hash=target.content_hash, max_size=MAX)
    with pytest.raises(IntegrityError, match="leads to"):
        apply_delta(base, delta, expected_hash=base.content_hash, max_size=MAX)


def test_tampered_payload_is_caught_by_the_result_hash() -> None:
    base, target = _pair()
    delta = encode_delta(base, target)
    kinds = {t.name: t for t in read_delta(delta, max_size=MAX).tensors}
    assert kinds["v"].kind == "sparse" and kinds["w"].kind in DENSE_KINDS
    # A well-formed payload that encodes another change: same sizes, other bits.
    other = PolicyWeights.from_state_dict({"w": target.to_state_dict()["w"] * 1.0001,
                                        "v": target.to_state_dict()["v"]})
    forged_w = {t.name: t for t in read_delta(encode_delta(base, other), max_size=MAX).tensors}["w"]
    forged = _tamper(delta, "w", data=forged_w.data, kind=forged_w.kind, frames=forged_w.frames)
    with pytest.raises(IntegrityError, match="hashes to"):
        apply_delta(base, forged, expected_hash=target.content_hash, max_size=MAX)
    # Flipped bytes inside the compressed payload: a malformed frame or a wrong result, never a crash.
    for i in range(0, len(kinds["w"].data), max(1, len(kinds["w"].data) // 16)):
        data = bytearray(kinds["w"].data)
        data[i] ^= 0x40
        with pytest.raises((ProtocolError, IntegrityError)):
            apply_delta(base, _tamper(delta, "w", data=bytes(data)), expected_hash=target.content_hash,
                        max_size=MAX)


def test_hostile_deltas_refused_before_allocating() -> None:
    base, target = _pair()
    delta = encode_delta(base, target)
    h = target.content_hash
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * (1 << 22))  # 4 MiB of zeros in a few bytes
    cases = {
        "bomb": _tamper(delta, "w", data=bomb),
        "bomb as add": _tamper(delta, "w", kind="add", data=bomb),
        "count": _tamper(delta, "v", count=10**9),
        "zero count": _tamper(delta, "v", count=0),
        "kind on missing base": _tamper(delta, "w", name="zz", kind="xor"),
        "huge shape": _tamper(delta, "w", kind="raw", shape=[1 << 30, 1 << 8]),
        "bad dtype": _tamper(delta, "w", dtype="F8"),
        "negative dim": _tamper(delta, "w", shape=[-1, 64]),
    }
    for bad in cases.values():  # the keys say what each case breaks
        with pytest.raises((ProtocolError, IntegrityError)):
            apply_delta(base, bad, expected_hash=h, max_size=MAX)
    # Sparse positions beyond the tensor, or repeated.
    v = np.zeros(2, dtype="<u4")
    for gaps in ([0, 0], [4096, 1], [4095, 1]):
        v[:] = gaps
        payload = v.view(np.uint8).reshape(-1, 4).T.tobytes() + b"\x00" * 8
        bad = _tamper(delta, "v", count=2, data=zstandard.ZstdCompressor().compress(payload))
        with pytest.raises((ProtocolError, IntegrityError)):
            apply_delta(base, bad, expected_hash=h, max_size=MAX)
    # Exponent-grouped frames that do not match the groups the base implies.
    grouped = read_delta(encode_delta(base, target, dense=("add_by_exp",)), max_size=MAX)
    w = next(t for t in grouped.tensors if t.name == "w")
    assert w.kind == "add_by_exp" and len(w.frames) > 1
    g_delta = codec.encode(grouped)
    for changes in ({"frames": w.frames[:-1]}, {"frames": [*w.frames[:-1], w.frames[-1] + 1]},
                    {"frames": [0, *w.frames[1:]]}, {"kind": "add_by_exp", "dtype": "I32"},
                    {"frames": [len(bomb), *w.frames[1:]], "data": bomb + w.data[w.frames[0]:]}):
        bad = _tamper(g_delta, "w", **changes)
        with pytest.raises((ProtocolError, IntegrityError)):
            apply_delta(base, bad, expected_hash=h, max_size=MAX)
    # A tensor may not take the header's metadata key.
    with pytest.raises(ProtocolError, match="reserved"):
        apply_delta(base, _tamper(delta, "v", name="__metadata__"), expected_hash=h, max_size=MAX)
    # The names must be sorted and unique.
    d = read_delta(delta, max_size=MAX)
    swapped = codec.encode(msgspec.structs.replace(d, tensors=list(reversed(d.tensors))))
    with pytest.raises(ProtocolError, match="sorted"):
        apply_delta(base, swapped, expected_hash=h, max_size=MAX)
    with pytest.raises(ProtocolError, match="exceeds"):
        read_delta(delta, max_size=len(delta) - 1)
    with pytest.raises(ProtocolError, match="checkpoint of .* exceeds"):  # the result, before allocating
        apply_delta(base, delta, expected_hash=h, max_size=target.nbytes - 1)


def test_a_kind_memo_tries_the_last_winner_alone_and_the_deltas_still_apply() -> None:
    """``encode_delta(memo=)``: after the first delta, each tensor is encoded with the kind that won for
    it last time (one compression pass instead of one per kind); every ``refresh`` deltas all are tried
    again; every delta applies to its exact target whatever was tried."""
    from intellect_node.policy.delta import KindMemo

    versions = policy_versions(torch.float32, 6)
    names = list(versions[0].tensors)
    memo = KindMemo(refresh=3)
    tried: list[dict[str, tuple[str, ...]]] = []
    for a, b in zip(versions, versions[1:]):
        delta = encode_delta(a, b, memo=memo)
        tried.append(dict(memo.tried))
        held = apply_delta(a, delta, expected_hash=b.content_hash, max_size=MAX)
        assert bytes(held.to_bytes()) == bytes(b.to_bytes())
        assert set(memo.won) <= set(names) and all(k in DENSE_KINDS for k in memo.won.values())
    every = {n: DENSE_KINDS for n in names}
    assert tried[0] == every  # nothing known yet: every kind
    assert all(len(k) == 1 for k in tried[1].values())  # then each tensor's winner alone
    assert tried[3] == every  # every third delta tries them all again
    assert all(len(k) == 1 for k in tried[4].values())
