"""Tensors across actor calls as one bundle per call. A small bundle is one bytes object: a
length-prefixed pickled header (per tensor: dtype name, shape, byte offset, or None) and then every
tensor (8-byte aligned). A pickled torch tensor costs ~1 ms on receipt and each separately pickled
object ~0.1 ms per call (measured), which dominated the small per-layer MoE calls; Ray passes one
bytes argument cheapest of all (a fan-out to two actors: 1.0 ms with one bytes argument against
1.2 ms with an int and a (header tuple, bytes) pair, measured). Payloads above
SMALL_PAYLOAD_BYTES travel as (header, numpy array) instead (zero-copy out-of-band in Ray), so large
prefill activations are not copied into bytes. Every dtype is bit-exact (bf16 included).

    bundle = pack(hidden, bank)           # None allowed: it comes back as None
    hidden, bank = unpack(bundle)
    bundle = pack(h, ids, weights, tag=layer_idx)   # a small int in the header: one argument per call
    layer_idx, (h, ids, weights) = unpack_tagged(bundle)
    raw = pack_raw(y)                     # one tensor whose dtype and shape the receiver knows
    y = unpack_raw(raw, torch.float32, (T, D))
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import torch

SMALL_PAYLOAD_BYTES = 1 << 20
ALIGN = 8  # every tensor starts at a multiple of the widest element size
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
)}

# small: bytes (length of the pickled header, the header, padding, the tensors);
# large: (header, payload array); header = (tag, entries), one (dtype name, shape, byte offset) or
# None per tensor
Bundle = bytes | tuple[tuple, np.ndarray]
_PREFIX = 4  # little-endian length of the pickled header


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(*tensors: torch.Tensor | None, tag: int | None = None) -> Bundle:
    entries, offset = [], 0
    for t in tensors:
        if t is None:
            entries.append(None)
            continue
        name = str(t.dtype).removeprefix("torch.")
        assert name in DTYPES, f"no wire format for {t.dtype}"
        entries.append((name, tuple(t.shape), offset))
        offset += _aligned(t.numel() * t.element_size())
    entries = tuple(entries)
    header = (tag, entries)
    if offset > SMALL_PAYLOAD_BYTES:
        buf = torch.empty(offset, dtype=torch.uint8)
        _copy_in(buf, 0, tensors, entries)
        return header, buf.numpy()
    head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    base = _aligned(_PREFIX + len(head))
    out = bytearray(base + offset)
    out[:_PREFIX] = len(head).to_bytes(_PREFIX, "little")
    out[_PREFIX : _PREFIX + len(head)] = head
    _copy_in(torch.frombuffer(out, dtype=torch.uint8), base, tensors, entries)
    return bytes(out)


def _copy_in(buf: torch.Tensor, base: int, tensors, entries) -> None:
    for t, entry in zip(tensors, entries):
        if entry is not None and t.numel():
            start = base + entry[2]
            buf[start : start + t.numel() * t.element_size()].view(t.dtype).copy_(t.detach().reshape(-1))


def unpack(bundle: Bundle) -> list[torch.Tensor | None]:
    """Writable tensors that share nothing with the sender (Ray hands out read-only buffers)."""
    return unpack_tagged(bundle)[1]


def unpack_tagged(bundle: Bundle) -> tuple[int | None, list[torch.Tensor | None]]:
    """(the tag given to pack, the tensors as unpack returns them)."""
    if isinstance(bundle, tuple):
        header, payload = bundle
        base = 0
    else:
        payload = bundle
        size = int.from_bytes(payload[:_PREFIX], "little")
        header = pickle.loads(payload[_PREFIX : _PREFIX + size])
        base = _aligned(_PREFIX + size)
    buf = _own_bytes(payload)
    tag, entries = header
    out: list[torch.Tensor | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        name, shape, start = entry
        dtype = DTYPES[name]
        n = math.prod(shape) * dtype.itemsize  # np.prod cost ~10 us a tensor, in a 0.1 ms call
        out.append(buf[base + start : base + start + n].view(dtype).view(shape))
    return tag, out


def pack_raw(t: torch.Tensor) -> bytes | np.ndarray:
    """A tensor's bytes alone, for a receiver that knows its dtype and shape (an expert shard's
    partial output: no header to pickle and read per call); a numpy array above
    SMALL_PAYLOAD_BYTES, which Ray passes out of band."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
    return data.numpy().tobytes() if data.numel() <= SMALL_PAYLOAD_BYTES else data.numpy()


def unpack_raw(payload: bytes | np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    """pack_raw's tensor, writable and sharing nothing with the sender."""
    return _own_bytes(payload).view(dtype).view(shape)


def _own_bytes(payload: bytes | np.ndarray) -> torch.Tensor:
    """A writable uint8 copy of a received payload (Ray hands out read-only buffers)."""
    if not len(payload):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)
