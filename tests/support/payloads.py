"""Reading felixctl's escaped payloads back, for tests that check nothing is lost."""

from __future__ import annotations


def unescape_payload(line: bytes) -> bytes:
    """The inverse of :func:`felixctl.common.escape_payload` for a payload that was written escaped (one
    printed as it is has nothing to undo: tell them apart with ``-o json``)."""
    out = bytearray()
    i = 0
    reverse = {b"\\": b"\\", b"n": b"\n", b"t": b"\t", b"r": b"\r"}
    while i < len(line):
        byte = line[i:i + 1]
        code = line[i + 1:i + 2]
        if byte == b"\\" and code in reverse:
            out += reverse[code]
            i += 2
        elif byte == b"\\" and code == b"x" and _hex(line[i + 2:i + 4]):
            out.append(int(line[i + 2:i + 4], 16))
            i += 4
        elif byte == b"\\" and code == b"u" and _hex(line[i + 2:i + 6]):
            out += chr(int(line[i + 2:i + 6], 16)).encode("utf-8")
            i += 6
        else:
            out += byte
            i += 1
    return bytes(out)


def _hex(digits: bytes) -> bool:
    return len(digits) in (2, 4) and all(d in b"0123456789abcdefABCDEF" for d in digits)
