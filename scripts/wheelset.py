#!/usr/bin/env python3
"""The wheels scripts/gpu-check carries to the offline GPU machine, from the project's own metadata.

The requirement list is read, never kept by hand: ``[project].dependencies`` of pyproject.toml,
plus pytest (its requirement as the ``test`` extra states it) for the tests that run there. torch is
not in it (pyproject leaves it out on purpose; the GPU machine's python has a CUDA build).

  wheelset.py requirements
        print the list, one a line
  wheelset.py download DEST [--python 3.12] [--machine x86_64]
        binary wheels of the list and of everything it needs (pip resolves), for that CPython on
        manylinux; then check that DEST alone covers the whole dependency closure for that target
        (pip evaluates environment markers for the python running it, not for the target)
  wheelset.py venv VENV [--site DIR ...]
        a venv without pip that sees this checkout (kvcached, kvcached_client), the given site
        directories (default: those of the python running this) after its own site-packages, so
        what is installed there wins, and ``kvcached`` / ``kvcachectl`` launchers; prints its
        site-packages
  wheelset.py install WHEELS --target SITE [--pip PYTHON]
        run by the venv's python: check this environment against the list and the requirements of
        everything in it, install from WHEELS (``pip install --no-index --no-deps``, PYTHON's pip)
        what is missing or too old, then check again
  wheelset.py check [WHEELS]
        the check alone; exit 1 if anything is missing or too old (and, with WHEELS, not carried)

Exit status 0 when done, 1 when not (the reason on stderr). Imported by tests/test_wheelset.py,
which builds a wheel set for its own python with these functions and starts the daemon from it.
"""

from __future__ import annotations

import argparse
import email.parser
import glob
import importlib
import importlib.metadata as md
import os
import site
import subprocess
import sys
import venv as venv_module
import zipfile
from typing import Iterable, NamedTuple, Sequence


def _load_packaging(wheel_dir: str | None = None) -> bool:
    """Import what is used of ``packaging``: the environment's, else pip's copy, else the packaging
    wheel in ``wheel_dir`` (a pure-python wheel imports as a zip; :func:`download` always fetches
    one), since the venv scripts/gpu-check checks may see neither. True when imported."""
    global default_environment, Requirement, SpecifierSet, compatible_tags, cpython_tags, sys_tags
    global canonicalize_name, parse_wheel_filename, InvalidVersion, Version
    try:
        import packaging.markers as m, packaging.requirements as r, packaging.specifiers as s  # noqa: E401
        import packaging.tags as t, packaging.utils as u, packaging.version as v  # noqa: E401
    except ImportError:
        try:
            import pip._vendor.packaging.markers as m, pip._vendor.packaging.requirements as r  # noqa: E401
            import pip._vendor.packaging.specifiers as s, pip._vendor.packaging.tags as t  # noqa: E401
            import pip._vendor.packaging.utils as u, pip._vendor.packaging.version as v  # noqa: E401
        except ImportError:
            found = sorted(glob.glob(os.path.join(wheel_dir, "packaging-*-py3-none-any.whl"))) if wheel_dir else []
            if not found:
                return False
            sys.path.append(found[-1])
            try:
                import packaging.markers as m, packaging.requirements as r, packaging.specifiers as s  # noqa: E401
                import packaging.tags as t, packaging.utils as u, packaging.version as v  # noqa: E401
            finally:  # off the path again, or the check would count it as installed
                sys.path.remove(found[-1])
                importlib.invalidate_caches()
    default_environment, Requirement, SpecifierSet = m.default_environment, r.Requirement, s.SpecifierSet
    compatible_tags, cpython_tags, sys_tags = t.compatible_tags, t.cpython_tags, t.sys_tags
    canonicalize_name, parse_wheel_filename = u.canonicalize_name, u.parse_wheel_filename
    InvalidVersion, Version = v.InvalidVersion, v.Version
    return True


def _need_packaging(wheel_dir: str | None = None) -> None:
    if "Requirement" not in globals() and not _load_packaging(wheel_dir):
        raise RuntimeError("no packaging module here, nor pip's, nor a packaging wheel in " + str(wheel_dir))


_load_packaging()

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib
    except ImportError:
        from pip._vendor import tomli as tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPROJECT = os.path.join(REPO, "pyproject.toml")
