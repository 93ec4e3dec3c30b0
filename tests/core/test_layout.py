"""Architecture rules enforced by reading imports, and storage settings the issue pins."""
from __future__ import annotations

import ast
import os
import stat
import sys
from pathlib import Path

from .helpers import make_node, peers

ROOT = Path(__file__).resolve().parents[2]
CORE_ALLOWED = {"cbor2", "nacl", "blake3", "cryptography"}
CORE_FORBIDDEN = {"sqlite3", "socket", "threading", "time", "os", "random", "asyncio", "subprocess", "select"}


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                yield a.name.split(".")[0], n.level if hasattr(n, "level") else 0
        elif isinstance(n, ast.ImportFrom):
            yield (n.module or "").split(".")[0], n.level


def test_core_is_sans_io():
    for f in (ROOT / "agent" / "core").glob("*.py"):
        for mod, level in _imports(f):
            if level:
                continue  # relative: resolved and checked below
            assert mod not in CORE_FORBIDDEN, f"{f.name} imports {mod}"
            assert mod in CORE_ALLOWED or mod in sys.stdlib_module_names or mod == "__future__", f"{f.name}: {mod}"
        # A relative import may not leave the pure layer either (`from ..store import db` is I/O),
        # nor may an absolute one into the agent package.
        for mod in _absolute_imports(f, "agent.core"):
            if mod == "agent" or mod.startswith("agent."):
                assert mod.startswith("agent.core."), f"{f.name} imports {mod}: agent/core imports only agent/core"


def test_firmware_bridge_imports_nothing_from_agent():
    for f in (ROOT / "firmware_bridge").rglob("*.py"):
        for mod, level in _imports(f):
            assert level or mod != "agent", f"{f} imports agent"


def test_store_uses_wal_and_synchronous_full(tmp_path):
    node = make_node(tmp_path / "n", peers(1))
    assert node.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert node.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    node.close()


def test_key_file_is_private(tmp_path):
    node = make_node(tmp_path / "n", peers(1))
    node.close()
    keyfiles = [p for p in (tmp_path / "n" / "keystore").iterdir() if p.suffix == ".key"]
    assert keyfiles
    for p in keyfiles:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600


# The blind Commit sequencer is its own service: it never imports the sync node. From
# the agent it may use only its own package, the shared deterministic CBOR / COSE encoding, the one
# reader of numbers from outside (agent/core/numbers.py) and the DDL splitter of the versioned
# layouts (agent/sqlscript.py), the binding set-up (agent/sqlbind.py), the WAL index allocated for
# real (agent/walindex.py).
SEQUENCER_AGENT_ALLOWED = {"agent.sequencer", "agent.core.codec", "agent.core.cose", "agent.core.frozen", "agent.core.numbers", "agent.sqlscript", "agent.sqlbind", "agent.inbox", "agent.outbox", "agent.walindex"}


