"""The Ray Serve application: an ingress deployment (the OpenAI API) in front of an engine
deployment whose replicas each own one Engine (a SchedulerActor and its TP workers in the
replica's placement group). `--replicas N` is N data-parallel engines; the deployment's request
router (kvray.deploy.router, `--router`) picks the replica of each request.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from prometheus_client import CollectorRegistry
from ray import serve
from ray.actor import ActorHandle
from ray.serve import Application
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import ASGIApp

from kvray.cluster.engine import ACTOR_NAMESPACE
from kvray.cluster.request_channel import ChannelGone, RequestChannel
from kvray.core import RequestRejected, SamplingParams, TokenEvent
from kvray.deploy.generation import EngineLimits
from kvray.deploy.protocol import APIError
from kvray.deploy.settings import ServeConfig
from kvray.net import free_port

SCHEDULER_PREFIX = "kvray-scheduler-"


FETCH_WAIT_S = 15.0  # a request waits this long at most for its prefix's K/V
SUBMIT_TRIES = 3  # a request whose engine was gone before it started goes elsewhere
EARLY_LIMIT = 256  # unopened requests' events a subscription keeps before pruning ended ones
CHANNEL_RECHECK_S = 30.0  # an engine on another node is asked again for a channel after this
HEALTH_STATS_WAIT_S = 2.0  # /health waits this long at most for the engines' stats


class EngineGone(RuntimeError):
    """The engine replica's scheduler is gone: the request never started there, so it
    can be routed again."""


def _unwrap(e: BaseException) -> BaseException:
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


@serve.deployment(
    ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000, health_check_period_s=5
)
class EngineDeployment:
    def __init__(self, settings: dict[str, Any]) -> None:
        from kvray.cluster.engine import Engine  # noqa: I001 (torch loads here, not at import)

        from kvray.deploy.router import scheduler_name

        s = ServeConfig(**settings)
        # Named after this replica, so the prefix router finds its scheduler.
        self.name = scheduler_name(s.app_name, serve.get_replica_context().replica_tag)
        self.engine = Engine(
            s.engine_config,
            compiled=s.compiled,
            worker_cpus=s.worker_cpus,
            worker_threads=s.threads_per_worker,
            progress=False,
            name=self.name,
        )
        self.actor = self.engine.actor

    async def limits(self) -> EngineLimits:
        spec = self.engine.spec
        return EngineLimits(spec.max_seq_len, spec.vocab_size, spec.sampling_defaults)

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        subscriber: str | None = None,
        kv_source: str | None = None,
    ) -> AsyncIterator[tuple[str, int]]:
        """Submit a request; yield (scheduler actor name, request id) and stay open until
        the request ends. The tokens do not pass through here: the ingress reads them
        straight from the scheduler actor, on its `subscriber` stream (one Ray hop per
        step for all its requests there, not two per token per request), while
        this open stream keeps the request counted against this replica for Serve's
        router. The request's only abort on the way: this stream ends before the request
        did (`EngineStream.cancel` aborts it at the scheduler first; this covers an
        ingress that went away), and the request's pages are freed at once.

        `kv_source` (set by the router with --share-kv) names another engine's scheduler
        that caches more of the prompt: its K/V is fetched first (kvray.cluster.kv_transfer),
        for at most FETCH_WAIT_S; on any failure the request computes its prompt."""
        if kv_source is not None and kv_source != self.name:
            try:
                await asyncio.wait_for(
                    self.actor.fetch_prefix.remote(input_ids, kv_source), FETCH_WAIT_S
                )
            except Exception:  # noqa: BLE001 - slow or failed: compute instead
                pass
        try:
            rid = await self.actor.submit.remote(input_ids, sampling, subscriber)
        except ray.exceptions.RayActorError:
            raise EngineGone(self.name) from None
        except Exception as e:
            raise _unwrap(e) from None
        yield (self.name, rid)
        done = False
        try:
            await self.actor.finished.remote(rid)
            done = True
        finally:
            if not done:
                self.actor.abort.remote(rid, "abort")

    async def request_channel(self) -> tuple[str, str]:
        """(node id, socket path) of this engine's request channel: an ingress on the same
        node submits there, past this replica (kvray.cluster.request_channel)."""
        try:
            return await self.actor.request_channel.remote()
        except ray.exceptions.RayActorError:
            raise EngineGone(self.name) from None
        except Exception as e:
            raise _unwrap(e) from None

    async def stats(self) -> dict[str, Any]:
        return await self.actor.stats.remote()

    async def check_health(self) -> None:
        """Serve replaces this replica when its scheduler actor is gone; the placement
        group of the dead engine is released first, so its CPUs/GPUs come back."""
        try:
            await self.actor.ready.remote()
        except Exception:
            await asyncio.to_thread(self.engine.shutdown)
            raise

    def __del__(self) -> None:
        # Serve calls this on a graceful shutdown: release the actors and placement group.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class _Subscription:
    """This process's stream of events from one scheduler actor (`subscribe`): every
    request it submitted there, a step's worth per Ray message, handed out to each
    request's own queue. If the stream breaks (the engine died), every request on it gets
    the error, and the next request there opens a new subscription."""

    def __init__(self, actor: ActorHandle, key: str) -> None:
        self.actor = actor
        self._queues: dict[int, asyncio.Queue[TokenEvent | BaseException]] = {}
        # Events of requests not opened yet (the engine replica's answer with the request's
        # id may come after its first tokens); dropped once finished and never opened.
        self._early: dict[int, list[TokenEvent]] = {}
        self.failure: BaseException | None = None
        # In a fresh context: a call made in a request's context is that request's child
        # task to Ray, and Serve cancels a request's children with it (a client that went
        # away would end the stream that every request here shares).
        self._task = asyncio.get_running_loop().create_task(
            self._pump(actor, key), context=contextvars.Context()
        )

    async def _pump(self, actor: ActorHandle, key: str) -> None:
        try:
            async for ref in actor.subscribe.options(num_returns="streaming").remote(key):
                for ev in await ref:
                    q = self._queues.get(ev.rid)
                    if q is not None:
                        q.put_nowait(ev)
                    else:
                        self._early.setdefault(ev.rid, []).append(ev)
                if len(self._early) > EARLY_LIMIT:
                    self._early = {r: e for r, e in self._early.items() if not e[-1].finished}
            raise EngineGone("the engine ended its event stream")
        except BaseException as e:  # noqa: BLE001 - handed to every request on it
            self.failure = e
            for q in self._queues.values():
                q.put_nowait(e)

    def on_this_loop(self) -> bool:
        return self._task.get_loop() is asyncio.get_running_loop()

    def open(self, rid: int) -> asyncio.Queue[TokenEvent | BaseException]:
        q: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        for ev in self._early.pop(rid, []):
            q.put_nowait(ev)
        if self.failure is not None:
            q.put_nowait(self.failure)
        self._queues[rid] = q
        return q

    def close(self, rid: int) -> None:
        self._queues.pop(rid, None)


class _QueueStream:
    """An EngineStream's reading half: request `rid`'s events (or what broke its way
    there) from `queue`, in the batches that are ready; `_closed()` once reading ends."""

    def __init__(self, rid: int, queue: asyncio.Queue[TokenEvent | BaseException]) -> None:
        self._rid = rid
        self._queue = queue

    async def __aiter__(self) -> AsyncIterator[list[TokenEvent]]:
        try:
            while True:
                batch = [await self._queue.get()]
                while not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                events: list[TokenEvent] = []
                for item in batch:
                    if isinstance(item, BaseException):
                        raise item
                    events.append(item)
                yield events
                if events[-1].finished:
                    return
        finally:
            self._closed()

    def _closed(self) -> None:
        raise NotImplementedError


class _ChannelStream(_QueueStream):
    """An EngineStream over this process's request channel to the scheduler."""

    def __init__(
        self, channel: RequestChannel, rid: int, queue: asyncio.Queue[TokenEvent | BaseException]
    ) -> None:
        super().__init__(rid, queue)
        self._channel = channel

    def _closed(self) -> None:
        self._channel.forget(self._rid)

    def stop(self) -> None:
        self._channel.abort(self._rid, "stop")  # the finishing event comes on the stream

    def cancel(self) -> None:
        self._channel.abort(self._rid, "abort")
        self._channel.forget(self._rid)


