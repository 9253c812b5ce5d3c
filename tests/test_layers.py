"""The daemon package's layers (kvcached/README.md's table) hold: a module imports only modules of
its own layer or below, and the package's module-level imports form no circle. Read from the
source with ast (imports inside functions count too: they are dependencies all the same)."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Top to bottom, as kvcached/README.md lists them; a module belongs to its longest prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("service", ("kvcached.service", "kvcached.daemon", "kvcached.settings", "kvcached.cli",
                 "kvcached.costreport")),
    ("operations", ("kvcached.systemd", "kvcached.journal", "kvcached.metrics", "kvcached.dashboards")),
    ("facade", ("kvcached.store",)),
    ("policy", ("kvcached.reads", "kvcached.writes", "kvcached.movement", "kvcached.writeback", "kvcached.rebuild",
                "kvcached.publish", "kvcached.remotefill", "kvcached.events")),
    ("records", ("kvcached.receipts", "kvcached.stats")),
    ("bookkeeping", ("kvcached.index", "kvcached.leases", "kvcached.promptshape")),
    ("bytes", ("kvcached.tiers",)),
    ("identity", ("kvcached.hashmemo", "kvcached.config", "kvcached.units", "kvcached.progress")),
    ("contract", ("kvcached.contract", "kvcached.v1")),
    ("package", ("kvcached",)),
]

#: Imports that break the rule today, each with why; the list may only shrink.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def layer(module: str) -> tuple[int, str] | None:
    best: tuple[int, str, int] | None = None
    for rank, (name, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[2]):
                best = (rank, name, len(p))
    return None if best is None else (best[0], best[1])


def modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "kvcached")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[mod.removesuffix(".__init__")] = path
    return out


def imports(source: str, *, top_level_only: bool = False) -> Iterator[str]:
    """Absolute imports in ``source``; with ``top_level_only``, those that run at import time
    (not inside functions, nor under ``if TYPE_CHECKING``)."""
    tree = ast.parse(source)
    nodes = ast.walk(tree) if not top_level_only else _top_level(tree.body)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])


def upward(module: str, source: str) -> list[tuple[str, str]]:
    """(module, target) for each import of ``source`` that goes to a higher layer."""
    mine = layer(module)
    assert mine is not None, f"{module} is in no layer: add it to LAYERS (and the README's table)"
    out = []
    for target in imports(source):
        if target.startswith(("kvcached_client", "kvcached_router", "kvcachectl")):
            out.append((module, target.split(".")[0]))  # the clients sit above the whole daemon package
        elif target == "kvcached" or target.startswith("kvcached."):
            theirs = layer(target)
            assert theirs is not None, f"{target} (imported by {module}) is in no layer"
            if theirs[0] < mine[0]:
                out.append((module, target))
    return out


def test_every_import_goes_down_the_layers():
    found = {pair for mod, path in modules().items() for pair in upward(mod, open(path).read())}
    assert found - KNOWN_UPWARD.keys() == set(), "imports that go up a layer"
    assert KNOWN_UPWARD.keys() - found == set(), "fixed: take them off KNOWN_UPWARD"


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(t, path + [t])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_no_import_circle():
    mods = modules()
    graph = {m: {t for t in imports(open(p).read(), top_level_only=True) if t in mods and t != m}
             for m, p in mods.items()}
    found = circle(graph)
    assert found is None, "import circle: " + " -> ".join(found or [])


def test_the_checks_see_an_upward_import_and_a_hidden_one():
    """Positive controls: a bookkeeping module importing the store is caught, also inside a
    function; an import under TYPE_CHECKING does not run, so it is no circle."""
    src = "def f():\n    from kvcached.store import Store\n"
    assert upward("kvcached.leases", src) == [("kvcached.leases", "kvcached.store")]
    # The operators' command sits above the daemon package, as the client does.
    assert upward("kvcached.cli", "from kvcachectl.doctor import print_checks\n") == [("kvcached.cli", "kvcachectl")]
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvcached.store\n"
    assert list(imports(guarded, top_level_only=True)) == ["typing"]
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set()}) is None


#: What the clients (the client library with its connectors, and the router) may import of the
#: daemon package: the shared contract and the generated gRPC code. kvcachectl, an operator's tool
#: on the daemon's host, may read the daemon's own files and is not held to it.
CLIENT_PACKAGES = ("kvcached_client", "kvcached_router")
CONTRACT = ("kvcached.contract", "kvcached.v1")


def client_sources() -> dict[str, str]:
    out = {}
    for pkg in CLIENT_PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, "clients", pkg)):
            out.update({os.path.join(dirpath, f): open(os.path.join(dirpath, f)).read()
                        for f in files if f.endswith(".py")})
    return out


def beyond_contract(source: str) -> list[str]:
    """The imports of ``source`` that reach into the daemon package outside its contract."""
    return [t for t in imports(source)
            if (t == "kvcached" or t.startswith("kvcached.")) and not t.startswith(tuple(c + "." for c in CONTRACT))
            and t not in CONTRACT]


def test_the_clients_import_only_the_contract_of_the_daemon_package():
    sources = client_sources()
    assert len(sources) > 30, sorted(sources)  # the walk found the packages
    bad = {os.path.relpath(p, ROOT): found for p, src in sources.items() if (found := beyond_contract(src))}
    assert bad == {}, bad


def test_the_contract_imports_nothing_else_of_kvcached():
    found = {mod: [t for t in imports(open(path).read()) if t.startswith("kvcached.")
                   and not t.startswith(("kvcached.contract", "kvcached.v1"))]
             for mod, path in modules().items() if mod.startswith("kvcached.contract")}
    assert len(found) >= 10, sorted(found)
    assert {m: ts for m, ts in found.items() if ts} == {}


def test_the_client_check_sees_a_reach_into_the_daemon():
    """Positive control: a client importing the store, a tier or the settings is caught, also
    inside a function; the contract and the generated code are not."""
    assert beyond_contract("from kvcached.store import Store\n") == ["kvcached.store"]
    assert beyond_contract("def f():\n    import kvcached.tiers.pool_shm\n") == ["kvcached.tiers.pool_shm"]
    assert beyond_contract("from kvcached.settings import default_socket\n") == ["kvcached.settings"]
    assert beyond_contract("from kvcached.contract.keys import KVLayout\nfrom kvcached.v1 import kvcached_pb2\n"
                           "import kvcached_client.client\n") == []