def _absolute_imports(path: Path, package: str):
    """Every module a file imports, absolute; `from X import a` yields X.a when X.a is a module
    file in this tree, else X."""
    tree = ast.parse(path.read_text())
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                yield a.name
        elif isinstance(n, ast.ImportFrom):
            mod = n.module or ""
            if n.level:
                base = package.split(".")
                base = base[:len(base) - (n.level - 1)]
                mod = ".".join(base + ([n.module] if n.module else []))
            for a in n.names:
                sub = f"{mod}.{a.name}"
                is_module = (ROOT / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (ROOT / Path(*sub.split("."))).is_dir()
                yield sub if is_module else mod


def test_sequencer_never_imports_the_sync_node():
    files = list((ROOT / "agent" / "sequencer").rglob("*.py"))
    assert files
    for f in files:
        for mod in _absolute_imports(f, "agent.sequencer"):
            if mod == "agent" or mod.startswith("agent."):
                assert any(mod == a or mod.startswith(a + ".") for a in SEQUENCER_AGENT_ALLOWED), \
                    f"{f.relative_to(ROOT)} imports {mod}: the sequencer never imports the sync node"


# Provisioning (images, bundles, enrolment) sits below the CLI, which only parses, calls it and
# prints: it never imports agent.cli (enrolment is handed the `service install` verb). From the
# agent it uses the bounded file reader, the manifest and profile parsers, the node (enrolment's
# init), the broker's password hash and the wheel tags.
PROVISION_AGENT_ALLOWED = {"agent.provision", "agent.infile", "agent.core.schema", "agent.profile", "agent.node",
                           "agent.transport.broker", "agent.wheeltags"}


def test_provisioning_never_imports_the_cli():
    files = list((ROOT / "agent" / "provision").rglob("*.py"))
    assert len(files) > 1
    for f in files:
        for mod in _absolute_imports(f, "agent.provision"):
            if mod == "agent" or mod.startswith("agent."):
                assert any(mod == a or mod.startswith(a + ".") for a in PROVISION_AGENT_ALLOWED), \
                    f"{f.relative_to(ROOT)} imports {mod}: provisioning is below the CLI"


def test_nothing_below_the_cli_imports_it():
    """The CLI (agent/cli/) parses, calls and prints: what it calls never calls back up into it."""
    g = agent_import_graph()
    assert "agent.provision.bundle" in g["agent.cli.provision"]      # the graph sees the CLI's calls down

    def in_cli(m: str) -> bool:
        return m == "agent.cli" or m.startswith("agent.cli.")
    up = sorted(f"{m} -> {d}" for m, deps in g.items() if not in_cli(m) for d in deps if in_cli(d))
    assert not up, "imports of the CLI from below it: " + ", ".join(up)


def test_sequencer_core_is_sans_io():
    for mod, level in _imports(ROOT / "agent" / "sequencer" / "core.py"):
        if level:
            continue
        assert mod not in CORE_FORBIDDEN, f"sequencer core imports {mod}"
        assert mod in CORE_ALLOWED or mod in sys.stdlib_module_names or mod in ("__future__", "agent"), mod


# The byte-stream framing (COBS + CRC-32) is shared by the serial keystore and the serial sync
# link: pure, so both the firmware side and a sans-I/O link can use it.
def test_framing_is_pure():
    for mod, level in _imports(ROOT / "firmware_bridge" / "framing.py"):
        assert not level and (mod in ("__future__", "struct", "zlib")), f"framing imports {mod}"


def test_serial_link_is_sans_io():
    """agent/transport/serial_link.py is the serial line's state machine: time passed in, timers
    returned, no port, clock or randomness (the adapter in agent/transport/serial.py does I/O)."""
    path = ROOT / "agent" / "transport" / "serial_link.py"
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and n.module == "agent.core" and [a.name for a in n.names] == ["reasons"]:
            continue  # the one list of reason codes (pure): why an incarnation ended
        if isinstance(n, ast.ImportFrom):
            assert not n.level and not (n.module or "").startswith("agent"), ast.dump(n)
        elif isinstance(n, ast.Import):
            assert not any(a.name.split(".")[0] == "agent" for a in n.names), ast.dump(n)
    for mod, level in _imports(path):
        if mod == "agent":
            continue  # only agent.core.reasons, checked above
        assert mod not in CORE_FORBIDDEN and mod != "serial", f"serial_link imports {mod}"
        assert mod in sys.stdlib_module_names or mod in ("__future__", "firmware_bridge"), mod


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports: absolute and relative imports, at module level
    and inside functions (a lazy import is still a dependency: it only hides the circle until run)."""
    files = {_module_name(p): p for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        parent = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for dep in _absolute_imports(path, parent):
            while dep and dep not in files:   # `from agent.x import name` -> agent.x
                dep = dep.rpartition(".")[0]
            if dep and dep != mod and dep != package:
                deps.add(dep)
        graph[mod] = deps
    return graph


def agent_import_graph() -> dict[str, set[str]]:
    return import_graph("agent")


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_import_graph_sees_relative_and_lazy_imports():
    """The checker itself: a relative import inside a function is an edge (else the test below
    could pass on a circle hidden behind a lazy import)."""
    g = agent_import_graph()
    assert "agent.store.sync_state" in g["agent.rehydrate"]      # `from .store import sync_state as st` in a function
    assert "agent.core.session" in g["agent.sync"]              # module level, relative
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_among_agent_modules():
    """The layers are acyclic: core and store at the bottom, the node and the
    records processing above them, the sync driver above the node, transports and runners above
    that, the CLI on top. A lower module that needs something from above gets it as an argument or
    returns an effect for its caller to act on."""
    cycles = import_cycles(agent_import_graph())
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_import_cycles_among_firmware_bridge_modules():
    """The keystore interface (keystore.py) knows none of its kinds; opener.py opens them."""
    g = import_graph("firmware_bridge")
    assert "firmware_bridge.keystore" in g["firmware_bridge.software"]   # the graph sees this package
    cycles = import_cycles(g)
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


# A private (underscore) name is its module's business: another module that needs it gets a public
# name, so a change inside one module never breaks another silently.
OWN_PACKAGES = ("agent", "firmware_bridge")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_names_imported(path: Path, root: Path = ROOT) -> list[str]:
    """`from x import _y` and `x._y` (x a module of this tree, bound by an import) in one file."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    parent = parts[:-1]

    def is_module(dotted: str) -> bool:
        p = root / Path(*dotted.split("."))
        return p.with_suffix(".py").exists() or (p / "__init__.py").exists()

    tree = ast.parse(path.read_text())
    found, modules = [], {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            mod = n.module or ""
            if n.level:
                mod = ".".join(parent[:len(parent) - (n.level - 1)] + ([n.module] if n.module else []))
            if mod.split(".")[0] not in OWN_PACKAGES:
                continue
            for a in n.names:
                if _is_private(a.name):
                    found.append(f"{path.relative_to(root)}:{n.lineno} from {mod} import {a.name}")
                elif is_module(f"{mod}.{a.name}"):
                    modules[a.asname or a.name] = f"{mod}.{a.name}"
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] in OWN_PACKAGES:
                    modules[a.asname or a.name.split(".")[0]] = a.asname and a.name or a.name.split(".")[0]
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in modules \
                and _is_private(n.attr):
            found.append(f"{path.relative_to(root)}:{n.lineno} {modules[n.value.id]}.{n.attr}")
    return found


def test_the_private_name_check_sees_both_forms(tmp_path):
    (tmp_path / "agent" / "sub").mkdir(parents=True)
    (tmp_path / "agent" / "__init__.py").write_text("")
    (tmp_path / "agent" / "sub" / "__init__.py").write_text("")
    (tmp_path / "agent" / "sub" / "x.py").write_text("_y = 1\nz = 2\n")
    f = tmp_path / "agent" / "sub" / "w.py"
    f.write_text("import os\nfrom . import x\nfrom .x import z\n\ndef g():\n    from ..sub.x import _y\n"
                 "    return x._y + os._exit.__name__\n")
    assert private_names_imported(f, tmp_path) == ["agent/sub/w.py:6 from agent.sub.x import _y",
                                                   "agent/sub/w.py:7 agent.sub.x._y"]


def test_no_private_name_is_imported_across_modules():
    found = [v for pkg in OWN_PACKAGES for f in sorted((ROOT / pkg).rglob("*.py")) for v in private_names_imported(f)]
    assert not found, "private names used across modules: " + "; ".join(found)


# The node is a thin facade (agent/node.py) over its state (agent/nodestate.py) and the jobs that
# work on it, each a module of functions over that state: they never import the node (no call goes
# back up), none reads another object's underscore attribute, and each stays a size one can read.
NODE_JOBS = ("home", "nodestate", "recovery", "apply", "applypipeline", "records_apply", "records_in", "rehydrate",
             "sequencing", "trust", "writes", "produce", "nodeclock", "eviction", "views")
MODULE_LINES = 700


def test_the_node_is_a_facade_over_modules_of_one_job():
    over = {m: n for m in ("node", *NODE_JOBS)
            if (n := len((ROOT / "agent" / f"{m}.py").read_text().splitlines())) > MODULE_LINES}
    assert not over, f"modules over {MODULE_LINES} lines: {over}"
    assert len((ROOT / "agent" / "node.py").read_text().splitlines()) < MODULE_LINES // 2


def test_the_node_forwards_every_field_of_its_state():
    """Callers above hand the node itself to the jobs (a record issued by the session driver): each
    field a job reads or sets must reach the one state, never a copy on the node."""
    from agent.node import Node
    from agent.nodestate import NodeState
    missing = [f for f in NodeState.FIELDS if not isinstance(getattr(Node, f, None), property)]
    assert not missing, f"fields of the state the node does not forward: {missing}"


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for d in graph.get(todo.pop(), ()):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def test_no_node_job_imports_the_node():
    g = agent_import_graph()
    assert "agent.node" in _reachable(g, "agent.cli")            # the check sees the CLI's use of the node
    assert "agent.apply" in g["agent.node"]
    up = sorted(f"agent.{m}" for m in NODE_JOBS if "agent.node" in _reachable(g, f"agent.{m}"))
    assert not up, "job modules that reach agent.node: " + ", ".join(up)


def private_attributes_read(path: Path, root: Path = ROOT, anywhere: bool = False) -> list[str]:
    """`node._x` and `self.node._x` in one file (a node's internals read from outside it); with
    `anywhere`, any `obj._x` whose object is not `self` or `cls` (the state `st._x` included)."""
    found = []
    for n in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(n, ast.Attribute) and _is_private(n.attr)):
            continue
        v = n.value
        name = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
        if name == "node" or (anywhere and isinstance(v, ast.Name) and v.id not in ("self", "cls")):
            found.append(f"{path.relative_to(root)}:{n.lineno} {name}.{n.attr}")
    return found


