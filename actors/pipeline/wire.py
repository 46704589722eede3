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
    y = sum_raw([raw_a, raw_b], torch.float32, (T, D))   # several partial outputs, summed in order
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
_NUMPY_DTYPES = {d: torch.empty(0, dtype=d).numpy().dtype for d in DTYPES.values() if d != torch.bfloat16}

# small: bytes (length of the pickled header, the header, padding, the tensors);
# large: (header, payload array); header = (tag, entries), one (dtype name, shape, byte offset) or
# None per tensor
Bundle = bytes | tuple[tuple, np.ndarray]
_PREFIX = 4  # little-endian length of the pickled header


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(*tensors: torch.Tensor | None, tag: int | None = None) -> Bundle:
    entries, chunks, offset = [], [], 0
    for t in tensors:
        if t is None:
            entries.append(None)
            continue
        name = str(t.dtype).removeprefix("torch.")
        assert name in DTYPES, f"no wire format for {t.dtype}"
        entries.append((name, tuple(t.shape), offset))
        data = _numpy(t)
        chunks.append(data)
        offset += _aligned(data.nbytes)
    header = (tag, tuple(entries))
    if offset > SMALL_PAYLOAD_BYTES:
        buf = np.empty(offset, dtype=np.uint8)
        for data, entry in zip(chunks, (e for e in entries if e is not None)):
            buf[entry[2] : entry[2] + data.nbytes] = data.reshape(-1).view(np.uint8)
        return header, buf
    head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    parts = [len(head).to_bytes(_PREFIX, "little"), head, _padding(_PREFIX + len(head))]
    for data in chunks:  # numpy calls, not torch ops: a small bundle is all per-call overhead
        parts += [data.tobytes(), _padding(data.nbytes)]
    return b"".join(parts)


def _numpy(t: torch.Tensor) -> np.ndarray:
    """t's elements as a numpy array sharing its memory where it can (bf16 as int16: numpy has no bf16)."""
    if t.requires_grad or t.device.type != "cpu":
        t = t.detach().cpu()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _padding(n: int) -> bytes:
    return bytes(_aligned(n) - n)


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
        out.append(_tensor(buf[base + start : base + start + n], dtype, shape))
    return tag, out


def pack_raw(t: torch.Tensor) -> bytes | np.ndarray:
    """A tensor's bytes alone, for a receiver that knows its dtype and shape (an expert shard's
    partial output: no header to pickle and read per call); a numpy array above
    SMALL_PAYLOAD_BYTES, which Ray passes out of band."""
    data = _numpy(t)
    return data.tobytes() if data.nbytes <= SMALL_PAYLOAD_BYTES else np.ascontiguousarray(data)


def unpack_raw(payload: bytes | np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    """pack_raw's tensor, writable and sharing nothing with the sender."""
    return _tensor(_own_bytes(payload), dtype, shape)


def sum_raw(payloads: list, dtype: torch.dtype, shape) -> torch.Tensor:
    """The sum, in order, of pack_raw payloads of one dtype and shape -> a new tensor (read in place:
    no writable copy of each)."""
    assert payloads and dtype in _NUMPY_DTYPES, (len(payloads), dtype)
    np_dtype = _NUMPY_DTYPES[dtype]
    if len(payloads) == 1:
        return unpack_raw(payloads[0], dtype, shape)
    total = np.frombuffer(payloads[0], np_dtype) + np.frombuffer(payloads[1], np_dtype)
    for payload in payloads[2:]:
        total += np.frombuffer(payload, np_dtype)
    return torch.from_numpy(total.reshape(shape))


def _own_bytes(payload: bytes | np.ndarray) -> np.ndarray:
    """A writable uint8 copy of a received payload (Ray hands out read-only buffers)."""
    return np.frombuffer(bytearray(payload), dtype=np.uint8)


def _tensor(data: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    """uint8 bytes [n] -> a tensor of dtype and shape on them (numpy views and one from_numpy:
    fewer dispatched ops than slicing a uint8 tensor)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(data.view(np.int16).reshape(shape)).view(torch.bfloat16)
    return torch.from_numpy(data.view(_NUMPY_DTYPES[dtype]).reshape(shape))

