"""The supervision tree of the daemon, declared once, as data.

    root (one_for_one)
    ├── catalog      worker, permanent: local GGUF files registered at boot
    ├── store        worker, permanent: manifests and blobs under the cache root
    ├── admission    worker, permanent: per-model FIFO queues
    ├── keepalive    worker, permanent: active requests and unload timers per model
    ├── loader       worker, permanent: loads and unloads models
    ├── evictor      worker, permanent: unloads idle models under memory pressure
    ├── models_sup   supervisor, simple_one_for_one
    │   └── modelsup:<model>   supervisor (one_for_one), temporary: one per loaded model
    │       └── model:<model>  EngineWorker, permanent: owns the model's engine thread
    ├── pull_sup     supervisor, simple_one_for_one
    │   └── pull:<model>   PullCoordinator, temporary: one per model being pulled
    └── mcp_sup      supervisor (one_for_one), when [mcp.servers] lists any
        └── mcp:<name>     McpServer, permanent: a tool server's connection

guides/supervision.md draws the tree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial
from typing import Any

import pykka

from barrel.actors.admission import ModelQueues
from barrel.actors.catalog import Catalog
from barrel.actors.child import Link
from barrel.actors.evictor import Evictor
from barrel.actors.keepalive import Keepalive
from barrel.actors.loader import Loader, start_model_subtree
from barrel.actors.mcp import McpServer, ToolDirectory
from barrel.actors.pulls import PullCoordinator
from barrel.actors.store_actor import StoreActor
from barrel.actors.supervisor import (
    ChildSpec,
    ChildType,
    Restart,
    Strategy,
    SupervisorEnv,
    SupFlags,
    supervisor_spec,
)
from barrel.actors.timers import Timers
from barrel.config import Config, SupervisorLimits, parse_duration
from barrel.engine.kvdisk import KVDisk
from barrel.engine.residency import ResidencyTracker
from barrel.store.sources import Registries
from barrel.store.store import ModelStore

ROOT = "root"
CATALOG = "catalog"
STORE = "store"
PULL_SUP = "pull_sup"
ADMISSION, KEEPALIVE, LOADER, MODELS_SUP = "admission", "keepalive", "loader", "models_sup"
EVICTOR = "evictor"
MCP_SUP = "mcp_sup"


def _flags(strategy: Strategy, limits: SupervisorLimits) -> SupFlags:
    return SupFlags(strategy, intensity=limits.intensity, period=limits.period_s)


def registries(config: Config) -> Registries:
    return Registries(
        dict(config.registry.hosts),
        config.registry.huggingface,
        private_networks=config.registry.private_networks,
    )


def daemon_tree(
    config: Config,
    env: SupervisorEnv,
    local_models: Mapping[str, str],
    store: ModelStore,
    timers: Timers,
    tracker: ResidencyTracker | None = None,
    metrics: Any = None,
    kv_disk: KVDisk | None = None,
    tools: ToolDirectory | None = None,
) -> ChildSpec:
    sup = config.supervision
    keep_alive = parse_duration(config.models.default_keep_alive)
    model_subtree = ChildSpec(
        "model",
        start_model_subtree,
        restart=Restart.TEMPORARY,
        type=ChildType.SUPERVISOR,
        shutdown=60.0,
    )
    pull = ChildSpec(
        "pull",
        partial(_start_pull, store=store, registries=registries(config)),
        restart=Restart.TEMPORARY,
        shutdown=5.0,
    )
    return supervisor_spec(
        ROOT,
        _flags(Strategy.ONE_FOR_ONE, sup.root),
        [
            ChildSpec(
                CATALOG,
                partial(
                    Catalog.start,
                    local=dict(local_models),
                    projectors=dict(config.models.projectors),
                ),
            ),
            ChildSpec(STORE, partial(StoreActor.start, store=store)),
            ChildSpec(ADMISSION, ModelQueues.start),
            ChildSpec(
                KEEPALIVE,
                partial(
                    Keepalive.start,
                    registry=env.registry,
                    timers=timers,
                    default_keep_alive=keep_alive,
                    loader=LOADER,
                ),
            ),
            ChildSpec(
                LOADER,
                partial(
                    Loader.start,
                    registry=env.registry,
                    env=env,
                    models_sup=MODELS_SUP,
                    keepalive=KEEPALIVE,
                    intensity=sup.models.intensity,
                    period=sup.models.period_s,
                    tracker=tracker,
                    metrics=metrics,
                    kv_disk=kv_disk,
                ),
                shutdown=60.0,
            ),
            ChildSpec(
                EVICTOR,
                partial(
                    Evictor.start,
                    registry=env.registry,
                    timers=timers,
                    watermark=config.models.memory_watermark_bytes,
                    interval=config.models.evictor_interval_s,
                    budget=config.models.memory_budget_bytes,
                    keepalive=KEEPALIVE,
                    loader=LOADER,
                ),
            ),
            supervisor_spec(
                MODELS_SUP,
                SupFlags(Strategy.SIMPLE_ONE_FOR_ONE, 0, 1.0),
                [model_subtree],
                env,
                shutdown=120.0,
            ),
            supervisor_spec(PULL_SUP, _flags(Strategy.SIMPLE_ONE_FOR_ONE, sup.pulls), [pull], env),
            *_tool_servers(config, env, tools),
        ],
        env,
    )


def _tool_servers(
    config: Config, env: SupervisorEnv, tools: ToolDirectory | None
) -> list[ChildSpec]:
    """The tool servers' subtree: a child per configured server, restarted on its own
    (a server's connection restarts itself with backoff; a restart here is for a bug)."""
    if tools is None or not config.mcp.servers:
        return []
    children = [
        ChildSpec(
            f"mcp:{name}",
            partial(
                McpServer.start_child,
                name=name,
                config=server,
                limits=config.mcp,
                directory=tools,
            ),
            shutdown=15.0,
        )
        for name, server in config.mcp.servers.items()
    ]
    flags = SupFlags(Strategy.ONE_FOR_ONE, intensity=10, period=60.0)
    return [supervisor_spec(MCP_SUP, flags, children, env, shutdown=30.0)]


def _start_pull(
    link: Link,
    model: str,
    first: Any = None,
    insecure: bool = False,
    *,
    store: ModelStore,
    registries: Registries,
) -> pykka.ActorRef[Any]:
    """A pull coordinator; `insecure` (the starting request's) allows plain http."""
    if insecure:
        registries = dataclasses.replace(registries, insecure=True)
    return PullCoordinator.start(link, store, model, registries, first)