#: The GPU machine's python (the device tool's notes: CPython 3.12 on x86_64 Linux).
DEVICE_PYTHON = "3.12"
DEVICE_MACHINE = "x86_64"
#: Of the test extra, what the tests run on the GPU machine need (hypothesis etc. are not used there).
TEST_REQUIREMENTS = ("pytest",)


def requirements(pyproject: str = PYPROJECT, test: Iterable[str] = TEST_REQUIREMENTS) -> list[str]:
    """``[project].dependencies``, then the named entries of the ``test`` extra, as written there."""
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project.get("dependencies", []))
    extra = project.get("optional-dependencies", {}).get("test", [])
    for name in test:
        found = [r for r in extra if canonicalize_name(Requirement(r).name) == canonicalize_name(name)]
        if not found:
            raise ValueError(f"{pyproject}: the test extra has no {name}")
        reqs += found
    return reqs


def platforms(machine: str = DEVICE_MACHINE) -> list[str]:
    """The manylinux platform tags accepted, best first (glibc 2.28 and older)."""
    tags = [f"manylinux_2_28_{machine}", f"manylinux_2_27_{machine}", f"manylinux_2_17_{machine}",
            f"manylinux2014_{machine}"]
    return tags + ([f"manylinux1_{machine}"] if machine in ("x86_64", "i686") else [])


class Target(NamedTuple):
    """Where wheels are to be installed: its environment-marker values and its wheel tags."""
    env: dict[str, str]
    tags: frozenset


def target(python: str | None = None, machine: str | None = None) -> Target:
    """CPython ``python`` ("3.12") on manylinux ``machine``; None for both: the running python."""
    if python is None and machine is None:
        return Target(dict(default_environment()), frozenset(sys_tags()))
    python = python or f"{sys.version_info[0]}.{sys.version_info[1]}"
    machine = machine or DEVICE_MACHINE
    version = tuple(int(x) for x in python.split("."))[:2]
    plats = platforms(machine)
    env = dict(default_environment())
    env.update(python_version=python, python_full_version=f"{python}.0", implementation_name="cpython",
               implementation_version=f"{python}.0", platform_python_implementation="CPython",
               sys_platform="linux", platform_system="Linux", os_name="posix", platform_machine=machine)
    tags = list(cpython_tags(version, platforms=plats))
    tags += compatible_tags(version, f"cp{version[0]}{version[1]}", plats)
    return Target(env, frozenset(tags))


