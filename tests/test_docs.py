"""The documentation is product: its links resolve, the commands it names exist, and the README's
code blocks run as printed.

Every fenced block of a Markdown file in the repository is one of:

* run: the README's ``python`` and ``sh`` blocks, in order, by :func:`test_readme_blocks_run_as_printed`
  (a ``python`` block against a daemon on the default socket, as after ``./scripts/serve``; a
  block that starts its own daemon, ``./scripts/serve ... &``, gets none);
* checked: ``toml`` (a daemon config file, loaded by the daemon's own loader, or a router config,
  by the router's) and ``json`` (parsed);
* shown: ``text`` (output samples, trees, synopses);
* or preceded by ``<!-- not run: REASON -->``, the reason saying what runs it instead or why
  nothing can here.

A README block that fails fails here with its output, so a quickstart that rots is a red CI run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def markdown_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = [ROOT / p for p in out.split()]
    new = [p for p in (ROOT / "docs").glob("*.md") if p not in files]  # not committed yet
    return sorted(set(files + new))


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    not_run: str | None  # the reason, when marked <!-- not run: ... -->

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.lang or 'no language'})"


FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.search(prev)
        out.append(Block(path, start + 1, lang, "\n".join(body) + "\n", marker.group(1) if marker else None))
        i += 1
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"[`*_]", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def broken_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    bad = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not ours to check offline
        file, _, anchor = target.partition("#")
        if file.startswith("/"):  # from the repository's root, as GitHub renders it
            dest = ROOT / file.lstrip("/")
        elif file.startswith("../") and not (path.parent / file).resolve().is_relative_to(ROOT):
            bad.append(f"{target}: outside the repository")
            continue
        else:
            dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no such heading")
    return bad


def test_every_relative_link_and_anchor_resolves():
    bad = {str(p.relative_to(ROOT)): b for p in markdown_files() if (b := broken_links(p))}
    assert not bad, bad


def test_the_link_checker_sees_a_broken_link(tmp_path):
    """Positive control: a link to a missing file and one to a missing heading are reported."""
    doc = tmp_path / "x.md"
    (tmp_path / "y.md").write_text("# Real heading\n")
    doc.write_text("[a](y.md#real-heading) [b](nope.md) [c](y.md#not-there) [d](https://example.com/x) "
                   "[e](/README.md#the-two-commands) [f](/no/such.md)\n")
    assert broken_links(doc) == ["nope.md: no such file", "y.md#not-there: no such heading", "/no/such.md: no such file"]


# -- commands ------------------------------------------------------------------------------------

PROGS = ("kvcachectl", "kvcached-router", "kvcached")
COMMAND = re.compile(r"(?<![\w/.'\"-])(kvcachectl|kvcached-router|kvcached)[ \t]+([a-z][a-z-]*)(?![\w:-])"
                     r"([^`\n|;&#]*)")


def code_text(path: Path) -> str:
    """What a Markdown file shows as code: its fenced blocks and its inline code spans (prose
    says "the kvcached daemon"; a command is written as code)."""
    text = path.read_text()
    fenced = [re.sub(r"(^|\s)#.*$", "", line) for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
              for line in block.split("\n")]  # comments are prose
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    return "\n".join(fenced + re.findall(r"`([^`\n]+)`", rest))


def named_commands() -> dict[tuple[str, str], set[str]]:
    """(program, subcommand) -> the --flags written after it, over the code of every Markdown file."""
    found: dict[tuple[str, str], set[str]] = {}
    for p in markdown_files():
        for m in COMMAND.finditer(code_text(p)):
            prog, sub, rest = m.group(1), m.group(2), m.group(3)
            flags = set(re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", rest))
            found.setdefault((prog, sub), set()).update(flags)
    return found


def help_text(prog: str, sub: str) -> str | None:
    r = subprocess.run([str(BIN / prog), sub, "--help"], capture_output=True, text=True, timeout=60)
    return r.stdout if r.returncode == 0 else None


def test_every_command_the_docs_name_exists_with_its_flags():
    cmds = named_commands()
    assert ("kvcachectl", "status") in cmds and ("kvcached", "serve") in cmds  # the scan finds them
    bad = []
    for (prog, sub), flags in sorted(cmds.items()):
        text = help_text(prog, sub)
        if text is None:
            bad.append(f"{prog} {sub}: no such subcommand")
            continue
        bad += [f"{prog} {sub} {f}: no such flag" for f in sorted(flags) if f not in text]
    assert not bad, bad


def test_the_command_checker_refuses_a_made_up_subcommand_and_flag():
    """Positive control for the check above."""
    assert help_text("kvcachectl", "frobnicate") is None
    assert "--no-such-flag" not in (help_text("kvcachectl", "status") or "")


def test_every_script_and_bench_path_the_docs_name_exists():
    bad = []
    for p in markdown_files():
        for m in re.finditer(r"(?<![\w/.-])((?:scripts|bench|tests|clients|kvcached|systemd|docs|protos)/[\w./-]*\w)"
                             r"(\.?\{)?", code_text(p)):
            target, brace = m.group(1), m.group(2)
            if brace or "PATH" in target or "NAME" in target:
                continue  # a pattern (bench/results/x.{json,png}) or a placeholder
            out = re.fullmatch(r"bench/results/(\w+)\.\w+", target)
            if out and (ROOT / "bench" / f"{out.group(1)}.py").exists():
                continue  # where a committed bench writes (gpu_check.json: written on a GPU machine)
            if not any((base / target).exists() for base in (ROOT, p.parent)):
                bad.append(f"{p.relative_to(ROOT)}: {target}")
    assert not bad, bad


# -- blocks ---------------------------------------------------------------------------------------


def all_blocks() -> list[Block]:
    return [b for p in markdown_files() for b in blocks(p)]


def test_every_block_is_run_checked_shown_or_says_why_not():
    bad = []
    for b in all_blocks():
        readme = b.path == ROOT / "README.md"
        if b.not_run is not None:
            if len(b.not_run) < 10:
                bad.append(f"{b}: 'not run' needs a reason")
        elif b.lang in ("toml", "json", "text", ""):
            pass  # checked below, or shown (a fence without a language is plain text)
        elif readme and b.lang in ("python", "sh"):
            pass
        else:
            bad.append(f"{b}: neither run, checked nor marked <!-- not run: REASON -->")
    assert not bad, bad


def load_toml(text: str) -> dict:
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(text)


def test_toml_and_json_blocks_are_what_their_loaders_accept(tmp_path):
    n = 0
    for b in all_blocks():
        if b.not_run is not None:
            continue
        if b.lang == "json":
            json.loads(b.code)
            n += 1
        elif b.lang == "toml":
            data = load_toml(b.code)
            n += 1
            if set(data) == {"semantic"}:  # the router's [semantic] table, shown on its own
                from kvcached_router.config import _semantic_config

                _semantic_config(data["semantic"])
            elif "hosts" in data or "listen" in data or "policy" in data:
                from kvcached_router.config import load_config

                f = tmp_path / f"router-{n}.toml"
                f.write_text(b.code)
                load_config(str(f))
            else:
                f = tmp_path / f"kvcached-{n}.toml"
                f.write_text(b.code)
                _load_lenient(f)
    assert n > 0


def _load_lenient(f: Path) -> None:
    """A config block names files of the host it is for (a hash key, a password file): the keys and
    values are checked by the loader, the files themselves by the daemon on that host."""
    from kvcached.settings import SettingsError, load_settings

    try:
        load_settings(str(f))
    except SettingsError as e:
        if not re.search(r"(No such file|does not exist|cannot read|not found|missing)", str(e)):
            raise


def readme_runnable() -> list[Block]:
    return [b for b in blocks(ROOT / "README.md") if b.not_run is None and b.lang in ("python", "sh")]


def test_the_readme_has_runnable_quickstarts():
    runnable = readme_runnable()
    langs = [b.lang for b in runnable]
    assert langs.count("python") >= 2 and langs.count("sh") >= 2, [str(b) for b in runnable]
    assert any("vllm" in b.code and "scripts/serve" in b.code for b in runnable)  # the two-engine quickstart


@pytest.fixture
def doc_env(tmp_path):
    """What a user's shell has: the venv's scripts on PATH, and (here) a home, runtime and state
    directory of the test's own so nothing touches the machine's daemon."""
    env = dict(os.environ)
    for k in ("KVCACHED_SOCKET", "RUNTIME_DIRECTORY", "STATE_DIRECTORY"):
        env.pop(k, None)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env.update(HOME=str(tmp_path / "home"), XDG_RUNTIME_DIR=str(run_dir), PATH=f"{BIN}{os.pathsep}{env['PATH']}",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), TMPDIR=str(tmp_path))
    os.makedirs(env["HOME"])
    return env


def _run(cmd: list[str], env: dict, timeout: float, label: str) -> str:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{label} ran past {timeout} s:\n{out[-6000:]}")
    finally:
        _kill_group(proc.pid)
    assert proc.returncode == 0, f"{label} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def _kill_group(pgid: int, timeout: float = 15.0) -> None:
    """SIGKILL what a block left in the background and wait until it is gone: a daemon it
    started keeps answering on the default socket until it has exited (a busy box takes a
    while to tear down its pool mapping), and the next block's daemon would find the socket
    served."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _untracked() -> set[str]:
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return {line[3:] for line in out.splitlines() if line.startswith("??")}


