"""A lost rank's snapshot rebuilt from its group's XOR parity (``--snapshot-parity K``).

The parity of K neighbouring nodes' snapshots is kept in stripes on the nodes after them
(``placement``); a lost rank's share is the XOR of the stripes and of every other member's own
share (``parity``), checked against the fingerprints the lost rank sent with it.
``ask(rank, call)`` reaches rank ``rank``'s snapshot server (``Snapshots._ask``).
"""

from __future__ import annotations

from .image import StateImage
from .link import LinkError
from .parity import unstripe, xor_into


def rebuild_from_parity(ask, holders: list, group: int, of_rank: int, step: int, members: dict) -> tuple[StateImage, int]:
    """``of_rank``'s snapshot of ``step``, rebuilt from its group's parity (stripe ``j`` from
    ``holders[j]``) and the share of every other member that went into it (``members``:
    rank -> object names, from that rank's own local image). Checked against the
    fingerprints the lost rank sent with it: a wrong byte is an error, never a state.
    Returns the image and the bytes received for it."""
    parts, meta, moved = [], None, 0
    for j, holder in enumerate(holders):
        got = ask(holder, lambda client: client.get_stripe(group, of_rank, step))
        if got is None:
            raise LinkError(f"rank {holder} no longer keeps stripe {j} of the parity of rank {of_rank}'s group at step {step}")
        reply, data = got
        if (reply["stripe"], reply["stripes"]) != (j, len(holders)) or set(reply["members"]) != set(members) | {of_rank}:
            raise LinkError(f"rank {holder}'s parity stripe of step {step} is not the one the plan counted on")
        parts.append(data)
        meta, moved = reply["meta"], moved + data.numel()
    share = unstripe(parts, meta["nbytes"])
    for member, names in sorted(members.items()):
        own = ask(member, lambda client: client.get_own(step, names))
        if own is None:
            raise LinkError(f"rank {member} no longer holds its own snapshot of step {step}")
        xor_into(share, own.flat[: min(own.flat.numel(), share.numel())])
        moved += own.flat.numel()
    image = StateImage.from_wire(step, meta["skeleton"], share, meta["per_rank"], meta["modules"])
    rebuilt = image.fingerprints()
    if any(rebuilt[name] != want for name, want in meta["digests"].items()):
        raise LinkError(f"rank {of_rank}'s snapshot of step {step} rebuilt from parity does not match its fingerprints")
    return image, moved
