"""When does a node that cannot keep its etcd lease stop its own workers? (pure)

Two faults look the same from inside an agent (etcd does not answer) and need opposite answers:

* **all of etcd is down**: nobody can publish a new plan, so nobody can take this node's ranks.
  The workers talk to each other, not to etcd, and keep training: stopping them would turn an
  etcd outage into a training outage. Keep going; etcd renews every lease when it comes back.
* **this node is cut off** from etcd *and* from its peers: its lease expires, the others replace
  it, and a spare takes its ranks. Its workers must be gone by then (fencing: never two owners of
  one rank). From inside, the tell is that the workers stopped making progress as well (a
  collective failed or blocks), which cannot happen while every peer is still with them.

So: etcd silent for a while AND the workers stalled or recovering -> fence. etcd answering that
the lease is gone -> rejoin as the same node if the current plan still gives it its ranks (a long
pause of this agent, say), else fence. A newer plan without this node -> it was replaced: fence.

One exception, because the stall may have a cause of its own: a peer's worker died while all of
etcd was down (the job's other workers then wait for a plan nobody can publish yet). Fencing
then would turn one lost worker into every node's loss. So before it fences, the agent asks the
peers it probes (``peer_link.probe_targets``) whether etcd answers them: when every one of them
answers that it does not either (``peers_cut_off``), etcd is down for the job, not for this node
alone, and nobody can take this node's ranks until it is back (its planners then wait for every
node to re-register first: ``settling_after_outage``). A peer that does not answer, or that
reaches etcd, leaves the rule as it was: this node may be the one cut off.
"""

from __future__ import annotations

KEEP = "keep"  # carry on (the lease is fine, or nobody can have replaced us)
FENCE = "fence"  # stop this node's workers now: another node owns (or soon owns) its ranks
REREGISTER = "reregister"  # the lease is gone but nobody took over: register again, same node id


def lease_decision(
    *,
    lease_gone: bool,
    unreachable_for: float | None,
    ttl: float,
    active: bool,
    replaced: bool,
    recovering: bool,
    stalled_for: float | None,
    stall_limit: float,
    peers_cut_off: bool = False,
) -> str:
    """What the agent does about its membership; one of KEEP, FENCE, REREGISTER.

    lease_gone      etcd answered that this node's lease expired or was revoked
    unreachable_for seconds since the last successful lease refresh, while refreshes fail (None
                    while they succeed)
    active          the latest plan this agent knows gives it ranks
    replaced        a plan read from etcd removed this node (someone else has its ranks)
    recovering      a local worker saw a collective fail and waits for a new generation
    stalled_for     seconds since a local worker last finished a step (None: no running workers)
    stall_limit     a stall longer than this means a collective is stuck (the collective timeout)
    peers_cut_off   every peer asked answered that etcd does not answer it either (see above)
    """
    if replaced:
        return FENCE
    if lease_gone:
        # etcd answers again, and the plan we just read still has us (or we are a spare that owns
        # no rank): nobody acted on the expiry yet. If a planner races us and publishes a plan
        # without us, we see it on the next read and leave then.
        return REREGISTER
    if unreachable_for is None or not active:
        return KEEP  # a spare owns no rank; it rejoins when etcd is back
    # The lease expires at the server ttl seconds after the last refresh that got through. Fence
    # from half of that when the workers are stuck too, so that they are gone before the node
    # can be replaced; while they make progress the peers are still with us: etcd is what is down.
    if unreachable_for >= ttl / 2 and (recovering or (stalled_for is not None and stalled_for > stall_limit)):
        return KEEP if peers_cut_off else FENCE
    return KEEP


def settling_after_outage(since_back: float | None, ttl: float, renewal_age: float | None = None) -> bool:
    """True while the agents may still be re-registering after an etcd outage: do not publish a
    plan that replaces nodes yet. Leases that expired during the outage (the v2 API keeps TTLs
    in wall-clock time, so a full outage longer than the TTL expires every node at once) would
    otherwise read as every node lost at the same moment: a failover storm. Every agent saw
    the outage too and rejoins within one refresh interval (ttl/3), so two TTLs is plenty.
    ``since_back``: seconds since this agent found etcd answering again (None: no outage).

    ``renewal_age``: seconds since this agent's own lease renewal last got through (renewals go
    every ttl/3). Past 0.6 TTL one is late: etcd is slow for this agent too (a slowed or
    overloaded etcd, a renewal still on its way), and everyone's renewals may be as late, so a
    lease that lapsed meanwhile is no sign that its node is gone (the control-plane soak, v2:
    every byte 1.2 s late, 3 refreshes a round, both active nodes' leases lapsed and the spare
    failed the job for want of a spare before its own late renewal came back)."""
    late = renewal_age is not None and renewal_age > 0.6 * ttl
    return late or (since_back is not None and since_back < 2 * ttl)


def peers_cut_off(my_last_contact: float, peers_last_contact: list[float | None], ttl: float) -> bool:
    """Does every peer asked say that etcd has not answered it since it last answered this node?

    ``peers_last_contact``: the wall time each peer's agent last heard from etcd (None: it did not
    answer). A healthy agent hears from etcd at least every max(1 s, ttl / 3) (its progress record,
    its lease), so a peer whose last contact is no later than this node's own plus that interval
    (and a quarter second for clocks and the moment of asking) has not heard from etcd since etcd
    went silent for this node. One that has, or that does not answer, says this node may be the
    one cut off. No peer asked (a node alone) proves nothing."""
    if not peers_last_contact:
        return False
    window = max(1.0, ttl / 3) + 0.25
    return all(t is not None and t <= my_last_contact + window for t in peers_last_contact)


def plans_while_settling(*, live: bool, finished: bool, removed: set[str], replaced: set[str], reported: set[str]) -> bool:
    """May a planner publish this plan while the agents may still be re-registering after an
    outage (``settling_after_outage``)? Only one that no expired lease can have caused: a live
    substitution whose every removed node reported its own failure (or was cordoned) and was
    replaced by a spare that is registered. A worker killed while etcd was away then recovers as
    soon as etcd is back, not two TTLs later; a plan that removes a node for its missing lease
    alone, fails the job or restarts every worker still waits (the lease, or a spare's, may only
    be on its way back)."""
    return live and not finished and bool(removed) and removed <= reported and removed <= replaced


def lapsed_but_alive(contacts: list[float | None], now: float, ttl: float, request_timeout: float = 0.0) -> bool:
    """May a planner replace nodes for a lapsed lease alone? Not while one of them is evidently
    alive and talking to etcd: ``contacts`` are the wall times at which etcd last answered each
    such node, read from its agent's own store (None: its agent did not answer). One that
    answers and heard from etcd within two TTLs renews late (etcd slow on its way: a slowed or
    overloaded member) and registers again as soon as it sees its lease gone; replacing it would
    fence a healthy node. A node whose agent does not answer (dead, frozen, cut off) or that
    has not heard from etcd for longer is replaced as before.

    ``request_timeout`` (the etcd client's) is added to the two TTLs: a renewal sent to a member
    that hangs (stopped, or slowed past the timeout) is given up only then and sent to the next
    member, so until then a healthy node cannot have heard from etcd. Without it a soak (v2,
    FSDP2, one member slowed 4.9 s each way) replaced a healthy node 6.2 s after etcd last
    answered it, 0.2 s before its renewal got through another member."""
    return any(c is not None and now - c < 2 * ttl + request_timeout for c in contacts)
