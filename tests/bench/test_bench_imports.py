"""The dependency between bench/ and tests/ goes one way: tests may import bench's shared harness
(``bench.harness``, ``bench.routing``), nothing under bench/ imports ``tests`` (not in an import
statement, nor in the code string a bench hands to a child process)."""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: An import of tests inside a string: ``python -c "from tests.x import main; ..."``.
CODE_STRING = re.compile(r"(?:^|[;\n]\s*)(?:from\s+tests(?:\.\w+)*\s+import|import\s+tests\b)")


def imports_of_tests(source: str, filename: str = "<source>") -> list[str]:
    """``line: what`` for every import of the ``tests`` package in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            names = [str(node.args[0].value)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and CODE_STRING.search(node.value):
            found.append(f"{node.lineno}: in a code string: {node.value.strip()[:80]!r}")
            continue
        else:
            continue
        found += [f"{node.lineno}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    return found


def bench_sources() -> list[str]:
    out = []
    for d, dirs, files in os.walk(os.path.join(ROOT, "bench")):
        dirs[:] = [x for x in dirs if x not in ("results", "data", "__pycache__")]
        out += [os.path.join(d, f) for f in files if f.endswith(".py")]
    return sorted(out)


def test_no_bench_module_imports_tests():
    sources = bench_sources()
    assert len(sources) >= 30, sources  # the walk found the benches
    bad = {os.path.relpath(p, ROOT): hits for p in sources if (hits := imports_of_tests(open(p).read(), p))}
    assert not bad, bad


def test_the_check_finds_every_form_of_importing_tests():
    """The check above cannot pass by finding nothing: each of these imports tests."""
    for src in ("import tests.daemon\n", "import os, tests\n", "from tests.daemon import Daemon\n",
                "from tests import conftest\n", "def f():\n    from tests.redis_servers import cli\n",
                "import importlib\nimportlib.import_module('tests.conftest')\n",
                "code = 'import sys; from tests.reliability.test_crash import worker_main; worker_main()'\n"):
        assert imports_of_tests(src), src
    for src in ("import bench.harness.daemon\n", "from bench.harness import crash\n", "import testsuite\n",
                "from .tests import x\n", "doc = 'the tests import this module'\n", "from testing import x\n"):
        assert not imports_of_tests(src), src