def test_the_private_attribute_check_sees_reads_through_a_node(tmp_path):
    (tmp_path / "agent").mkdir()
    f = tmp_path / "agent" / "w.py"
    f.write_text("def g(self, node, st, o):\n    return node._a, self.node._b, st._c, o._d, self._e, node.f\n")
    assert private_attributes_read(f, tmp_path) == ["agent/w.py:2 node._a", "agent/w.py:2 node._b"]
    assert sorted(private_attributes_read(f, tmp_path, anywhere=True)) == \
        ["agent/w.py:2 node._a", "agent/w.py:2 node._b", "agent/w.py:2 o._d", "agent/w.py:2 st._c"]


def test_no_private_attribute_of_the_node_is_read_across_modules():
    found = [v for f in sorted((ROOT / "agent").rglob("*.py")) for v in private_attributes_read(f)]
    found += [v for m in ("node", *NODE_JOBS)
              for v in private_attributes_read(ROOT / "agent" / f"{m}.py", anywhere=True)]
    assert not found, "private attributes read across modules: " + "; ".join(found)


def exception_classes(roots) -> dict[str, list[str]]:
    """Every exception class defined under `roots` (a class whose bases lead, by name, to a builtin
    exception): name -> where each is defined."""
    import builtins
    classes = []
    for root in roots:
        for p in sorted(root.rglob("*.py")):
            for n in ast.walk(ast.parse(p.read_text())):
                if isinstance(n, ast.ClassDef):
                    bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                             for b in n.bases]
                    classes.append((n.name, bases, f"{p.relative_to(root.parent)}:{n.lineno}"))
    known = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
             and issubclass(getattr(builtins, n), BaseException)}
    grew = True
    while grew:
        grew = False
        for name, bases, _ in classes:
            if name not in known and any(b in known for b in bases):
                known.add(name)
                grew = True
    out: dict[str, list[str]] = {}
    for name, bases, where in classes:
        if any(b in known for b in bases):
            out.setdefault(name, []).append(where)
    return out


