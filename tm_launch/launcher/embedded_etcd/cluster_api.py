"""etcd's member list, add and remove, over the v3 HTTP gateway: the I/O ``decisions`` reads.

Plain urllib against the endpoints the layout gives (the first one that answers is asked), so
nothing here needs a client library or a KV session, and each member's liveness is its own
answer on its client URL (``/version``), not the cluster's opinion of it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from .decisions import Member


class ClusterError(RuntimeError):
    """No endpoint answered, or etcd refused a change (one line: what and why)."""


def _post(url: str, payload: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def answers(client_url: str, timeout: float = 1.0) -> bool:
    """True when an etcd process serves this client URL (it may still be catching up)."""
    try:
        with urllib.request.urlopen(client_url + "/version", timeout=timeout) as r:
            return b"etcdserver" in r.read()
    except (urllib.error.URLError, OSError, ValueError):
        return False


class ClusterAPI:
    """Member changes of the cluster behind ``endpoints`` (each tried in turn)."""

    def __init__(self, endpoints: Sequence[str], timeout: float = 2.0):
        self.endpoints = tuple(endpoints)
        self.timeout = timeout

    def _call(self, path: str, payload: dict) -> dict:
        errors = []
        for endpoint in self.endpoints:
            try:
                return _post(endpoint + path, payload, self.timeout)
            except urllib.error.HTTPError as e:  # etcd answered and refused: not worth asking another
                body = e.read().decode(errors="replace")[:300]
                raise ClusterError(f"etcd at {endpoint} refused {path}: HTTP {e.code} {body}") from None
            except (urllib.error.URLError, OSError, ValueError) as e:
                errors.append(f"{endpoint}: {getattr(e, 'reason', e)}")
        raise ClusterError(f"no etcd member answered {path} ({'; '.join(errors[:3])}{' ...' if len(errors) > 3 else ''})")

    def members(self, probe: bool = True) -> list[Member] | None:
        """The member list, each member probed on its client URL (``probe``); None when no
        endpoint answers (no cluster yet, or none of it reachable)."""
        try:
            listed = self._call("/v3/cluster/member/list", {}).get("members", [])
        except ClusterError:
            return None
        return [
            Member(
                id=str(m["ID"]),
                name=m.get("name", ""),
                peer_urls=tuple(m.get("peerURLs", ())),
                answering=probe and any(answers(u) for u in m.get("clientURLs", ())),
                client_urls=tuple(m.get("clientURLs", ())),
            )
            for m in listed
        ]

    def remove(self, member_id: str) -> None:
        self._call("/v3/cluster/member/remove", {"ID": member_id})

    def add(self, peer_url: str, patience: float = 30.0) -> list[tuple[str, ...]]:
        """Add a member at ``peer_url``; the peer URLs of every member after the change (the new
        member's ``--initial-cluster``, each named by ``layout.node_of``). etcd refuses an add
        ("unhealthy cluster") until its members have been connected for a few seconds, as they
        have not right after a ``remove``: that refusal is waited out for up to ``patience`` s."""
        deadline = time.monotonic() + patience
        while True:
            try:
                out = self._call("/v3/cluster/member/add", {"peerURLs": [peer_url]})
                return [tuple(m.get("peerURLs", ())) for m in out.get("members", [])]
            except ClusterError as e:
                if "unhealthy cluster" not in str(e) or time.monotonic() > deadline:
                    raise
            time.sleep(1.0)
