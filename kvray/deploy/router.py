"""Request routers of the engine deployment (Ray Serve's `RequestRouter` API), chosen with
`--router`: `prefix` (the default with more than one replica), `pow2` (Serve's power of
two choices) or `round-robin`.

`PrefixRouter` routes on what the engines' radix caches really hold, not on a guess: each
engine's scheduler keeps a digest of its cached whole-page prefixes (kvcache.digest), and
the router follows every replica's digest with a long poll (`SchedulerActor.prefix_digest`:
one call returns every change since the last, or waits for a step to make some), so a
finished turn's prefix is known to the router within about a step. A request's token ids
(the ingress tokenizes before routing) give its chain keys, and the replica whose digest
matches the most leading pages wins, unless its load (requests in flight: Serve's count or
the engine's running + waiting, whichever is higher, plus those chosen for it or given it
and not yet sent, so a burst spreads) exceeds the least loaded replica's by
more than `load_margin`; then the least loaded one wins (as it does when nothing matches;
ties: the smaller cache). Between a request's routing and its prefix
reaching the digest (its prefill done), the router counts the prompt as held by the replica
it chose (for `routed_ttl_s`), so a burst sharing a new prefix lands together, up to
`load_margin` requests more than the least loaded replica holds.

The router never waits on an engine: routing reads only the local copies. A replica whose
engine stops answering its poll is left out while another one answers, and Serve drops a
dead replica (its copy goes too), so a dead or slow engine costs routing quality, never a
request.

With `share_kv`, a request routed to a replica that holds at least `share_kv_min_tokens`
fewer of its tokens than another one carries that other engine's name (`kv_source`, a
keyword argument of `EngineDeployment.generate`): the chosen engine fetches the prefix's
K/V from it (kvray.cluster.kv_transfer) before computing the rest.

Decisions are counted in this process (`metrics.ROUTER_STATS`), which is the ingress's:
its /metrics exports them. (Serve ships a router class to the handle's process pickled by
value, with this module's globals copied: state shared with the ingress must live in
another module.)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvray.deploy import metrics  # by reference: Serve pickles this module by value
from kvray.kvcache.digest import DigestFollower, page_keys

_log = logging.getLogger(__name__)

ROUTERS = ("prefix", "pow2", "round-robin")
POLL_WAIT_S = 2.0  # how long one digest long poll may wait for a change
POLL_TIMEOUT_S = 10.0  # a poll that takes longer is given up (the engine is hung)
RETRY_S = 1.0  # after a failed poll
# How long a routed prompt counts as held by its replica before the digest confirms it.
ROUTED_TTL_S = 10.0
# How long a choice counts as load on its replica before Serve sends the request there
# (Serve's own count takes over at the send; a choice never sent stops counting).
CHOSEN_TTL_S = 2.0


def scheduler_name(app_name: str, replica_tag: str) -> str:
    """The named scheduler actor of one engine replica (the router finds it by this)."""
    from kvray.deploy.app import SCHEDULER_PREFIX

    return f"{SCHEDULER_PREFIX}{app_name}-{replica_tag}"


def token_ids(request: PendingRequest | None) -> Sequence[int] | None:
    """The request's prompt token ids: `EngineDeployment.generate(input_ids, sampling)`."""
    if request is None or not request.args:
        return None
    ids = request.args[0]
    return ids if isinstance(ids, list) else None


@dataclass
class _EngineView:
    """What the router knows of one replica's engine."""

    digest: DigestFollower = field(default_factory=DigestFollower)
    load: int = -1  # requests running or waiting there, as last reported (-1: unknown)
    alive: bool = True  # False while its engine's scheduler does not answer
    # Prompts routed here and not yet confirmed by the digest (a request's prefix enters
    # the cache when its prefill is done): chain key -> when it stops counting.
    routed: dict[int, float] = field(default_factory=dict)
    # Requests given this replica and not yet sent there: when each stops counting.
    given: list[float] = field(default_factory=list)

    def matched_pages(self, keys: Sequence[int], now: float) -> int:
        routed = self.routed
        return self.digest.matched_pages(keys, lambda k: routed.get(k, 0.0) >= now)

    @property
    def size(self) -> int:
        """Pages held (or routed here): the tie-break between equally loaded replicas."""
        return len(self.digest.keys) + len(self.routed)

    def expire(self, now: float) -> None:
        self.routed = {k: t for k, t in self.routed.items() if t >= now}


