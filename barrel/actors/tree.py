"""The supervision tree of the daemon, declared once, as data.

    root (one_for_one)
    ├── catalog      worker, permanent: local GGUF files registered at boot
    ├── store        worker, permanent: manifests and blobs under the cache root
    └── pull_sup     supervisor, simple_one_for_one
        └── pull:<model>   PullCoordinator, temporary: one per model being pulled

The lifecycle issue adds loader, keepalive, evictor, session_state and models_sup here;
guides/supervision.md draws the tree.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import pykka

from barrel.actors.catalog import Catalog
from barrel.actors.child import Link
from barrel.actors.pulls import PullCoordinator
from barrel.actors.store_actor import StoreActor
from barrel.actors.supervisor import (
    ChildSpec,
    Restart,
    Strategy,
    SupervisorEnv,
    SupFlags,
    supervisor_spec,
)
from barrel.config import Config, SupervisorLimits
from barrel.store.sources import Registries
from barrel.store.store import ModelStore

ROOT = "root"
CATALOG = "catalog"
STORE = "store"
PULL_SUP = "pull_sup"


def _flags(strategy: Strategy, limits: SupervisorLimits) -> SupFlags:
    return SupFlags(strategy, intensity=limits.intensity, period=limits.period_s)


def registries(config: Config) -> Registries:
    return Registries(dict(config.registry.hosts), config.registry.huggingface)


def daemon_tree(
    config: Config,
    env: SupervisorEnv,
    local_models: Mapping[str, str],
    store: ModelStore,
) -> ChildSpec:
    sup = config.supervision
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
            ChildSpec(CATALOG, partial(Catalog.start, local=dict(local_models))),
            ChildSpec(STORE, partial(StoreActor.start, store=store)),
            supervisor_spec(PULL_SUP, _flags(Strategy.SIMPLE_ONE_FOR_ONE, sup.pulls), [pull], env),
        ],
        env,
    )


def _start_pull(
    link: Link, model: str, first: Any = None, *, store: ModelStore, registries: Registries
) -> pykka.ActorRef[Any]:
    return PullCoordinator.start(link, store, model, registries, first)