def test_the_exception_class_scan_sees_subclasses_of_subclasses(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "a.py").write_text("class AError(ValueError):\n    pass\nclass B(AError):\n    pass\n"
                                         "class C:\n    pass\n")
    (tmp_path / "p" / "b.py").write_text("import x\nclass B(x.KeyError):\n    pass\n")
    assert exception_classes([tmp_path / "p"]) == {"AError": ["p/a.py:1"], "B": ["p/a.py:3", "p/b.py:2"]}


def test_one_name_per_exception_class():
    """`except X` and a traceback name one class: two unrelated errors never share a name (the
    SSP/1 message refusal is ProtocolError; the serial keystore's bad frame is DeviceProtocolError)."""
    dup = {k: v for k, v in exception_classes([ROOT / "agent", ROOT / "firmware_bridge"]).items() if len(v) > 1}
    assert not dup, f"exception classes sharing a name: {dup}"


# Code says why with the spec § or the doc section it follows, never a tracker number: the reader
# has the repository, not the tracker. Recorded results (bench/results) and store fixtures are data.
ISSUE_REF = __import__("re").compile(r"\b[Ii]ssues?[ \t]+\d")
SOURCE_SUFFIXES = {".py", ".sh", ".c", ".toml"}


def test_no_tracker_numbers_in_code_tests_tools_or_benches():
    assert ISSUE_REF.search("as Issue" + " 12 said") and not ISSUE_REF.search("an issue; 12 of them")
    found = []
    for top in ("agent", "firmware_bridge", "tests", "tools", "bench"):
        for p in sorted((ROOT / top).rglob("*")):
            rel = p.relative_to(ROOT)
            if p.suffix not in SOURCE_SUFFIXES or rel.parts[:2] in (("bench", "results"),) or "fixtures" in rel.parts:
                continue
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
                if ISSUE_REF.search(line):
                    found.append(f"{rel}:{i}")
    assert not found, "tracker references: " + ", ".join(found)


