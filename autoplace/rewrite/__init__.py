"""Apply a plan to a real model: device-placed GraphModules (model parallel) and pipeline stages."""

from __future__ import annotations

from .placed import PlacementRewriteError, place_module

__all__ = ["place_module", "PlacementRewriteError"]
