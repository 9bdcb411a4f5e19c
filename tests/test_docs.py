"""What the docs show is real: every `lmcache-mp-server ...` command line in README.md and docs/*.md
goes through the server's argument parser and settings as written, and every metric name they
(and the Grafana dashboard) mention is served on /metrics."""

from __future__ import annotations

import fnmatch
import itertools
import json
import re
import shlex
import urllib.request
from pathlib import Path

import pytest

from lmcache_mp import Server, ServerConfig
from lmcache_mp.server.cli import parse_command

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", re.M | re.S)
SHELL_FENCES = ("", "bash", "sh", "shell", "console")  # not text (diagrams) or yaml (manifests, below)
NOT_METRICS = {"lmcache_mp_"}  # the prefix of shared-memory file names (protocol.md)


def _commands(line: str) -> list[list[str]]:
    """The `lmcache-mp-server` commands of one shell line: split at &&, ;, | and &, leading
    VAR=value assignments dropped, cut at a [placeholder]."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # prose with an unmatched quote
        return []
    out = []
    for is_op, group in itertools.groupby(tokens, key=lambda t: t in ("&&", "||", ";", "|", "&")):
        words = list(itertools.dropwhile(lambda w: re.match(r"^\w+=", w), group))
        if is_op or not words or words[0] != "lmcache-mp-server":
            continue
        args = list(itertools.takewhile(lambda w: not w.startswith("["), words[1:]))
        out.append(args)
    return out


def command_lines() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) in SHELL_FENCES:
                for line in m.group(2).replace("\\\n", " ").splitlines():
                    found += [(path.name, args) for args in _commands(line)]
        for m in re.finditer(r'\[\s*"lmcache-mp-server"[^\]]*\]', text):  # a manifest's command: [...]
            found.append((path.name, json.loads(m.group(0))[1:]))
        for m in re.finditer(r"`([^`\n]+)`", FENCE.sub("", text)):  # inline code
            found += [(path.name, args) for args in _commands(m.group(1))]
    return found


COMMANDS = [(f, list(a)) for f, a in dict.fromkeys((f, tuple(a)) for f, a in command_lines())]


def test_the_docs_show_command_lines_of_every_kind():
    assert len(COMMANDS) >= 10
    kinds = {args[0] if args and args[0] in ("doctor", "keygen") else "serve" for _, args in COMMANDS}
    assert kinds == {"serve", "doctor", "keygen"}
    assert any(f == "DEPLOYMENT.md" and "--ipc-group" in a for f, a in COMMANDS)  # the manifest's
    assert any(f == "L2.md" and "--l2-disk" in a for f, a in COMMANDS)  # continued over lines


@pytest.mark.parametrize("where, args", COMMANDS, ids=[f"{f}: {' '.join(a) or '(no flags)'}" for f, a in COMMANDS])
def test_a_command_line_of_the_docs_is_accepted(where, args, monkeypatch, capsys):
    for name in [n for n in __import__("os").environ if n.startswith("LMCACHE_MP_")]:
        monkeypatch.delenv(name)  # the command line as written, nothing else
    try:
        command, what = parse_command(args)
    except SystemExit as e:  # argparse: --help exits 0, a bad flag 2
        assert e.code == 0, f"{where}: lmcache-mp-server {' '.join(args)}\n{capsys.readouterr().err}"
        return
    assert command in ("serve", "doctor", "keygen")
    if command != "keygen":
        assert isinstance(what, ServerConfig)


def test_a_wrong_command_line_is_caught(capsys):
    assert _commands("lmcache-mp-server --metrics-port 9100 &") == [["--metrics-port", "9100"]]
    with pytest.raises(SystemExit) as e:
        parse_command(["--metrics-port", "9100"])
    assert e.value.code == 2 and "unrecognized arguments: --metrics-port" in capsys.readouterr().err


def _expand(span: str) -> list[str]:
    """lmcache_mp_x_{a,b}_total -> lmcache_mp_x_a_total, lmcache_mp_x_b_total."""
    parts = re.split(r"\{([^}]*)\}", span)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def documented_metrics() -> dict[str, str]:
    """Metric names in backquotes, by the file that names them first. `{a,b}` is expanded; a
    `_suffix` after a full name on the same line is lmcache_mp_<that name's first part>_suffix
    (OPERATIONS.md: `lmcache_mp_l1_capacity_bytes`, `_used_bytes`); `*` is a pattern."""
    names: dict[str, str] = {}
    for path in DOCS:
        for line in path.read_text().splitlines():
            base = None
            for span in re.findall(r"`([^`]+)`", line):
                if span.startswith("lmcache_mp_") and span not in NOT_METRICS:
                    for name in _expand(span):
                        names.setdefault(name, path.name)
                    base = "lmcache_mp_" + span[len("lmcache_mp_"):].split("_")[0]
                elif base and re.fullmatch(r"_\w+", span):
                    names.setdefault(base + span, path.name)
    return names


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> set[str]:
    """The names a Prometheus query can use: counters with _total, gauges, histograms with and
    without _bucket, _count and _sum."""
    tmp = tmp_path_factory.mktemp("metrics")
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="16MiB", http_addr="127.0.0.1:0",
                              l2_disk=str(tmp / "l2"), l2_disk_size="64MiB")).start()
    try:
        with urllib.request.urlopen(f"http://{srv.engine.http}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        srv.stop()
    types = dict(re.findall(r"^# TYPE (lmcache_mp_\w+) (\w+)", text, re.M))
    names = set(types)
    names |= {n + s for n, kind in types.items() if kind == "histogram" for s in ("_bucket", "_count", "_sum")}
    assert {"lmcache_mp_hits_total", "lmcache_mp_l1_size_used_bytes", "lmcache_mp_l2_tier_corrupt_total"} <= names
    return names


def test_every_metric_the_docs_name_is_served(served):
    documented = documented_metrics()
    assert {"lmcache_mp_hits_total", "lmcache_mp_l1_used_bytes", "lmcache_mp_l2_tier_misses_total",
            "lmcache_mp_l2_prefetching"} <= set(documented)  # the expansions work
    missing = {name: where for name, where in documented.items()
               if not (fnmatch.filter(served, name) if "*" in name else name in served)}
    assert not missing, f"named in the docs but not served: {missing}"


def test_every_metric_of_the_dashboard_is_served(served):
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    used = set(re.findall(r"lmcache_mp_\w+", exprs))
    assert used and used <= served, used - served
