"""One exception base: every exception class autoplace defines derives from AutoplaceError,
and keeps its builtin base so `except ValueError` code written before it still works."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import autoplace
from autoplace import AutoplaceError


def _autoplace_modules() -> list[str]:
    names = ["autoplace"]
    for info in pkgutil.walk_packages(autoplace.__path__, prefix="autoplace."):
        names.append(info.name)
    return sorted(names)


def _defined_exceptions() -> dict[str, type]:
    found: dict[str, type] = {}
    for name in _autoplace_modules():
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name:
                found[f"{name}.{attr}"] = obj
    return found


def test_every_exception_class_derives_from_autoplace_error() -> None:
    found = _defined_exceptions()
    assert len(found) >= 15, sorted(found)  # the walk reached the package (15 classes when this was written)
    outside = sorted(name for name, cls in found.items() if not issubclass(cls, AutoplaceError))
    assert not outside, f"exception classes not derived from autoplace.AutoplaceError: {outside}"


def test_builtin_bases_are_kept() -> None:
    from autoplace.placement import PlacementError
    from autoplace.errors import NoFitError
    from autoplace.rewrite.runtime import PipelineTimeoutError

    assert issubclass(PlacementError, ValueError) and issubclass(NoFitError, RuntimeError)
    assert issubclass(PipelineTimeoutError, TimeoutError)
    assert autoplace.AutoplaceError is AutoplaceError and "AutoplaceError" in autoplace.__all__


def test_one_profile_error() -> None:
    """A PipeDream file that cannot be read and a model that cannot be profiled raise one class."""
    from autoplace.cost.profile import ProfileError as MeasureError
    from autoplace.graph.pipedream import ProfileError as FileError

    assert MeasureError is FileError and issubclass(FileError, AutoplaceError)


def test_unknown_planner_is_an_autoplace_error_with_a_plain_message() -> None:
    from autoplace.planners import get_planner

    with pytest.raises(AutoplaceError) as info:
        get_planner("eagel")
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    assert str(info.value).startswith("no planner named 'eagel'; registered planners: ")  # no KeyError quotes
