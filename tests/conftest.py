"""Suite-wide ordering: fast tests run before slow ones, so that a failure shows early.

Modules are reordered whole (their module-scoped fixtures, such as a running daemon, stay
shared): every module holding no ``slow`` test runs before any module holding one, and within
each of those two tiers unit, then equivalence, then integration modules. pytest's own order is
kept otherwise.
"""

from __future__ import annotations

import pytest

_GROUPS = ("unit", "equivalence", "integration")


def _group(item: pytest.Item) -> int:
    parts = item.path.parts
    return next((i for i, name in enumerate(_GROUPS) if name in parts), len(_GROUPS))


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    modules: dict[object, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    slow = {path: any(i.get_closest_marker("slow") for i in group) for path, group in modules.items()}
    order = sorted(modules, key=lambda path: (slow[path], _group(modules[path][0])))
    items[:] = [item for path in order for item in modules[path]]