class EngineFollowingRouter(RequestRouter):
    """Base of kvray's routers: follows every replica's engine (its prefix digest and
    load) and, with `share_kv`, tells the replica a request is routed to which other
    replica holds at least `share_kv_min_tokens` more of its prompt, so it fetches that
    prefix's K/V (kvray.cluster.kv_transfer) instead of computing it. Subclasses choose."""

    def initialize_state(
        self,
        app_name: str = "",
        page_size: int = 16,
        load_margin: int = 4,
        routed_ttl_s: float = ROUTED_TTL_S,
        share_kv: bool = False,
        share_kv_min_tokens: int = 256,
    ) -> None:
        self._app_name = app_name
        self._page_size = page_size  # the engines' (one deployment: one config)
        self._load_margin = load_margin
        self._routed_ttl_s = routed_ttl_s
        self._share_kv = share_kv
        self._share_kv_min_tokens = share_kv_min_tokens
        self._views: dict[ReplicaID, _EngineView] = {}
        self._polls: dict[ReplicaID, asyncio.Task[None]] = {}
        # Requests chosen and not yet given a replica: id(request) -> (the replica chosen,
        # when the choice stops counting). A request chosen again replaces its choice.
        self._choices: dict[int, tuple[ReplicaID, float]] = {}

    def _fulfill_next_pending_request(
        self, replica: RunningReplica, request_metadata: Any = None
    ) -> None:
        """Give `replica` to the request this routing task chose it for.

        Serve's base router finds that request by its `internal_request_id`, but every
        handle call made while serving one HTTP request inherits that request's id: a
        request of `n` choices, or of several prompts, sends that many engine calls with
        one id, Serve indexes only the first, and the others were never given a replica
        (they hung). Each routing task routes one request at a time, so the request whose
        routing task is the running task is the one `replica` was chosen for."""
        # (Serve's internals, read defensively: a Ray whose router lacks any of them gets
        # the base behaviour, which serves every request of one engine call.)
        by_future = getattr(self, "_routing_task_by_pending_request_future", None)
        queue = getattr(self, "_pending_requests_to_fulfill", None)
        record = getattr(self, "_record_queue_wait_time", None)
        unindex = getattr(self, "_remove_pending_request_from_indices", None)
        task = asyncio.current_task()
        if None in (by_future, queue, record, unindex, task):
            super()._fulfill_next_pending_request(replica, request_metadata)
            return
        assert by_future is not None and queue is not None and record and unindex
        for pending in queue:
            if by_future.get(pending.future) is task and not pending.future.done():
                record(pending)
                pending.future.set_result(replica)
                unindex(pending)
                self._given(pending, replica.replica_id)
                return
        super()._fulfill_next_pending_request(replica, request_metadata)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for rid in list(self._polls):
            if rid not in live:
                self._forget(rid)
        for rid in live - set(self._polls) if self._follows_engines else ():
            view = self._views[rid] = _EngineView()
            self._polls[rid] = self._event_loop.create_task(self._follow(rid, view))

    @property
    def _follows_engines(self) -> bool:
        return True

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _forget(self, rid: ReplicaID) -> None:
        task = self._polls.pop(rid, None)
        if task is not None:
            task.cancel()
        self._views.pop(rid, None)
        metrics.ROUTER_ENGINE_LOADS.pop(rid.unique_id, None)

    async def _follow(self, rid: ReplicaID, view: _EngineView) -> None:
        """Keep `view` current with one replica's engine, until cancelled."""
        from kvray.cluster.engine import ACTOR_NAMESPACE

        name = scheduler_name(self._app_name, rid.unique_id)
        actor = None
        while True:
            try:
                if actor is None:
                    actor = await asyncio.to_thread(ray.get_actor, name, namespace=ACTOR_NAMESPACE)
                digest = view.digest
                ref = actor.prefix_digest.remote(digest.epoch, digest.seq, view.load, POLL_WAIT_S)
                delta, view.load = await asyncio.wait_for(ref, POLL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - not there yet, restarting, dead or hung
                _log.debug("digest poll of %s failed: %s", name, e)
                actor, view.alive = None, False
                await asyncio.sleep(RETRY_S)
                continue
            view.alive = True
            metrics.ROUTER_ENGINE_LOADS[rid.unique_id] = view.load
            if delta is not None:  # (None: a cache policy without a digest)
                view.digest.apply(delta)
            view.expire(time.monotonic())

    def _load(self, rid: ReplicaID) -> int:
        """Requests in flight at a replica: Serve's count (this router's sends and their
        ends, and the replica's own reports) or its engine's, whichever is higher (the
        engine's also counts requests from other routers), plus the requests this router
        chose it for or gave it and has not sent yet (`_unsent`)."""
        view = self._views.get(rid)
        engine = view.load if view is not None else 0
        return max(self._replica_queue_len_cache.get(rid) or 0, engine) + self._unsent(rid)

    def _unsent(self, rid: ReplicaID) -> int:
        """Requests on their way to `rid` that no count has yet: chosen for it (until given
        a replica) or given it (until Serve sends them, and counts them from then on). A
        burst routed before any of it is sent would otherwise see one set of loads and
        land on one replica. Each stops counting after CHOSEN_TTL_S, sent or not."""
        now = time.monotonic()
        self._choices = {k: c for k, c in self._choices.items() if c[1] >= now}
        view = self._views.get(rid)
        given = 0
        if view is not None:
            view.given = [t for t in view.given if t >= now]
            given = len(view.given)
        return given + sum(1 for chosen, _ in self._choices.values() if chosen == rid)

    def _chose(self, request: PendingRequest | None, rid: ReplicaID) -> None:
        if request is not None:
            self._choices[id(request)] = (rid, time.monotonic() + CHOSEN_TTL_S)

    def _given(self, request: PendingRequest, rid: ReplicaID) -> None:
        """`request` was given `rid` (whichever replica it was chosen for): it counts
        there until it is sent."""
        self._choices.pop(id(request), None)
        view = self._views.get(rid)
        if view is not None:
            view.given.append(time.monotonic() + CHOSEN_TTL_S)

    def on_send_request(self, replica_id: ReplicaID) -> None:
        """A request goes to `replica_id`: Serve counts it from now on, so one of the
        requests given that replica stops counting here."""
        view = self._views.get(replica_id)
        if view is not None:
            now = time.monotonic()
            view.given = [t for t in view.given if t >= now][1:]
        super().on_send_request(replica_id)

    def _view(self, replica: RunningReplica) -> _EngineView:
        view = self._views.get(replica.replica_id)
        return view if view is not None else _EngineView()

    def _matches(
        self, ids: Sequence[int], replicas: Sequence[RunningReplica]
    ) -> tuple[list[int], dict[ReplicaID, int]]:
        """(the prompt's chain keys, whole pages of it each replica holds)."""
        keys = page_keys(ids, self._page_size)
        now = time.monotonic()
        return keys, {r.replica_id: self._view(r).matched_pages(keys, now) for r in replicas}

    def _routed(
        self,
        request: PendingRequest | None,
        chosen: RunningReplica,
        keys: list[int],
        matched: dict[ReplicaID, int],
    ) -> None:
        """Bookkeeping of a decision: the prompt counts as held by `chosen` until its
        digest says so; with `share_kv`, the request names the replica to fetch from."""
        view = self._views.get(chosen.replica_id)
        if view is not None and keys:
            view.routed.update(dict.fromkeys(keys, time.monotonic() + self._routed_ttl_s))
        if request is None:
            return
        request.kwargs.pop("kv_source", None)  # (a request may be routed more than once)
        if not self._share_kv or not matched:
            return
        holder = max(matched, key=matched.__getitem__)
        gain = (matched[holder] - matched[chosen.replica_id]) * self._page_size
        view = self._views.get(holder)
        if gain >= self._share_kv_min_tokens and view is not None and view.alive:
            request.kwargs["kv_source"] = scheduler_name(self._app_name, holder.unique_id)
            metrics.ROUTER_STATS["kv_source_hints"] += 1


def _offers_every_replica(pending_request: PendingRequest | None) -> None:
    """Tell Serve that this ranking offers every replica, so that when none takes the
    request now Serve waits (backs off) before asking again. Without it Serve asks again
    at once, in the ingress's routing loop: 3.7 million choices in 25 s for 8 requests
    that no replica took, against 241 with it."""
    if pending_request is not None:
        pending_request.routing_context.should_backoff = True


class PrefixRouter(EngineFollowingRouter):
    """The longest exact prefix match, unless its replica is loaded past the margin."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        _offers_every_replica(pending_request)
        # An engine that stopped answering is left out while another one answers.
        answering = [r for r in candidate_replicas if self._view(r).alive]
        candidate_replicas = answering or candidate_replicas
        if not candidate_replicas:
            return []
        loads = {r.replica_id: self._load(r.replica_id) for r in candidate_replicas}
        by_load = sorted(
            candidate_replicas, key=lambda r: (loads[r.replica_id], self._view(r).size)
        )
        least = by_load[0]
        ids = token_ids(pending_request)
        if ids is None:
            self._chose(pending_request, least.replica_id)
            return [[least], by_load[1:]]
        keys, matched = self._matches(ids, candidate_replicas)
        best = max(by_load, key=lambda r: matched[r.replica_id])  # first max: less loaded
        if matched[best.replica_id] == 0:
            chosen, decision = least, "no_match"
        elif loads[best.replica_id] - loads[least.replica_id] > self._load_margin:
            chosen, decision = least, "load"
        else:
            chosen, decision = best, "prefix"
        metrics.ROUTER_STATS[decision] += 1
        metrics.ROUTER_STATS["tokens"] += len(ids)
        metrics.ROUTER_STATS["matched_tokens"] += matched[chosen.replica_id] * self._page_size
        self._routed(pending_request, chosen, keys, matched)
        self._chose(pending_request, chosen.replica_id)
        # If the chosen replica cannot take it now (full), Serve tries the rest, by load.
        return [[chosen], [r for r in by_load if r is not chosen]]


class RoundRobinRouter(EngineFollowingRouter):
    """Each request to the next replica in turn (replica ids in a fixed order), whatever
    they hold; with `share_kv` the chosen one fetches what another holds."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._turn = itertools.count()

    @property
    def _follows_engines(self) -> bool:
        return self._share_kv

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        _offers_every_replica(pending_request)
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        i = next(self._turn) % len(ordered)
        chosen = ordered[i]
        ids = token_ids(pending_request)
        if ids is not None and self._share_kv:
            keys, matched = self._matches(ids, ordered)
            self._routed(pending_request, chosen, keys, matched)
        return [[chosen], ordered[i + 1 :] + ordered[:i]]


def router_config(
    router: str,
    app_name: str,
    page_size: int,
    load_margin: int,
    share_kv: bool = False,
    share_kv_min_tokens: int = 256,
) -> Any:
    """The engine deployment's `request_router_config` for a `--router` choice."""
    from ray.serve.config import RequestRouterConfig

    kwargs = {
        "app_name": app_name,
        "page_size": page_size,
        "load_margin": load_margin,
        "share_kv": share_kv,
        "share_kv_min_tokens": share_kv_min_tokens,
    }
    if router == "pow2":
        if share_kv:
            raise ValueError("--share-kv needs --router prefix or round-robin")
        return RequestRouterConfig()
    if router == "round-robin":
        return RequestRouterConfig(
            request_router_class=RoundRobinRouter, request_router_kwargs=kwargs
        )
    if router == "prefix":
        return RequestRouterConfig(request_router_class=PrefixRouter, request_router_kwargs=kwargs)
    raise ValueError(f"unknown router {router!r}: one of {', '.join(ROUTERS)}")