class _ServeStream(_QueueStream):
    """An EngineStream: the request's events straight from its scheduler actor (through
    this process's subscription there), while the engine deployment's `generate` stream
    (`lease`) holds the request open on its replica."""

    def __init__(self, lease: DeploymentResponseGenerator, rid: int, sub: _Subscription) -> None:
        super().__init__(rid, sub.open(rid))
        self._lease = lease
        self._actor = sub.actor
        self._sub = sub

    def _closed(self) -> None:
        self._sub.close(self._rid)

    def stop(self) -> None:
        # Straight to the request's scheduler (the deployment's router could pick another
        # replica); fire and forget: the finishing event comes on the stream.
        self._actor.abort.remote(self._rid, "stop")

    def cancel(self) -> None:
        # Abort at the request's scheduler directly (fire and forget, never blocks), and
        # release the deployment's stream. Serve does not always carry a cancel into the
        # replica's generator in time, so its own `finally` abort is only the backstop for
        # an ingress that died; a scheduler ignores an abort of a finished request. Nobody
        # reads this request's events after a cancel (a stream never iterated included),
        # so the subscription stops keeping them.
        self._actor.abort.remote(self._rid, "abort")
        self._lease.cancel()
        self._sub.close(self._rid)


class ServeEngineClient:
    """EngineClient over the engine deployment's handle. With `direct` (one engine
    replica: there is nothing to route), requests go over a request channel straight to
    the engine's scheduler when it runs on this node; otherwise, and whenever the
    scheduler is elsewhere, through the deployment (routed by its request router)."""

    def __init__(self, handle: DeploymentHandle, direct: bool = False) -> None:
        self._plain = handle
        self._handle = handle.options(stream=True)
        # One subscriber key for this process: each engine sends this process's events on
        # one stream (kept in `_subs` by scheduler name, with the scheduler's handle).
        self._key = uuid.uuid4().hex
        self._subs: dict[str, _Subscription] = {}
        self._direct = direct
        self._channels: dict[asyncio.AbstractEventLoop, RequestChannel] = {}
        self._connecting: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}
        self._no_channel_until = 0.0  # the engine was on another node: ask again after this

    async def _channel(self) -> RequestChannel | None:
        """This event loop's request channel to the engine (connected on first use and
        after it broke); None where there is none to have."""
        if not self._direct:
            return None
        loop = asyncio.get_running_loop()
        channel = self._channels.get(loop)
        if channel is not None and channel.failure is None:
            return channel
        if loop.time() < self._no_channel_until:
            return None
        async with self._connecting.setdefault(loop, asyncio.Lock()):
            channel = self._channels.get(loop)
            if channel is not None and channel.failure is None:
                return channel
            node, path = await self._plain.request_channel.remote()
            if node != ray.get_runtime_context().get_node_id():
                self._no_channel_until = loop.time() + CHANNEL_RECHECK_S
                return None
            channel = self._channels[loop] = await RequestChannel.connect(path)
            return channel

    async def _submit(self, input_ids: list[int], sampling: SamplingParams) -> _QueueStream:
        channel = await self._channel()
        if channel is not None:
            rid, queue = await channel.submit(input_ids, sampling)
            return _ChannelStream(channel, rid, queue)
        gen = self._handle.generate.remote(input_ids, sampling, self._key)
        try:
            name, rid = await gen.__anext__()
        except BaseException:
            gen.cancel()  # if it was queued meanwhile, the engine aborts it
            raise
        return _ServeStream(gen, rid, self._subscription(name))

    def _subscription(self, name: str) -> _Subscription:
        """This process's open stream from scheduler `name`: a new one where there is none,
        where it broke, or where it belongs to another event loop."""
        sub = self._subs.get(name)
        if sub is None or sub.failure is not None or not sub.on_this_loop():
            actor = sub.actor if sub is not None else ray.get_actor(name, namespace=ACTOR_NAMESPACE)
            sub = self._subs[name] = _Subscription(actor, self._key)
        return sub

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> _QueueStream:
        for attempt in range(SUBMIT_TRIES):
            try:
                return await self._submit(input_ids, sampling)
            except BaseException as e:
                err = _unwrap(e)
                if isinstance(err, RequestRejected):
                    raise err from None
                # A replica (or its engine) gone before the request started there: its
                # engine died with it, so nothing runs twice if it is routed again. The
                # router leaves a silent engine out once it notices, so a retry goes
                # elsewhere; a broken request channel is connected again.
                gone = isinstance(err, EngineGone | ChannelGone | ray.exceptions.RayActorError)
                if gone and attempt + 1 < SUBMIT_TRIES:
                    await asyncio.sleep(0.05 * (attempt + 1))
                    continue
                if gone:
                    raise APIError(
                        503,
                        f"no engine could take the request ({SUBMIT_TRIES} were gone)",
                        type_="ServiceUnavailableError",
                    ) from None
                raise
        raise AssertionError("unreachable: the last try returns or raises")