def test_module_docstrings_in_agent_are_at_most_15_lines():
    """A module docstring says what the module decides and points to docs/ for the rest; a longer
    one drifts from the code it describes."""
    assert len("a\nb".splitlines()) == 2
    long = []
    for p in sorted((ROOT / "agent").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(p.read_text()), clean=False)
        if doc is not None and len(doc.splitlines()) > 15:
            long.append(f"{p.relative_to(ROOT)} ({len(doc.splitlines())} lines)")
    assert not long, "module docstrings over 15 lines: " + ", ".join(long)


# Producing (agent/produce.py) is the only place that ticks this node's HLC and signs with its event
# key (persist-before-release, then the witness): every other module issues through it. Two other
# signers keep their own bridge, key and journal: the standalone authority (agent/authority.py) and
# the sequencer's receipts (agent/sequencer/, which never imports the node).
OWN_SIGNERS = ("agent/produce.py", "agent/authority.py", "agent/sequencer/")
BRIDGE_RELEASES = {"release", "release_many", "release_pipelined"}


def signing_calls(path: Path, root: Path = ROOT) -> list[str]:
    """Calls in one file that sign or tick outside producing: a bridge release (a `release*` call
    with arguments: a lock's `release()` has none), `release_signed` on anything but the produce
    module (the node's delegating method calls it there), and a tick of a clock."""
    where = path.relative_to(root)
    found = []
    for n in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
            continue
        name, recv = n.func.attr, n.func.value
        recv_name = recv.id if isinstance(recv, ast.Name) else recv.attr if isinstance(recv, ast.Attribute) else ""
        if (name in BRIDGE_RELEASES and (n.args or n.keywords)) or \
                (name == "release_signed" and recv_name != "produce") or (name == "tick" and recv_name == "clock"):
            found.append((n.lineno, f"{where}:{n.lineno} {name}"))
    return [c for _, c in sorted(found)]


def test_the_signing_check_sees_releases_ticks_and_release_signed(tmp_path):
    (tmp_path / "agent").mkdir()
    f = tmp_path / "agent" / "w.py"
    f.write_text("def g(node, lock, produce):\n    lock.release()\n    produce.release_signed(node, b'', None, 0)\n"
                 "    node.bridge.release(1, 'events', b'', None)\n    node.release_signed(b'', None, 0)\n"
                 "    node.clock.tick(0)\n    b = node.bridge\n    b.release_many([])\n")
    assert signing_calls(f, tmp_path) == ["agent/w.py:4 release", "agent/w.py:5 release_signed",
                                          "agent/w.py:6 tick", "agent/w.py:8 release_many"]


def test_only_producing_ticks_and_signs():
    files = sorted((ROOT / "agent").rglob("*.py"))
    assert ROOT / "agent" / "produce.py" in files
    found = [c for f in files if not str(f.relative_to(ROOT)).startswith(OWN_SIGNERS) for c in signing_calls(f)]
    assert not found, "signing outside agent/produce.py: " + "; ".join(found)
    # and producing does sign: the check looks where the calls are
    assert [c.split()[1] for c in signing_calls(ROOT / "agent" / "produce.py")] == ["release", "release_many", "tick"]