def _netns(cmd: list[str]) -> list[str]:
    """A block that listens on fixed ports runs in a network namespace of its own when it can
    (root): its loopback is private, so those ports are free and nothing leaves the machine."""
    if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip"):
        return ["unshare", "--net", "bash", "-c", 'ip link set lo up && exec "$@"', "netns", *cmd]
    return cmd


@pytest.mark.slow
def test_readme_blocks_run_as_printed(doc_env):
    from bench.harness.daemon import Daemon

    daemon = None
    results = []
    before = _untracked()
    try:
        for b in readme_runnable():
            own_daemon = "scripts/serve" in b.code
            if not own_daemon and daemon is None:
                daemon = Daemon(str(Path(doc_env["HOME"]) / "daemon"))
                daemon.socket = os.path.join(doc_env["XDG_RUNTIME_DIR"], "kvcached.sock")  # the default one
                os.makedirs(daemon.root, exist_ok=True)
                daemon.start()
            if own_daemon and daemon is not None:
                daemon.stop()
                daemon = None
            if b.lang == "python":
                out = _run([sys.executable, "-c", b.code], doc_env, 300, str(b))
            else:
                cmd = ["bash", "-euo", "pipefail", "-c", b.code]
                fixed_ports = "localhost:" in b.code or "127.0.0.1:" in b.code
                out = _run(_netns(cmd) if fixed_ports else cmd, doc_env, 600, str(b))
            results.append((b, out))
    finally:
        if daemon is not None:
            daemon.stop()
    assert _untracked() == before, "the README's blocks left files in the checkout"
    by = {b.line: out for b, out in results}
    vllm = next(b for b, _ in results if "vllm" in b.code and "scripts/serve" in b.code)
    out = by[vllm.line]
    # what the quickstart says to look for: engine B's prompt came from kvcached
    usages = re.findall(r"\{'prompt_tokens':.*", out)
    assert len(usages) == 2 and "'cached_tokens': 512" in usages[1], out[-3000:]
    hits = re.search(r"^vllm:external_prefix_cache_hits_total\S*\s+([\d.e+]+)", out, re.M)
    assert hits and float(hits.group(1)) >= 512, out[-3000:]
    assert "connected to the daemon at" in out, out[-3000:]
    router = by[next(b for b, _ in results if "kvcached-router --config" in b.code).line]
    turns = re.findall(r"^cached (\d+) X-Kvcached-Host: (\S+) X-Kvcached-Route: (\S+)$", router, re.M)
    assert len(turns) == 2, router[-3000:]
    assert turns[1][2] == "cache" and turns[1][1] == turns[0][1] and int(turns[1][0]) >= 512, turns
    remote = next(b for b, _ in results if "redis-server" in b.code)
    assert "host B served 64 tokens; 4 chunks came from Redis" in by[remote.line], by[remote.line][-3000:]
