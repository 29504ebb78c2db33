"""Small real images for the vision tests (PNG written by hand: no imaging library)."""

from __future__ import annotations

import base64

from barrel.engine.projector import solid_png

__all__ = ["BLUE", "RED", "data_url", "solid_png"]


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


RED = solid_png((255, 0, 0))
BLUE = solid_png((0, 0, 255))
