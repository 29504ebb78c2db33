"""openapi.yaml documents every route the daemon serves."""

from __future__ import annotations

from pathlib import Path

import yaml

from barrel.config import Config
from tests.apps import app_for

REPO = Path(__file__).resolve().parents[1]


def test_every_route_is_documented() -> None:
    spec = yaml.safe_load((REPO / "openapi.yaml").read_text())
    assert spec["openapi"].startswith("3.1")
    documented = {
        (path, method.upper())
        for path, ops in spec["paths"].items()
        for method in ops
        if method in ("get", "post", "delete", "head", "put")
    }
    app = app_for(Config())
    served = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter")
        if route.method in ("HEAD", "OPTIONS") and (path, "GET") in documented:
            continue
        served.add((path, route.method))
    missing = served - documented
    assert not missing, f"undocumented routes: {sorted(missing)}"