def is_app_scheduler(name: str, app_name: str) -> bool:
    """Whether the actor `name` is the scheduler of one of `app_name`'s engines
    (`router.scheduler_name`: the prefix, the app, then a replica id, which has no "-": so
    app "kvray" does not claim app "kvray-b"'s engines)."""
    prefix = f"{SCHEDULER_PREFIX}{app_name}-"
    tag = name[len(prefix) :]
    return name.startswith(prefix) and bool(tag) and "-" not in tag


def _schedulers(app_name: str) -> list[ActorHandle]:
    """The scheduler actor of every engine of the app, found by their names."""
    out = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if is_app_scheduler(a["name"], app_name):
            try:
                out.append(ray.get_actor(a["name"], namespace=a["namespace"]))
            except ValueError:
                continue  # went away since the listing
    return out


def engine_stats(app_name: str) -> list[dict[str, Any]]:
    """Stats of every engine of the app that answers."""
    refs = [actor.stats.remote() for actor in _schedulers(app_name)]
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=5))
        except Exception:  # noqa: BLE001 - a dying engine must not break /metrics
            continue
    return out


def engines_progressing(stats: list[dict[str, Any]], window_s: float) -> bool:
    """/health's proof without a probe: some engine has work and its step loop progressed
    within the last `window_s` seconds, and every other one is idle (SchedulerActor.stats:
    `has_work`, `progress_age_s`; all engines answered). A busy engine would queue a probe
    behind its work, and its progress already shows the app generates: one loaded replica
    beside idle ones (prefix routing sends a shared system prompt's traffic to one) must
    not fail the check. A stuck engine (work, but no step for `window_s`), stats that say
    neither, or no engine at all prove nothing, and the probe decides."""

    def progressing(s: dict[str, Any]) -> bool:
        return s.get("has_work") is True and float(s.get("progress_age_s", math.inf)) <= window_s

    return any(progressing(s) for s in stats) and all(
        progressing(s) or s.get("has_work") is False for s in stats
    )


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
@serve.ingress()
class Ingress:
    def __init__(self, engine: DeploymentHandle, settings: dict[str, Any]) -> None:
        from kvray.cluster.spec import resolve_model_path
        from kvray.deploy.api import ServerState
        from kvray.deploy.metrics import EngineCollector, RequestMetrics, RouterCollector
        from kvray.text import load_tokenizer

        s = ServeConfig(**settings)
        self.settings = s
        self.engine = engine
        self.tokenizer = load_tokenizer(resolve_model_path(s.model, progress=False, weights=False))
        if s.chat_template is not None:  # (resolved settings: the template's text)
            self.tokenizer.chat_template = s.chat_template
        self.registry = CollectorRegistry()
        name = s.served_model_name
        assert name is not None, "replicas get resolved settings (ServeConfig.resolved)"
        self.model_name = name
        self.metrics = RequestMetrics(self.registry, name)
        self.registry.register(EngineCollector(name, lambda: engine_stats(s.app_name)))
        # kvray's routers count their decisions in this process (all zero with pow2).
        self.registry.register(RouterCollector(name))
        self.state = ServerState()

    async def _healthy(self) -> bool:
        """Healthy when an engine is busy and its step loop progressed within the health
        timeout, and none is stuck (read from the engines' stats: nothing is queued behind
        their work; `engines_progressing`); otherwise a real step: one one-token request
        through an engine, within the timeout. (An engine that still answers calls but
        cannot generate is not healthy.)"""
        from kvray.deploy.generation import generates

        timeout = self.settings.health_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            if await asyncio.wait_for(
                self._engines_progressing(), min(HEALTH_STATS_WAIT_S, timeout / 2)
            ):
                return True
        except Exception:  # noqa: BLE001 - no proof of progress: the probe decides
            pass
        try:
            ids = self.serving.prepare.document_start()
            return await asyncio.wait_for(
                generates(self.serving.engine, ids), max(deadline - loop.time(), 0.0)
            )
        except Exception:  # noqa: BLE001 - a dead actor, a missing replica, a timeout, a 503
            return False

    async def _engines_progressing(self) -> bool:
        """The engines' stats (all must answer) show the app progressing."""
        actors = await asyncio.to_thread(_schedulers, self.settings.app_name)
        stats = await asyncio.gather(*(a.stats.remote() for a in actors))
        return engines_progressing(list(stats), self.settings.health_timeout_s)

    async def drain(self) -> int:
        """Refuse new requests from now on (503); returns the requests still in flight."""
        self.state.draining = True
        return self.state.inflight

    async def inflight(self) -> int:
        return self.state.inflight

    async def __serve_build_asgi_app__(self) -> ASGIApp:
        from kvray.deploy.api import create_app
        from kvray.deploy.openai import OpenAIServing

        s = self.settings
        # The engine's context and vocabulary are the engine's to say: asked once, here.
        limits: EngineLimits = await self.engine.limits.remote()
        self.serving = OpenAIServing(
            self.model_name,
            self.tokenizer,
            limits,
            ServeEngineClient(self.engine, direct=s.request_channel and s.replicas == 1),
            self.metrics,
            s,
            s.served_model_aliases,
        )
        return create_app(
            self.serving,
            self.registry,
            s.api_key,
            self._healthy,
            s.public_paths,
            self.state,
            s.allowed_origins,
        )


