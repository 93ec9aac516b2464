"""Tagged-JSON values and length-prefixed frames between the checker and the worker.

A value is a JSON list `[tag, payload]`:

    ["none"]                 ["bool", true]           ["int", "-ff"]   (hex: no digit limit)
    ["float", "nan"]         ["str", "abc"]           ["bytes", "00ff"]
    ["list", [v, ...]]       ["tuple", [v, ...]]      ["set", [...]]   ["frozenset", [...]]
    ["dict", [[k, v], ...]]  ["iter", [v, ...]]       (an iterator: decoded as iter(list))

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON.

NOTE: this module also runs as text inside the sandbox children (see sources.py): it
imports only the standard library and does nothing at import time.
NOTE: `decode_value` only ever builds exact builtin types, so an object with a custom
`__eq__` cannot cross from the worker to the checker; nothing is ever pickled or eval'd.
"""
from __future__ import annotations

import collections.abc
import json
import numbers
import os

MAX_FRAME_BYTES = 16 << 20
MESSAGE_CHARS = 1000
READY = b"\x06"          # the checker's first byte on the verdict pipe: it is non-dumpable
_HEADER_BYTES = 4
_SEQUENCES = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


class CodecError(ValueError):
    """A value that cannot be encoded, or bytes that are not a valid frame or value."""


def encode_value(value: object) -> list:
    """Encode `value` as a tagged JSON tree; raises CodecError for unsupported types."""
    kind = type(value)
    if value is None:
        return ["none"]
    if kind is bool:
        return ["bool", value]
    if kind is int:
        return ["int", format(value, "x")]
    if kind is float:
        return ["float", repr(value)]
    if kind is str:
        return ["str", value]
    if kind in (bytes, bytearray):
        return ["bytes", bytes(value).hex()]
    if kind is dict:
        return ["dict", [[encode_value(k), encode_value(v)] for k, v in value.items()]]
    for tag, seq_type in _SEQUENCES.items():
        if kind is seq_type:
            return [tag, [encode_value(item) for item in value]]
    return _encode_other(value)


def _encode_other(value: object) -> list:
    """Subclasses of builtins, numpy-like scalars, iterators and set views (worker side)."""
    if isinstance(value, bool):
        return ["bool", bool(value)]
    if isinstance(value, numbers.Integral):
        return encode_value(int(value))
    if isinstance(value, numbers.Real):
        return encode_value(float(value))
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return encode_value(value.item())
    for base in (str, bytes, list, tuple, dict, set, frozenset):
        if isinstance(value, base):
            return encode_value(base(value))
    if isinstance(value, collections.abc.Iterator):
        return ["iter", [encode_value(item) for item in value]]
    if isinstance(value, collections.abc.Set):        # dict.keys(), dict.items()
        return ["frozenset", [encode_value(item) for item in value]]
    if isinstance(value, collections.abc.ValuesView):
        return ["iter", [encode_value(item) for item in value]]
    raise CodecError(f"unsupported return type {type(value).__name__}")


def decode_value(tree: object) -> object:
    """Rebuild a value from `encode_value`'s tree using exact builtin types only."""
    if type(tree) is not list or not tree or type(tree[0]) is not str:
        raise CodecError("malformed value")
    tag, payload = tree[0], tree[1:]
    if tag == "none" and not payload:
        return None
    if len(payload) != 1:
        raise CodecError(f"malformed {tag!r} value")
    return _decode_payload(tag, payload[0])


def _decode_payload(tag: str, data: object) -> object:
    kind = type(data)
    try:
        if tag == "bool" and kind is bool:
            return True if data else False
        if tag == "int" and kind is str:
            return int(data, 16)
        if tag == "float" and kind is str:
            return float(data)
        if tag == "str" and kind is str:
            return str(data)
        if tag == "bytes" and kind is str:
            return bytes.fromhex(data)
        if tag in _SEQUENCES and kind is list:
            return _SEQUENCES[tag](decode_value(item) for item in data)
        if tag == "iter" and kind is list:
            return iter([decode_value(item) for item in data])
        if tag == "dict" and kind is list:
            return dict(_decode_pair(pair) for pair in data)
    except CodecError:
        raise
    except (ValueError, TypeError, RecursionError, MemoryError) as exc:
        raise CodecError(f"bad {tag!r} value: {type(exc).__name__}") from None
    raise CodecError(f"unknown tag {tag!r}" if tag not in _KNOWN_TAGS else f"malformed {tag!r} value")


_KNOWN_TAGS = frozenset({"none", "bool", "int", "float", "str", "bytes", "iter", "dict", *_SEQUENCES})


def _decode_pair(pair: object) -> tuple:
    if type(pair) is not list or len(pair) != 2:
        raise CodecError("malformed dict item")
    return decode_value(pair[0]), decode_value(pair[1])


def error_line(exc: BaseException) -> str:
    """'Type: message' as on a traceback's last line (last line of the message), shortened."""
    try:
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    except Exception:
        lines = ["<unprintable message>"]
    name = type(exc).__name__
    return (f"{name}: {lines[-1].strip()}" if lines else name)[:MESSAGE_CHARS]


def write_frame(fd: int, message: object) -> None:
    """Write one JSON message as a frame; raises CodecError if it exceeds MAX_FRAME_BYTES."""
    data = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_FRAME_BYTES:
        raise CodecError(f"message of {len(data)} bytes exceeds the {MAX_FRAME_BYTES} byte frame limit")
    view = memoryview(len(data).to_bytes(_HEADER_BYTES, "big") + data)
    while view:
        view = view[os.write(fd, view):]


def read_frame(fd: int) -> object:
    """Read one frame; EOFError on a clean end of stream, CodecError on anything malformed."""
    header = _read_exact(fd, _HEADER_BYTES, eof_ok=True)
    size = int.from_bytes(header, "big")
    if size > MAX_FRAME_BYTES:
        raise CodecError(f"frame of {size} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    data = _read_exact(fd, size, eof_ok=False)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CodecError(f"frame is not JSON: {type(exc).__name__}") from None


def _read_exact(fd: int, size: int, eof_ok: bool) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            if eof_ok and left == size:
                raise EOFError("end of stream")
            raise CodecError("stream ended inside a frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
