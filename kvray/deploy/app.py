"""The Ray Serve application: an ingress deployment (the OpenAI API) in front of an engine
deployment whose replicas each own one Engine (a SchedulerActor and its TP workers in the
replica's placement group). `--replicas N` is N data-parallel engines; Serve's router sends
each request to the replica with fewer requests in flight.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

import ray
from prometheus_client import CollectorRegistry
from ray import serve

from kvray.cluster.engine import ACTOR_NAMESPACE
from kvray.config import EngineConfig
from kvray.core import RequestRejected, SamplingParams, TokenEvent

SCHEDULER_PREFIX = "kvray-scheduler-"


@dataclass(frozen=True)
class ServeSettings:
    """What `kvray serve` resolved once, handed to every replica as plain data."""

    engine: dict[str, Any]  # EngineConfig fields; `model` is a resolved checkpoint dir
    model_name: str
    app_name: str = "kvray"
    replicas: int = 1
    api_key: str | None = None
    compiled: bool = True
    worker_cpus: float = 1.0

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self.engine)


def _unwrap(e: BaseException) -> BaseException:
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


@serve.deployment(
    ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000, health_check_period_s=5
)
class EngineDeployment:
    def __init__(self, settings: dict[str, Any]) -> None:
        from kvray.cluster.engine import Engine  # noqa: I001 (torch loads here, not at import)

        s = ServeSettings(**settings)
        self.name = f"{SCHEDULER_PREFIX}{s.app_name}-{uuid.uuid4().hex[:12]}"
        self.engine = Engine(
            s.engine_config,
            compiled=s.compiled,
            worker_cpus=s.worker_cpus,
            progress=False,
            name=self.name,
        )
        self.actor = self.engine.actor

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[tuple[str, int] | list[TokenEvent]]:
        """First yields (scheduler actor name, request id), then batches of events."""
        try:
            rid = await self.actor.submit.remote(input_ids, sampling)
        except Exception as e:
            raise _unwrap(e) from None
        yield (self.name, rid)
        done = False
        try:
            async for ref in self.actor.stream.options(num_returns="streaming").remote(rid):
                batch = await ref
                yield batch
                done = bool(batch) and batch[-1].finished
        finally:
            if not done:  # the caller went away: free the request's pages now
                self.actor.abort.remote(rid, "abort")

    async def stats(self) -> dict[str, Any]:
        return await self.actor.stats.remote()

    async def check_health(self) -> None:
        await self.actor.ready.remote()


class _ServeStream:
    def __init__(self, gen: Any, actor: Any, rid: int) -> None:
        self._gen = gen
        self._actor = actor
        self._rid = rid

    async def __aiter__(self) -> AsyncIterator[list[TokenEvent]]:
        async for batch in self._gen:
            yield batch

    async def abort(self, reason: str) -> None:
        self._actor.abort.remote(self._rid, reason)  # fire and forget: never blocks a cancel
        self._gen.cancel()


class ServeEngineClient:
    """EngineClient over the engine deployment's handle."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle.options(stream=True)
        self._actors: dict[str, Any] = {}

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> _ServeStream:
        gen = self._handle.generate.remote(input_ids, sampling)
        try:
            name, rid = await gen.__anext__()
        except Exception as e:
            err = _unwrap(e)
            if isinstance(err, RequestRejected):
                raise err from None
            raise
        actor = self._actors.get(name)
        if actor is None:
            actor = self._actors[name] = ray.get_actor(name, namespace=ACTOR_NAMESPACE)
        return _ServeStream(gen, actor, rid)


def engine_stats(app_name: str) -> list[dict[str, Any]]:
    """Stats of every engine of the app, found by their schedulers' names."""
    prefix = f"{SCHEDULER_PREFIX}{app_name}-"
    names = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)
    ]
    refs = []
    for a in names:
        try:
            refs.append(ray.get_actor(a["name"], namespace=a["namespace"]).stats.remote())
        except ValueError:
            continue  # went away since the listing
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=5))
        except Exception:  # noqa: BLE001 - a dying engine must not break /metrics
            continue
    return out


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
@serve.ingress()
class Ingress:
    def __init__(self, engine: Any, settings: dict[str, Any]) -> None:
        from kvray.cluster.llm import load_tokenizer
        from kvray.cluster.spec import EngineSpec
        from kvray.deploy.metrics import EngineCollector, RequestMetrics
        from kvray.deploy.openai import OpenAIServing

        s = ServeSettings(**settings)
        self.settings = s
        spec = EngineSpec.resolve(s.engine_config, progress=False)
        self.registry = CollectorRegistry()
        metrics = RequestMetrics(self.registry, s.model_name)
        self.registry.register(EngineCollector(s.model_name, lambda: engine_stats(s.app_name)))
        self.serving = OpenAIServing(
            s.model_name,
            load_tokenizer(spec.model_path),
            spec.max_seq_len,
            spec.vocab_size,
            ServeEngineClient(engine),
            metrics,
        )

    async def _healthy(self) -> bool:
        import asyncio

        stats = await asyncio.to_thread(engine_stats, self.settings.app_name)
        return len(stats) >= 1

    def __serve_build_asgi_app__(self) -> Any:
        from kvray.deploy.api import create_app

        return create_app(self.serving, self.registry, self.settings.api_key, self._healthy)


def build_app(settings: ServeSettings) -> Any:
    raw = asdict(settings)
    engine = EngineDeployment.options(num_replicas=settings.replicas).bind(raw)
    return Ingress.bind(engine, raw)