def direct_ingress_env(port: int) -> dict[str, str]:
    """Ray Serve's settings under which the ingress replica answers HTTP on `port` itself,
    with no proxy actor on the way: every request and every streamed chunk saves a Ray
    hop and the proxy's CPU, on the cores the engine computes on. Serve's controller and
    replicas read them when they start, so they must be in the environment of the process
    that starts the Ray cluster. Serve allocates the port from a range: here just `port`,
    never held back after a replica goes (quarantine 0) and with no drain wait of its own
    (kvray drains before it shuts Serve down). The replicas' code runs on Serve's own event
    loop, not a second one on a thread of its own: every streamed chunk would otherwise
    cross between the two loops (`kvray bench overhead`, runs taking turns on a 2-core VM:
    +7.5 / +8.5 ms TTFT p50 added, against +9.5 / +13.4 ms with the second loop)."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # exclusive
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
    }


def own_cluster_env() -> dict[str, str]:
    """Ray Serve's settings for a cluster that `kvray serve` starts for itself (unless the
    environment sets them already). Serve's controller reconciles every 0.1 s by default,
    which on a 2-core machine took 0.7 ms of CPU per streamed token of one request, on the
    cores the engine computes on; every 0.5 s it took 0.3 ms (and the server was ready
    0.7 s later, 17.6 s against 16.9). Replica failures are still noticed within a second."""
    return {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}


def start_app(settings: ServeConfig, host: str, port: int, direct_ingress: bool = False) -> None:
    """Serve the app over HTTP at host:port on the connected Ray cluster (as `kvray serve`).
    With `direct_ingress` (the cluster was started with `direct_ingress_env(port)`), the
    ingress replica listens on host:port; Serve's proxy, which Serve still starts, gets a
    free port of its own and sits on no request's path."""
    proxy_port = free_port(host) if direct_ingress else port
    serve.start(http_options={"host": host, "port": proxy_port})
    serve.run(build_app(settings), name=settings.app_name, route_prefix="/")


