"""The supervision tree of the daemon, declared once, as data.

    root (one_for_one)
    └── catalog      worker, permanent: the models known by name

The lifecycle, store and pull issues add their children here (loader, keepalive,
evictor, session_state, pull_sup, models_sup); guides/supervision.md draws the tree.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

from barrel.actors.catalog import Catalog
from barrel.actors.supervisor import (
    ChildSpec,
    Restart,
    Strategy,
    SupervisorEnv,
    SupFlags,
    supervisor_spec,
)
from barrel.config import Config, SupervisorLimits

ROOT = "root"
CATALOG = "catalog"


def _flags(strategy: Strategy, limits: SupervisorLimits) -> SupFlags:
    return SupFlags(strategy, intensity=limits.intensity, period=limits.period_s)


def daemon_tree(config: Config, env: SupervisorEnv, local_models: Mapping[str, str]) -> ChildSpec:
    sup = config.supervision
    return supervisor_spec(
        ROOT,
        _flags(Strategy.ONE_FOR_ONE, sup.root),
        [
            ChildSpec(
                CATALOG,
                partial(Catalog.start, local=dict(local_models)),
                restart=Restart.PERMANENT,
            ),
        ],
        env,
    )
