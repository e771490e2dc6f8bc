"""XOR parity of snapshots, cut in stripes (pure byte arithmetic, table-tested).

A snapshot's share travels as bytes (``StateImage.wire_chunks``: its tensors, each padded to
``transfer.ALIGN``). Its bytes are cut in chunks of ``CHUNK`` dealt round-robin over the group's
stripe holders: stripe ``j`` is chunks ``j, j + h, j + 2h, ...`` (``stripe``). A holder keeps,
per step, the XOR of every member's stripe (shorter ones count as zeros past their end) and
which members went into it. A lost member's bytes are the XOR of the parity and every other
member that went into it (``rebuild``): the order does not matter, the set does.

Every length here is a multiple of ``transfer.ALIGN`` (64 bytes), so XOR runs on 8-byte words.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 16  # bytes of a share dealt to one stripe holder before the next (a multiple of 64): small, so stripes stay even


def stripe(chunks, j: int, h: int, unit: int = CHUNK) -> list[memoryview]:
    """The pieces of a share (``chunks``: memoryviews of its bytes, in order) that make stripe
    ``j`` of ``h``: bytes ``[i * unit, (i + 1) * unit)`` for every ``i`` with ``i % h == j``."""
    out: list[memoryview] = []
    pos = 0
    for c in chunks:
        c = memoryview(c).cast("B")
        at = 0
        while at < len(c):
            index, into = divmod(pos, unit)
            take = min(unit - into, len(c) - at)
            if index % h == j:
                out.append(c[at : at + take])
            at += take
            pos += take
    return out


def xor_into(acc: torch.Tensor, data: torch.Tensor) -> None:
    """``acc[:len(data)] ^= data`` (uint8 tensors, lengths multiples of 8), in place."""
    n = data.numel()
    if n > acc.numel():
        raise ValueError(f"a stripe of {n} bytes does not fit a parity of {acc.numel()}")
    if n:
        acc[:n].view(torch.int64).bitwise_xor_(data.view(torch.int64))


def unstripe(stripes: list[torch.Tensor], total: int, unit: int = CHUNK) -> torch.Tensor:
    """The share of ``total`` bytes whose stripes are ``stripes`` (each at least as long as the
    share's own stripe: a parity stripe is as long as its longest member's)."""
    h = len(stripes)
    out = torch.empty(total, dtype=torch.uint8)
    for index in range(-(-total // unit)):
        j, row = index % h, index // h
        a, b = index * unit, min((index + 1) * unit, total)
        out[a:b] = stripes[j][row * unit : row * unit + (b - a)]
    return out
