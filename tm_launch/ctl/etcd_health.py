"""The job's etcd as ``ctl status`` shows it: each member, whether it answers, which one leads.

An etcd of three members keeps working while one is away; the operator should see that it is
down to two before the next loss takes the rendezvous with it. Each ``--rdzv-endpoint`` is asked
for its own status (etcd's v3 ``/v3/maintenance/status`` through the gateway; where that path is
missing, v2's ``/v2/stats/self``), and the first that answers for the member list
(``/v3/cluster/member/list``, else v2's ``/v2/members``), so a member the endpoints do not name
is listed too. ``members()`` is the pure part (table-tested); ``etcd_members`` the HTTP adapter.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class Answer:
    """What one endpoint said about itself: its member id, the leader's id, its etcd version."""

    endpoint: str
    member_id: str | None  # None: it did not answer
    leader_id: str | None = None
    version: str = ""
    error: str = ""


@dataclass(frozen=True)
class Member:
    """One member of the cluster's member list: its id, name and client URLs."""

    id: str
    name: str
    client_urls: tuple[str, ...]


def members(listed: list[Member], answers: list[Answer]) -> list[dict]:
    """One row per member (the member list's, in the endpoints' order; then endpoints that name
    no listed member, those that do not answer only while there is no list):
    ``{"name", "id", "endpoint", "answers", "leader", "version", "error"}``. A member answers when
    one endpoint's status came from it; the leader is the one the answering members name."""
    by_id = {a.member_id: a for a in answers if a.member_id}
    leaders = {a.leader_id for a in answers if a.member_id and a.leader_id and a.leader_id != "0"}
    leader = next(iter(leaders)) if len(leaders) == 1 else None  # members that disagree: no one is shown as leader
    asked_at = {a.endpoint: i for i, a in enumerate(answers)}
    order = {m.id: min([asked_at[u] for u in m.client_urls if u in asked_at], default=len(answers)) for m in listed}
    rows, shown = [], set()
    for m in sorted(listed, key=lambda m: order[m.id]):  # in --rdzv-endpoint's order, then the others
        said = by_id.get(m.id)
        asked = next((a for a in answers if a.endpoint in m.client_urls), None)
        endpoint = said.endpoint if said else asked.endpoint if asked else (m.client_urls[0] if m.client_urls else "")
        shown.add(endpoint)
        rows.append(
            {
                "name": m.name,
                "id": m.id,
                "endpoint": endpoint,
                "answers": said is not None,
                "leader": m.id == leader,
                "version": said.version if said else "",
                "error": "" if said else (asked.error if asked else "not asked (not in --rdzv-endpoint)"),
            }
        )
    for a in answers:
        if listed and a.member_id is None:
            continue  # the list is known and this endpoint is none of it: a node with no member (the embedded etcd names every node)
        if a.endpoint not in shown and (a.member_id is None or a.member_id not in {m.id for m in listed}):
            rows.append(
                {
                    "name": "",
                    "id": a.member_id or "",
                    "endpoint": a.endpoint,
                    "answers": a.member_id is not None,
                    "leader": a.member_id is not None and a.member_id == leader,
                    "version": a.version,
                    "error": a.error,
                }
            )
    return rows


def summary(rows: list[dict]) -> str:
    """``etcd: 2 of 3 members answer, leader tm0 (no quorum left to lose)``: the status line."""
    up = sum(r["answers"] for r in rows)
    lead = next((r["name"] or r["endpoint"] for r in rows if r["leader"]), None)
    text = f"etcd: {up} of {len(rows)} member(s) answer, " + (f"leader {lead}" if lead else "no leader known")
    if rows and up < len(rows):
        left = up - (len(rows) // 2 + 1)
        text += f" (degraded: {max(left, 0)} more loss(es) before etcd stops)" if left >= 0 else " (no quorum: etcd refuses writes)"
    return text


# -- the HTTP adapter -----------------------------------------------------------------------


def _url(endpoint: str) -> str:
    return (endpoint if "://" in endpoint else f"http://{endpoint}").rstrip("/")


def _context(options) -> ssl.SSLContext | None:
    if not (options.cacert or options.cert):
        return None
    ctx = ssl.create_default_context(cafile=options.cacert)
    if options.cert:
        ctx.load_cert_chain(options.cert, options.key)
    return ctx


def _call(url: str, body: bytes | None, ctx, timeout: float) -> dict:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=timeout, context=ctx) as r:
        return json.loads(r.read())


def _error(e: Exception) -> str:
    return f"HTTP {e.code}" if isinstance(e, urllib.error.HTTPError) else " ".join(str(getattr(e, "reason", e)).split())[:120]


def ask_v3(base: str, ctx, timeout: float) -> Answer:
    s = _call(base + "/v3/maintenance/status", b"{}", ctx, timeout)
    return Answer(base, str(s["header"]["member_id"]), str(s.get("leader", "")), str(s.get("version", "")))


def ask_v2(base: str, ctx, timeout: float) -> Answer:
    s = _call(base + "/v2/stats/self", None, ctx, timeout)
    return Answer(base, _v2_id(s["id"]), _v2_id(s.get("leaderInfo", {}).get("leader", "")), "")


def _ask(endpoint: str, ctx, timeout: float) -> Answer:
    base = _url(endpoint)
    try:
        return ask_v3(base, ctx, timeout)
    except urllib.error.HTTPError as e:
        if e.code != 404:
            return Answer(base, None, error=_error(e))
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        return Answer(base, None, error=_error(e))
    try:  # no v3 gateway there: the v2 API's own view
        return ask_v2(base, ctx, timeout)
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        return Answer(base, None, error=_error(e))


def _v2_id(hex_id: str) -> str:
    """v2 names members in hex, v3's gateway in decimal: one spelling (decimal) for both."""
    return str(int(hex_id, 16)) if hex_id else ""


def listed_v3(base: str, ctx, timeout: float) -> list[Member]:
    listing = _call(base + "/v3/cluster/member/list", b"{}", ctx, timeout)["members"]
    return [Member(str(m["ID"]), m.get("name", ""), tuple(m.get("clientURLs", ()))) for m in listing]


def listed_v2(base: str, ctx, timeout: float) -> list[Member]:
    listing = _call(base + "/v2/members", None, ctx, timeout)["members"]
    return [Member(_v2_id(m["id"]), m.get("name", ""), tuple(m.get("clientURLs", ()))) for m in listing]


def _listed(endpoint: str, ctx, timeout: float) -> list[Member]:
    base = _url(endpoint)
    try:
        return listed_v3(base, ctx, timeout)
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise
    return listed_v2(base, ctx, timeout)


def etcd_members(options, timeout: float = 2.0) -> list[dict]:
    """``members()`` of the etcd behind ``options`` (``rendezvous.kv.EtcdOptions``)."""
    ctx = _context(options)
    answers = [_ask(e, ctx, timeout) for e in options.endpoints]
    listed: list[Member] = []
    for a in answers:
        if a.member_id is not None:
            try:
                listed = _listed(a.endpoint, ctx, timeout)
                break
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                continue
    return members(listed, answers)