def drain(app_name: str, grace_s: float) -> int:
    """Stop the app taking requests (new ones get a 503) and wait up to `grace_s` for the
    ones in flight to finish; returns how many were still running then."""
    import time

    deadline = time.monotonic() + grace_s
    handle = serve.get_app_handle(app_name)
    left = handle.drain.remote().result(timeout_s=10)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = handle.inflight.remote().result(timeout_s=10)
    return left


def live_placement_groups(prefix: str = "kvray-pg-") -> int:
    """kvray's placement groups not yet removed on the connected cluster."""
    return sum(
        1
        for info in ray.util.placement_group_table().values()
        if info.get("name", "").startswith(prefix) and info.get("state") != "REMOVED"
    )


def build_app(settings: ServeConfig, request_router: Any = None) -> Application:
    """The app for resolved settings (`ServeConfig.resolved`), as Serve replicas get it.
    `request_router` (a Serve RequestRouterConfig) replaces the one `settings.router` names
    (benchmarks route on purpose badly with it)."""
    from kvray.deploy.router import router_config

    raw = settings.model_dump()
    router = request_router or router_config(
        settings.routing,
        settings.app_name,
        settings.page_size,
        settings.router_load_margin,
        settings.share_kv,
        settings.share_kv_min_tokens,
    )
    engine = EngineDeployment.options(
        num_replicas=settings.replicas, request_router_config=router
    ).bind(raw)
    return Ingress.bind(engine, raw)
