"""The snapshot stream between a rank and its holder: a TCP connection of its own.

Why not the job's communicators: a snapshot stream runs beside the step (a background thread
sends while the main thread runs the step's collectives), outlives generations (a holder keeps
what it holds while communicators are rebuilt), and needs acknowledgements and timeouts that a
blocking gloo ``recv`` cannot give (a posted receive can be neither cancelled nor bounded from
Python). A plain socket per pair gives all three; its bytes go straight from the image's host
tensors to the holder's (``recv_into`` a tensor's memory: no Python copy).

Messages: an 8-byte length and a pickled header, then the image's tensors' raw bytes in
placeholder order, each padded to ``transfer.ALIGN`` (the layout of the image's host buffer, so the
sender sends a few contiguous pieces of it and the receiver reads into one buffer with one
``recv_into`` loop; the header says how many bytes follow). Every put is acknowledged once
stored, so a sender knows its snapshot is complete on the holder (what the next step's commit
waits for), and says from which step on the holder must keep what it holds (the oldest the job
may return to); the holder answers gets for the rank that replaces a lost one. The header is pickled, as the live transfer's is: peers of one job trust
each other as they do through gloo and the TCPStore (bind to the node's own address).
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import struct
import threading

import torch

from .image import StateImage, host_tensors, specs_of, wire_size
from .parity import xor_into

_LEN = struct.Struct("!Q")
PUT_IMAGE, PUT_MIRROR, GET_IMAGE, GET_MIRROR, ACK, MISSING, IMAGE, MIRROR = (
    "put_image",
    "put_mirror",
    "get_image",
    "get_mirror",
    "ack",
    "missing",
    "image",
    "mirror",
)
PUT_STRIPE, GET_STRIPE, GET_OWN, STRIPE = "put_stripe", "get_stripe", "get_own", "stripe"  # ``--snapshot-parity``
KEEP_MIRRORS = 4  # per-rank mirrors kept per source: the tags from the oldest step the job can return to on


class LinkError(RuntimeError):
    """The other end is gone or broke the protocol."""


def _send_msg(sock: socket.socket, header: dict, image: StateImage | None = None) -> None:
    data = pickle.dumps(header)
    sock.sendall(_LEN.pack(len(data)) + data)
    if image is not None:
        for chunk in image.wire_chunks():
            sock.sendall(chunk)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise LinkError("the connection closed mid-message")
        got += k
    return bytes(buf)


def _recv_into(sock: socket.socket, t: torch.Tensor) -> None:
    if not t.numel():
        return
    view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise LinkError("the connection closed mid-snapshot")
        got += k


def _recv_msg(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return pickle.loads(_recv_exact(sock, n))


def _recv_image(sock: socket.socket, header: dict, reuse: StateImage | None = None) -> StateImage:
    specs = specs_of(header["skeleton"])
    if wire_size(specs) != header["nbytes"]:
        raise LinkError(f"a snapshot's header announces {header['nbytes']} bytes for tensors of {wire_size(specs)}")
    if reuse is not None and reuse.flat is not None and reuse.specs == specs:
        flat, tensors, spans = reuse.flat, reuse.tensors, reuse.spans
    else:
        flat, tensors, spans = host_tensors(specs)
    _recv_into(sock, flat)
    return StateImage(
        header["step"], header["skeleton"], tensors, {}, header.get("per_rank"), frozenset(header.get("modules", ())), flat, spans
    )


def _image_header(kind: str, source: int, image: StateImage) -> dict:
    return {
        "kind": kind,
        "source": source,
        "step": image.step,
        "skeleton": image.skeleton,
        "modules": sorted(image.modules),
        "per_rank": image.per_rank,
        "nbytes": wire_size(image.specs),
    }


class Held:
    """What a holder keeps of one source rank: its complete images from the oldest step the job
    may return to (the sender says which: ``Snapshots.kept_images``) and its newest per-rank
    mirrors."""

    def __init__(self):
        self.images: dict[int, StateImage] = {}
        self.mirrors: dict[int, tuple[bool, bytes]] = {}  # tag -> (exact, record)

    def take_spare(self, keep_from: int) -> StateImage | None:
        """An image from before ``keep_from``, taken out: the arriving one may use its buffers."""
        older = sorted(s for s in self.images if s < keep_from)
        for s in older[:-1]:
            del self.images[s]
        return self.images.pop(older[-1]) if older else None

    def keep_image(self, image: StateImage, keep_from: int) -> None:
        self.images[image.step] = image
        for old in [s for s in self.images if s < min(keep_from, image.step)]:
            del self.images[old]

    def keep_mirror(self, tag: int, exact: bool, record: bytes) -> None:
        self.mirrors[tag] = (exact, record)
        for old in sorted(self.mirrors)[:-KEEP_MIRRORS]:
            del self.mirrors[old]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.images.values()) + sum(len(r) for _, r in self.mirrors.values())


class ParityHeld:
    """One stripe of a group's parity (``--snapshot-parity``), per step: the XOR of the members'
    stripes that arrived, and each such member's description (its objects, its per-rank state,
    its share's size: what the rank replacing it needs besides the bytes). A member's stripe
    goes in once per step: a second one (the same step sent again after a recovery) is the
    same bytes and is not XORed again."""

    def __init__(self, stripe: int, stripes: int):
        self.stripe, self.stripes = stripe, stripes
        self.parity: dict[int, torch.Tensor] = {}  # step -> XOR of the members' stripes (uint8)
        self.members: dict[int, dict[int, dict]] = {}  # step -> member rank -> its description

    def has(self, step: int, source: int) -> bool:
        return source in self.members.get(step, {})

    def add(self, step: int, source: int, meta: dict, data: torch.Tensor, keep_from: int) -> None:
        spare = None
        for old in [s for s in self.parity if s < min(keep_from, step)]:
            spare = self.parity.pop(old)
            del self.members[old]
        buf = self.parity.get(step)
        if buf is None and spare is not None and spare.numel() == data.numel():
            buf = self.parity[step] = spare.zero_()  # a steady state allocates nothing
        if buf is None or buf.numel() < data.numel():
            grown = torch.zeros(max(data.numel(), 0 if buf is None else buf.numel()), dtype=torch.uint8)
            if buf is not None:
                grown[: buf.numel()] = buf
            buf = self.parity[step] = grown
        xor_into(buf, data)
        self.members.setdefault(step, {})[source] = meta

    def drop_after(self, step: int) -> None:
        for later in [s for s in self.parity if s > step]:
            del self.parity[later], self.members[later]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.parity.values())


class SnapshotServer:
    """A worker's holder side: keeps the snapshots its source rank sends, answers the rank that
    replaces a lost one. One listening socket per worker process, a thread per connection."""

    def __init__(self, host: str | None = None):
        family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host or "127.0.0.1", 0))
        self._sock.listen(64)
        self.address = (host or "127.0.0.1", self._sock.getsockname()[1])
        self._lock = threading.Lock()
        self._held: dict[int, Held] = {}
        self._stripes: dict[int, ParityHeld] = {}  # group (its first rank) -> the stripe of its parity kept here
        self.own_image = lambda step: None  # step -> this worker's own local image (``Snapshots`` sets it): ``GET_OWN``
        self._conns: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name="tm-snapshot-server", daemon=True).start()

    def close(self) -> None:
        """Stop serving: the listening socket and every connection close, as when the process ends."""
        self._closed = True
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for sock in [self._sock, *conns]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass

    def held(self) -> dict[int, dict]:
        """Source rank -> {"images": {step: object names}, "mirrors": {tag: exact}}."""
        with self._lock:
            return {
                src: {"images": {s: tuple(i.names()) for s, i in h.images.items()}, "mirrors": {t: e for t, (e, _) in h.mirrors.items()}}
                for src, h in self._held.items()
            }

    def stripes_held(self) -> dict[tuple, dict]:
        """(group, stripe, stripes) -> {step: {member rank: its object names}}: the parity kept here."""
        with self._lock:
            return {
                (g, p.stripe, p.stripes): {s: {src: tuple(m["names"]) for src, m in ms.items()} for s, ms in p.members.items()}
                for g, p in self._stripes.items()
            }

    def keep_only(self, sources, stripes=()) -> None:
        """Drop what this worker holds for ranks that no longer send to it, and the parity of
        groups (``stripes``: (group, stripe, stripes)) it no longer keeps."""
        with self._lock:
            for src in [s for s in self._held if s not in set(sources)]:
                del self._held[src]
            keep = {g: (j, h) for g, j, h in stripes}
            for g in [g for g, p in self._stripes.items() if keep.get(g) != (p.stripe, p.stripes)]:
                del self._stripes[g]
            for g, (j, h) in keep.items():
                self._stripes.setdefault(g, ParityHeld(j, h))

    def drop_images_before(self, step: int) -> None:
        """Forget whole images of steps before ``step`` (with parity, the copy a drained rank
        handed over, once the job is past it)."""
        with self._lock:
            for held in self._held.values():
                for old in [s for s in held.images if s < step]:
                    del held.images[old]

    def drop_after(self, step: int) -> None:
        """Forget images and mirrors of steps after ``step`` (the job returned to ``step``)."""
        with self._lock:
            for held in self._held.values():
                for later in [s for s in held.images if s > step]:
                    del held.images[later]
                for later in [t for t in held.mirrors if t > step]:
                    del held.mirrors[later]
            for parity in self._stripes.values():
                parity.drop_after(step)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(h.nbytes for h in self._held.values()) + sum(p.nbytes for p in self._stripes.values())

    def image(self, source: int, step: int) -> StateImage | None:
        with self._lock:
            held = self._held.get(source)
            return None if held is None else held.images.get(step)

    def mirror(self, source: int, tag: int) -> tuple[bool, bytes] | None:
        with self._lock:
            held = self._held.get(source)
            return None if held is None else held.mirrors.get(tag)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="tm-snapshot-conn", daemon=True).start()

    def _put_stripe(self, conn: socket.socket, header: dict, scratch: list) -> dict:
        """A member's stripe of a step: XORed into the parity once (a second copy is drained)."""
        length = header["length"]
        if length % 8:
            raise LinkError(f"a parity stripe of {length} bytes (not whole 8-byte words)")
        if scratch[0] is None or scratch[0].numel() < length:
            scratch[0] = torch.empty(length, dtype=torch.uint8)
        data = scratch[0][:length]
        _recv_into(conn, data)
        group, step, source = header["group"], header["step"], header["source"]
        with self._lock:
            parity = self._stripes.get(group)
            if parity is None or (parity.stripe, parity.stripes) != (header["stripe"], header["stripes"]):
                return {"kind": MISSING, "step": step}  # not (any more) this group's holder of that stripe
            if not parity.has(step, source):
                parity.add(step, source, header["meta"], data, header["keep_from"])
        return {"kind": ACK, "step": step}

    def _get_stripe(self, conn: socket.socket, header: dict) -> None:
        with self._lock:
            parity = self._stripes.get(header["group"])
            members = {} if parity is None else parity.members.get(header["step"], {})
            if header["source"] not in members:
                data = None
            else:
                data = parity.parity[header["step"]].clone()  # a copy: the holder may go on XORing
                reply = {
                    "kind": STRIPE,
                    "stripe": parity.stripe,
                    "stripes": parity.stripes,
                    "meta": members[header["source"]],
                    "members": {src: tuple(m["names"]) for src, m in members.items()},
                    "length": data.numel(),
                }
        if data is None:
            _send_msg(conn, {"kind": MISSING})
            return
        _send_msg(conn, reply)
        conn.sendall(memoryview(data.numpy()))

    def _serve(self, conn: socket.socket) -> None:
        scratch: list = [None]  # this connection's buffer for arriving stripes
        try:
            while not self._closed:
                header = _recv_msg(conn)
                kind, source = header["kind"], header["source"]
                if kind == PUT_IMAGE:
                    keep_from = header.get("keep_from", header["step"])
                    with self._lock:
                        spare = self._held.setdefault(source, Held()).take_spare(keep_from)
                    image = _recv_image(conn, header, reuse=spare)
                    with self._lock:
                        self._held.setdefault(source, Held()).keep_image(image, keep_from)
                    _send_msg(conn, {"kind": ACK, "step": image.step})
                elif kind == PUT_MIRROR:
                    with self._lock:
                        self._held.setdefault(source, Held()).keep_mirror(header["tag"], header["exact"], header["record"])
                    _send_msg(conn, {"kind": ACK, "tag": header["tag"]})
                elif kind == GET_IMAGE:
                    image = self.image(source, header["step"])
                    if image is None:
                        _send_msg(conn, {"kind": MISSING})
                    else:
                        image = image.subset(header["names"]) if header.get("names") is not None else image
                        _send_msg(conn, _image_header(IMAGE, source, image), image)
                elif kind == PUT_STRIPE:
                    _send_msg(conn, self._put_stripe(conn, header, scratch))
                elif kind == GET_STRIPE:
                    self._get_stripe(conn, header)
                elif kind == GET_OWN:
                    own = self.own_image(header["step"])
                    if own is None or not set(header["names"]) <= set(own.skeleton):
                        _send_msg(conn, {"kind": MISSING})
                    else:
                        own = own.subset(header["names"])
                        _send_msg(conn, _image_header(IMAGE, source, own), own)
                elif kind == GET_MIRROR:
                    found = self.mirror(source, header["tag"])
                    _send_msg(conn, {"kind": MISSING} if found is None else {"kind": MIRROR, "exact": found[0], "record": found[1]})
                else:
                    raise LinkError(f"unknown message {kind!r}")
        except (OSError, LinkError, EOFError, pickle.UnpicklingError, KeyError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()


class SnapshotClient:
    """One connection to a holder's ``SnapshotServer``; every call waits for the answer."""

    def __init__(self, address: tuple[str, int], source: int, timeout: float = 30.0):
        self.address, self.source = tuple(address), source
        try:
            self._sock = socket.create_connection(self.address, timeout=timeout)
        except OSError as e:
            raise LinkError(f"the snapshot holder at {self.address[0]}:{self.address[1]} does not answer ({e})") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(timeout)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    @contextlib.contextmanager
    def _talking(self):
        """A broken connection or message is the holder gone (``LinkError``)."""
        try:
            yield
        except (OSError, EOFError, pickle.UnpicklingError) as e:
            raise LinkError(f"the snapshot holder at {self.address[0]}:{self.address[1]} is gone ({e})") from None

    def _call(self, header: dict, image: StateImage | None = None) -> dict:
        with self._talking():
            _send_msg(self._sock, header, image)
            return _recv_msg(self._sock)

    def put_image(self, image: StateImage, keep_from: int) -> None:
        """Send ``image`` and wait until the holder stored it; the holder keeps what it holds of
        this source from step ``keep_from`` on."""
        reply = self._call({**_image_header(PUT_IMAGE, self.source, image), "keep_from": keep_from}, image)
        if reply.get("kind") != ACK or reply.get("step") != image.step:
            raise LinkError(f"the snapshot holder answered {reply.get('kind')!r} to a snapshot")

    def put_mirror(self, tag: int, exact: bool, record: bytes) -> None:
        reply = self._call({"kind": PUT_MIRROR, "source": self.source, "tag": tag, "exact": exact, "record": record})
        if reply.get("kind") != ACK or reply.get("tag") != tag:
            raise LinkError(f"the snapshot holder answered {reply.get('kind')!r} to a per-rank mirror")

    def get_image(self, of_rank: int, step: int, names=None) -> StateImage | None:
        with self._talking():
            _send_msg(self._sock, {"kind": GET_IMAGE, "source": of_rank, "step": step, "names": names})
            header = _recv_msg(self._sock)
            if header.get("kind") == MISSING:
                return None
            return _recv_image(self._sock, header)

    def put_stripe(self, group: int, stripe: int, stripes: int, step: int, meta: dict, pieces: list, keep_from: int) -> bool:
        """Send stripe ``stripe`` of this rank's share of ``step`` (``pieces``: memoryviews) into
        ``group``'s parity; False when the holder does not keep that stripe (a stale placement)."""
        header = {
            "kind": PUT_STRIPE,
            "source": self.source,
            "group": group,
            "stripe": stripe,
            "stripes": stripes,
            "step": step,
            "meta": meta,
            "keep_from": keep_from,
            "length": sum(len(p) for p in pieces),
        }
        with self._talking():
            _send_msg(self._sock, header)
            for piece in pieces:
                self._sock.sendall(piece)
            reply = _recv_msg(self._sock)
        if reply.get("kind") not in (ACK, MISSING) or reply.get("step") != step:
            raise LinkError(f"the parity holder answered {reply.get('kind')!r} to a stripe")
        return reply["kind"] == ACK

    def get_stripe(self, group: int, of_rank: int, step: int) -> tuple[dict, torch.Tensor] | None:
        """The stripe of ``group``'s parity of ``step`` kept there, if ``of_rank`` went into it:
        (the reply's header: stripe, stripes, ``of_rank``'s description, every member's names;
        the parity bytes)."""
        with self._talking():
            _send_msg(self._sock, {"kind": GET_STRIPE, "source": of_rank, "group": group, "step": step})
            reply = _recv_msg(self._sock)
            if reply.get("kind") == MISSING:
                return None
            data = torch.empty(reply["length"], dtype=torch.uint8)
            _recv_into(self._sock, data)
            return reply, data

    def get_own(self, step: int, names) -> StateImage | None:
        """The rank's own local image of ``step`` (objects ``names``): a parity member's share."""
        with self._talking():
            _send_msg(self._sock, {"kind": GET_OWN, "source": self.source, "step": step, "names": sorted(names)})
            header = _recv_msg(self._sock)
            if header.get("kind") == MISSING:
                return None
            return _recv_image(self._sock, header)

    def get_mirror(self, of_rank: int, tag: int) -> tuple[bool, bytes] | None:
        reply = self._call({"kind": GET_MIRROR, "source": of_rank, "tag": tag})
        return None if reply.get("kind") == MISSING else (reply["exact"], reply["record"])