def download(dest: str, reqs: Sequence[str] | None = None, python: str = DEVICE_PYTHON,
             machine: str = DEVICE_MACHINE) -> list[str]:
    """Download binary wheels of ``reqs`` (default: :func:`requirements`) and all they depend on
    into ``dest``, for CPython ``python`` on manylinux ``machine``, with the running python's pip
    and its configured index; then check that ``dest`` alone covers them there. Returns the wheel
    paths; raises RuntimeError on failure (``.output`` holds pip's output)."""
    reqs = requirements() if reqs is None else list(reqs)
    os.makedirs(dest, exist_ok=True)
    # --only-binary=:all: lets pip resolve dependencies under --platform / --python-version
    # (without it pip insists on --no-deps there).
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp"]
    for p in platforms(machine):
        cmd += ["--platform", p]
    # packaging for this module itself on the GPU machine (see _load_packaging).
    r = subprocess.run(cmd + ["-d", dest, *reqs, "packaging"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        e = RuntimeError(f"pip download failed (exit {r.returncode}):\n{r.stdout}")
        e.output = r.stdout  # type: ignore[attr-defined]
        raise e
    p = plan(reqs, dest, target(python, machine), installed=False)
    if p.problems:
        raise RuntimeError("the downloaded wheels do not cover the requirements:\n" + "\n".join(p.problems))
    return p.wheels


class Plan(NamedTuple):
    rows: list[str]  #: what was found for each requirement, one line each
    wheels: list[str]  #: the wheels to install
    problems: list[str]  #: requirements nothing satisfies; empty when all is well


def _wheel_index(wheel_dir: str | None, tags: frozenset) -> dict[str, list[tuple[Version, str]]]:
    """The wheels in ``wheel_dir`` installable on ``tags``, by project name, newest first."""
    index: dict[str, list[tuple[Version, str]]] = {}
    if wheel_dir and os.path.isdir(wheel_dir):
        for f in sorted(os.listdir(wheel_dir)):
            if not f.endswith(".whl"):
                continue
            try:
                name, version, _, wtags = parse_wheel_filename(f)
            except Exception:  # noqa: BLE001 - an odd file name: not a wheel we can use
                continue
            if tags & frozenset(wtags):
                index.setdefault(name, []).append((version, os.path.join(wheel_dir, f)))
    for v in index.values():
        v.sort(reverse=True)
    return index


def _wheel_requires(path: str) -> list[str]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []


def _satisfies(version: str | Version, specs: Iterable[SpecifierSet]) -> bool:
    try:
        v = version if isinstance(version, Version) else Version(version)
    except InvalidVersion:
        return False
    return all(s.contains(v, prereleases=True) for s in specs)


def plan(reqs: Sequence[str], wheel_dir: str | None, where: Target | None = None, installed: bool = True) -> Plan:
    """Walk ``reqs`` and, recursively, the requirements of whatever satisfies each of them: an
    installed distribution (``installed``: this interpreter's, which must then be the target) or
    else the newest fitting wheel in ``wheel_dir``. Markers are evaluated for ``where``."""
    where = where or target()
    wheels = _wheel_index(wheel_dir, where.tags)
    specs: dict[str, list[SpecifierSet]] = {}
    chosen: dict[str, tuple[str, str | None]] = {}  # name -> (version, wheel path or None if installed)
    rows: list[str] = []
    problems: list[str] = []
    #: (requirement, who needs it, the extras asked of that one)
    todo: list[tuple[str, str | None, tuple[str, ...]]] = [(r, None, ()) for r in reqs]
    while todo:
        text, parent, extras = todo.pop(0)
        req = Requirement(text)
        if req.marker is not None and not any(req.marker.evaluate(dict(where.env, extra=e))
                                              for e in (*extras, "")):
            continue
        name = canonicalize_name(req.name)
        specs.setdefault(name, []).append(req.specifier)
        why = f"needs {text}" + (f" (for {parent})" if parent else "")
        if name in chosen and _satisfies(chosen[name][0], specs[name]):
            continue
        have = None
        if installed:
            try:
                dist = md.distribution(req.name)
                have = dist.version
            except md.PackageNotFoundError:
                dist = None
        if have is not None and _satisfies(have, specs[name]):
            chosen[name] = (have, None)
            rows.append(f"  {req.name} {have}: {why}")
            deps = dist.requires or []
        else:
            fit = [(v, p) for v, p in wheels.get(name, []) if _satisfies(v, specs[name])]
            state = have or ("(missing)" if installed else "(no wheel)")
            if not fit:
                rows.append(f"  {req.name} {state}: {why} -> no fitting wheel")
                problems.append(f"{req.name} {state}: {why}, and no wheel " + (f"in {wheel_dir} " if wheel_dir else "")
                                + "satisfies " + ", ".join(str(s) or "any version" for s in specs[name]))
                continue
            version, path = fit[0]
            chosen[name] = (str(version), path)
            rows.append(f"  {req.name} {state}: {why} -> install {os.path.basename(path)}" if installed
                        else f"  {req.name}: {why} -> {os.path.basename(path)}")
            deps = _wheel_requires(path)
        todo += [(d, req.name, tuple(sorted(req.extras))) for d in deps]
    return Plan(rows, [p for _, p in chosen.values() if p is not None], problems)


def make_venv(path: str, site_dirs: Sequence[str] | None = None) -> tuple[str, str]:
    """A venv at ``path`` without pip (made from the running python), seeing this checkout and
    ``site_dirs`` (default: the running python's site directories) through ``site.addsitedir``,
    after its own site-packages, which therefore win; with ``kvcached`` / ``kvcachectl``
    launchers in its bin (bench/harness/daemon.py starts ``kvcached`` from beside sys.executable).
    A venv made from a venv's python would not see that venv's packages, hence the ``.pth``.
    Returns (its python, its site-packages)."""
    if site_dirs is None:
        site_dirs = [d for d in [*site.getsitepackages(), site.getusersitepackages()] if os.path.isdir(d)]
    venv_module.EnvBuilder(with_pip=False, clear=True).create(path)
    python = os.path.join(path, "bin", "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, stdout=subprocess.PIPE, text=True).stdout.strip()
    with open(os.path.join(purelib, "kvcached-checkout.pth"), "w") as f:
        f.write(f"{REPO}\n{os.path.join(REPO, 'clients')}\n")
        f.writelines(f"import site; site.addsitedir({d!r})\n" for d in site_dirs)
    for tool, entry in (("kvcached", "kvcached.cli import kvcached_main as main"), ("kvcachectl", "kvcachectl import main")):
        launcher = os.path.join(path, "bin", tool)
        with open(launcher, "w") as f:
            f.write(f"#!{python}\nfrom {entry}\nraise SystemExit(main())\n")
        os.chmod(launcher, 0o755)
    return python, purelib


def check(reqs: Sequence[str] | None = None, wheel_dir: str | None = None, out=sys.stdout) -> Plan:
    """:func:`plan` for this interpreter, its rows printed to ``out``."""
    _need_packaging(wheel_dir)
    p = plan(requirements() if reqs is None else reqs, wheel_dir)
    for row in p.rows:
        print(row, file=out)
    return p


def install(wheel_dir: str, target_dir: str, reqs: Sequence[str] | None = None, pip: str | None = None,
            out=sys.stdout) -> int:
    """Check this environment; install what is missing or too old from ``wheel_dir`` into
    ``target_dir`` with ``pip``'s pip (a python; default this one); check again. 0 when all is
    satisfied, else 1 (the reason on stderr)."""
    _need_packaging(wheel_dir)
    reqs = requirements() if reqs is None else list(reqs)
    print("requirements:", file=out)
    p = check(reqs, wheel_dir, out)
    if p.problems:
        print("wheelset: missing or too old, and no wheel was carried for it: " + "; ".join(p.problems)
              + "\n  run `scripts/gpu-check --prepare` on a machine with PyPI and carry build/gpu-wheels",
              file=sys.stderr)
        return 1
    if not p.wheels:
        return 0
    print(f"installing into {target_dir}: " + " ".join(os.path.basename(w) for w in p.wheels), file=out)
    out.flush()
    # Only these wheels: pip's configuration (an index, find-links, constraints) is left out.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    r = subprocess.run([pip or sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheel_dir,
                        "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade", "--target", target_dir, *p.wheels],
                       env=env)
    if r.returncode != 0:
        print(f"wheelset: pip install failed (exit {r.returncode})", file=sys.stderr)
        return 1
    importlib.invalidate_caches()
    print("after installing:", file=out)
    p = check(reqs, None, out)
    if p.problems:
        print("wheelset: still missing or too old after installing the carried wheels: " + "; ".join(p.problems),
              file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wheelset.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("requirements")
    d = sub.add_parser("download")
    d.add_argument("dest")
    d.add_argument("--python", default=DEVICE_PYTHON)
    d.add_argument("--machine", default=DEVICE_MACHINE)
    v = sub.add_parser("venv")
    v.add_argument("path")
    v.add_argument("--site", action="append", help="a site directory to see (default: this python's)")
    i = sub.add_parser("install")
    i.add_argument("wheels")
    i.add_argument("--target", required=True, help="where to install (the venv's site-packages)")
    i.add_argument("--pip", help="a python whose pip installs (default: this one)")
    c = sub.add_parser("check")
    c.add_argument("wheels", nargs="?")
    args = ap.parse_args(argv)
    try:
        _need_packaging(getattr(args, "wheels", None))
    except RuntimeError as e:
        print(f"wheelset: {e}", file=sys.stderr)
        return 1
    if args.cmd == "requirements":
        print("\n".join(requirements()))
        return 0
    if args.cmd == "download":
        try:
            wheels = download(args.dest, python=args.python, machine=args.machine)
        except RuntimeError as e:
            print(f"wheelset: {e}", file=sys.stderr)
            return 1
        print(f"wheelset: {len(wheels)} wheels for CPython {args.python} on {args.machine} in {args.dest}")
        return 0
    if args.cmd == "venv":
        print(make_venv(args.path, args.site)[1])
        return 0
    if args.cmd == "install":
        return install(args.wheels, args.target, pip=args.pip)
    p = check(None, args.wheels)
    if p.problems:
        print("wheelset: " + "; ".join(p.problems), file=sys.stderr)
    return 1 if p.problems else 0


if __name__ == "__main__":
    sys.exit(main())
