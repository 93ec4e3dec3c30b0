"""Power loss at every sync point (docs/reliability.md).

1. `record`: a workload (tests/reliability/powercut_workload.py: CLI `write`s, `Node.write_many`,
   mailbox imports of a peer's bodies each answered by an export, eviction) runs with the C shim
   (powercut_shim.c, built here with gcc) LD_PRELOADed into every process. The shim logs every
   open / write / ftruncate / fsync / fdatasync / rename / unlink / close under the node's home and
   its clock-witness directory, with the bytes, and the workload's acknowledgements as markers.
2. `Model`: replays that log into a model of the page cache and the disk:
   - each file (inode) has durable bytes and a list of unsynced operations; fsync / fdatasync of it
     makes them all durable;
   - each directory has a durable set of entries and a list of unsynced entry operations (create,
     rename, unlink); only an fsync of that directory makes them durable;
   - a power cut keeps, independently per file and per directory, a *prefix* of its unsynced
     operations (none, some, or all, in the order they were issued).
3. `check`: each reconstruction is written back at the original paths and opened by the real
   agent (a writing open: recovery, journal compaction) through the CLI's fault boundary, which
   then signs one new event with a wall clock set *behind* the run (a device without an RTC
   rebooting). Findings:
   - `lost_ack`: an event acknowledged before the cut (a `write` returned; an import returned,
     after which its answer was exported) is neither in the log nor below its table's horizon;
   - `released_missing`: an output the signing bridge released before the cut (a RELEASED journal
     record whose covering fsync the code had issued) is not in the store after recovery;
   - `hlc_reused`: the new event's HLC is not above every HLC released before the cut, or two of
     the node's own events share an HLC;
   - `observed_undercut`: the new local event is not above an HLC the node applied (§12 step 5);
   - `traceback`: opening raised something the CLI boundary does not turn into one clear line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHIM_SRC = HERE / "powercut_shim.c"

OP_OPEN, OP_WRITE, OP_TRUNC, OP_SYNC, OP_RENAME, OP_UNLINK, OP_CLOSE, OP_MARK, OP_MKDIR, OP_FALLOC, \
    OP_TRUNCPATH, OP_UNSUPPORTED, OP_DUP = range(1, 14)
_HDR = struct.Struct("<IBBHiiqqqIII")


def build_shim(out_dir: Path) -> Path:
    """Compile the shim from its source (never a checked-in binary)."""
    out = Path(out_dir) / "powercut_shim.so"
    subprocess.run(["gcc", "-O2", "-Wall", "-shared", "-fPIC", "-o", str(out), str(SHIM_SRC), "-ldl", "-lpthread"],
                   check=True, capture_output=True, text=True)
    return out


@dataclasses.dataclass
class Op:
    i: int
    op: int
    flag: int
    pid: int
    fd: int
    a: int
    b: int
    ns: int
    path: str
    path2: str
    data: bytes


def parse_log(path: Path) -> list[Op]:
    data = Path(path).read_bytes()
    pos, ops = 0, []
    while pos + _HDR.size <= len(data):
        total, op, flag, _, pid, fd, a, b, ns, l1, l2, ld = _HDR.unpack_from(data, pos)
        q = pos + _HDR.size
        p1 = data[q:q + l1].decode()
        p2 = data[q + l1:q + l1 + l2].decode()
        d = data[q + l1 + l2:q + l1 + l2 + ld]
        ops.append(Op(len(ops), op, flag, pid, fd, a, b, ns, p1, p2, bytes(d)))
        pos += total
    if pos != len(data):
        raise ValueError(f"trace {path}: {len(data) - pos} trailing bytes")
    return ops


# ---------------------------------------------------------------- the disk model
class _Inode:
    __slots__ = ("id", "durable", "pending", "is_dir", "path")

    def __init__(self, iid: int, data: bytes = b"", is_dir: bool = False, path: str = "") -> None:
        self.id, self.durable, self.pending, self.is_dir, self.path = iid, bytearray(data), [], is_dir, path


def _apply(buf: bytearray, op: tuple) -> None:
    kind = op[0]
    if kind == "w":
        _, off, data = op
        if off > len(buf):
            buf.extend(bytes(off - len(buf)))
        buf[off:off + len(data)] = data
    elif kind == "t":
        n = op[1]
        if n < len(buf):
            del buf[n:]
        else:
            buf.extend(bytes(n - len(buf)))
    elif kind == "f":
        _, off, ln, keep = op
        if not keep and off + ln > len(buf):
            buf.extend(bytes(off + ln - len(buf)))


class Model:
    """What is on the disk (durable) and in the page cache (pending), per file and directory."""

    def __init__(self, roots: list[Path], sealer=None) -> None:
        self.roots = [str(Path(r)) for r in roots]
        self._sealer = sealer   # the home's data keys: its journal keeps outputs sealed at rest (type SEALED)
        self.inodes: dict[int, _Inode] = {}
        self.cur: dict[str, int] = {}        # the namespace as processes see it
        self.durable_ns: dict[str, int] = {}  # the namespace on disk
        self.dir_pending: dict[str, list[tuple]] = {}   # dir path -> unsynced entry operations
        self.fds: dict[tuple[int, int], int] = {}
        self.unsupported: list[str] = []
        self.released: list[Released] = []   # what the signing bridge released, in order
        self._seen: set[bytes] = set()
        self._parsed: dict[int, int] = {}     # journal inode -> bytes already parsed
        self._next = 0
        for r in self.roots:
            self._load_base(Path(r))

    def _new(self, data: bytes = b"", is_dir: bool = False, path: str = "") -> _Inode:
        self._next += 1
        ino = _Inode(self._next, data, is_dir, path)
        self.inodes[ino.id] = ino
        return ino

    def _load_base(self, root: Path) -> None:
        """The state before the workload: everything durable (the harness synced it)."""
        for dirpath, dirnames, filenames in os.walk(root):
            d = self._new(is_dir=True, path=dirpath)
            self.cur[dirpath] = self.durable_ns[dirpath] = d.id
            for f in filenames:
                p = os.path.join(dirpath, f)
                if p.endswith("-shm"):
                    continue
                ino = self._new(Path(p).read_bytes(), path=p)
                self.cur[p] = self.durable_ns[p] = ino.id
                if f.startswith(JOURNAL_NAME):
                    self._parsed[ino.id] = len(ino.durable)   # released before the run

    def _dir_op(self, path: str, op: tuple) -> None:
        self.dir_pending.setdefault(os.path.dirname(path), []).append(op)

    def step(self, o: Op) -> None:
        if o.op == OP_OPEN:
            iid = self.cur.get(o.path)
            if iid is None or (o.flag & 1):
                ino = self._new(is_dir=bool(o.flag & 4), path=o.path)
                self.cur[o.path] = ino.id
                self._dir_op(o.path, ("link", o.path, ino.id))
                iid = ino.id
            self.fds[(o.pid, o.fd)] = iid
            if o.flag & 2:
                self.inodes[iid].pending.append(("t", 0))
        elif o.op in (OP_WRITE, OP_TRUNC, OP_FALLOC, OP_SYNC, OP_CLOSE, OP_DUP):
            iid = self.fds.get((o.pid, o.fd))
            if iid is None:
                if o.op != OP_CLOSE:
                    self.unsupported.append(f"op {o.op} on an unknown fd {o.pid}/{o.fd} at {o.i}")
                return
            ino = self.inodes[iid]
            if o.op == OP_WRITE:
                ino.pending.append(("w", o.a, o.data))
            elif o.op == OP_TRUNC:
                ino.pending.append(("t", o.a))
            elif o.op == OP_FALLOC:
                ino.pending.append(("f", o.a, o.b, bool(o.flag & 1)))
            elif o.op == OP_SYNC:
                if not ino.is_dir and os.path.basename(ino.path).startswith(JOURNAL_NAME):
                    self._note_released(o.i, ino)
                if o.flag & 2:
                    return    # the negative control: the code asked, nothing was done
                if ino.is_dir:
                    for op in self.dir_pending.pop(ino.path, []):
                        self._apply_dir(self.durable_ns, op)
                else:
                    for op in ino.pending:
                        _apply(ino.durable, op)
                    ino.pending = []
            elif o.op == OP_CLOSE:
                del self.fds[(o.pid, o.fd)]
            elif o.op == OP_DUP:
                self.fds[(o.pid, o.a)] = iid
        elif o.op == OP_RENAME:
            if os.path.dirname(o.path) != os.path.dirname(o.path2):
                self.unsupported.append(f"rename across directories at {o.i}: {o.path} -> {o.path2}")
            iid = self.cur.pop(o.path, None)
            if iid is None:
                self.unsupported.append(f"rename of an untraced file at {o.i}: {o.path}")
                return
            self.cur[o.path2] = iid
            self._dir_op(o.path, ("rename", o.path, o.path2, iid))
        elif o.op == OP_UNLINK:
            self.cur.pop(o.path, None)
            self._dir_op(o.path, ("unlink", o.path))
        elif o.op == OP_MKDIR:
            ino = self._new(is_dir=True, path=o.path)
            self.cur[o.path] = ino.id
            self._dir_op(o.path, ("link", o.path, ino.id))
        elif o.op == OP_TRUNCPATH:
            iid = self.cur.get(o.path)
            if iid is not None:
                self.inodes[iid].pending.append(("t", o.a))
        elif o.op == OP_UNSUPPORTED:
            self.unsupported.append(f"{o.path} at {o.i}")

    def _note_released(self, at: int, ino: _Inode) -> None:
        """A journal fsync (performed, or skipped by the negative control) returned: every RELEASED
        record it covers may now leave the bridge (firmware_bridge/journal.py format)."""
        from firmware_bridge.identity import EventIdentity, decode_identity
        from firmware_bridge.journal import HDR as JHDR, MAGIC, RELEASED, SEALED, record_at, sealed_ad
        buf = bytearray(ino.durable)
        for op in ino.pending:
            _apply(buf, op)
        data = bytes(buf)
        pos = max(self._parsed.get(ino.id, len(MAGIC)), len(MAGIC))
        if pos > len(data):    # truncated (a torn tail cut off on open)
            pos = len(MAGIC)
        while True:
            got = record_at(data, pos, len(data))
            if got is None:
                break
            rtype, ident, off, ln, end = got
            if rtype in (RELEASED, SEALED) and ident not in self._seen:
                self._seen.add(ident)
                idn = decode_identity(ident)
                if isinstance(idn, EventIdentity):
                    raw = data[pos + JHDR.size + off:pos + JHDR.size + off + ln]
                    if rtype == SEALED:
                        raw = self._sealer.open(sealed_ad(ident), raw)
                    self.released.append(Released(at, ident, idn.hlc, raw))
            pos = end
        self._parsed[ino.id] = pos

    @staticmethod
    def _apply_dir(ns: dict[str, int], op: tuple) -> None:
        if op[0] == "link":
            ns[op[1]] = op[2]
        elif op[0] == "rename":
            ns.pop(op[1], None)
            ns[op[2]] = op[3]
        else:
            ns.pop(op[1], None)

    def pending_counts(self) -> tuple[dict[int, int], dict[str, int]]:
        files = {iid: len(ino.pending) for iid, ino in self.inodes.items() if ino.pending}
        dirs = {d: len(p) for d, p in self.dir_pending.items() if p}
        return files, dirs

    def reconstruct(self, keep_files: dict[int, int] | None = None,
                    keep_dirs: dict[str, int] | None = None, torn: dict[int, int] | None = None) -> dict[str, bytes | None]:
        """The disk after a power cut now: per file, its durable bytes plus the first
        keep_files[id] of its unsynced operations; per directory, its durable entries plus the
        first keep_dirs[path] of its unsynced entry operations. {path: bytes, or None for a dir}."""
        keep_files, keep_dirs, torn = keep_files or {}, keep_dirs or {}, torn or {}
        ns = dict(self.durable_ns)
        for d, ops in self.dir_pending.items():
            for op in ops[:keep_dirs.get(d, 0)]:
                self._apply_dir(ns, op)
        out: dict[str, bytes | None] = {}
        for path in sorted(ns):
            ino = self.inodes[ns[path]]
            parent = os.path.dirname(path)
            if path not in self.roots and (parent not in out or out[parent] is not None):
                continue   # its directory did not survive
            if ino.is_dir:
                out[path] = None
                continue
            k = keep_files.get(ino.id, 0)
            if k or ino.id in torn:
                buf = bytearray(ino.durable)
                for op in ino.pending[:k]:
                    _apply(buf, op)
                if ino.id in torn and k < len(ino.pending) and ino.pending[k][0] == "w":
                    # the next write torn: only its first sectors (512-byte units of the file) reached the disk
                    _, off, data = ino.pending[k]
                    cut = max(0, ((off + torn[ino.id]) // 512) * 512 - off)
                    if cut:
                        _apply(buf, ("w", off, data[:min(cut, len(data))]))
                out[path] = bytes(buf)
            else:
                out[path] = bytes(ino.durable)
        return out

    def everything(self) -> dict[str, bytes | None]:
        """What a process sees now (every operation kept): checks the shim against the real files."""
        files, dirs = self.pending_counts()
        out = {}
        for path, iid in sorted(self.cur.items()):
            ino = self.inodes[iid]
            if ino.is_dir:
                out[path] = None
                continue
            buf = bytearray(ino.durable)
            for op in ino.pending:
                _apply(buf, op)
            out[path] = bytes(buf)
        return out


def state_hash(state: dict[str, bytes | None]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p, data in sorted(state.items()):
        h.update(p.encode() + b"\0")
        h.update(b"D" if data is None else hashlib.blake2b(data, digest_size=16).digest())
    return h.hexdigest()


def read_tree(roots: list[Path]) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for r in roots:
        for dirpath, _dirs, files in os.walk(r):
            out[dirpath] = None
            for f in files:
                if not f.endswith("-shm"):
                    out[os.path.join(dirpath, f)] = Path(dirpath, f).read_bytes()
    return out


def write_tree(roots: list[Path], state: dict[str, bytes | None]) -> None:
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)
    for path, data in sorted(state.items()):
        if data is None:
            os.makedirs(path, mode=0o700, exist_ok=True)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)   # the key file must stay 0600
            with os.fdopen(fd, "wb") as f:
                f.write(data)


# ---------------------------------------------------------------- what the run released and acknowledged
@dataclasses.dataclass
class Released:
    at: int           # trace index of the fsync after which the bridge could return it
    ident: bytes
    hlc: tuple[int, int]
    raw: bytes


JOURNAL_NAME = "sign-journal"


def markers(ops: list[Op]) -> list[tuple[int, dict]]:
    out = []
    for o in ops:
        if o.op == OP_MARK:
            for line in o.data.decode().splitlines():
                if line.strip():
                    out.append((o.i, json.loads(line)))
    return out


# ---------------------------------------------------------------- recording a run
T = "app.readings"


@dataclasses.dataclass
class Recording:
    work: Path
    home: Path
    witness: Path
    ops: list[Op]
    base: Model                  # a fresh copy is made per replay (model_factory)
    site_id: bytes
    start_ms: int
    drop_sync: str | None

    @property
    def roots(self) -> list[Path]:
        return [self.home, self.witness]

    def model(self) -> Model:
        return Model(self.roots, self.sealer) if self._base_state is None else self._from_base()

    _base_state: dict | None = None
    sealer: object = None        # the home's data keys (made by init; the workload never rotates them)

    def _from_base(self) -> Model:
        write_tree(self.roots, self._base_state)
        return Model(self.roots, self.sealer)


def record(work: Path, *, events: int = 200, seed: int = 1, drop_sync: str | None = None,
           shim: Path | None = None, workload: str = "tests.reliability.powercut_workload",
           setup=None) -> Recording:
    """Make a node (not traced: its files are the durable base), then run the workload under the
    shim. `drop_sync`: the negative control (fsyncs of files whose path contains it are skipped).
    `workload`: the module run (its one argument the config file), e.g. powercut_mixed.py's.
    `setup(work, home)`: run on the made home before the base is taken; its dict joins the config."""
    import nacl.signing

    from agent.node import Node, now_ms
    from agent.simpeer import SimPeer, manifest_text, readings_table
    from tests.cli_cmd import agent_env
    work = Path(work).resolve()
    home, witness, mark = work / "home", work / "witness", work / "marks.jsonl"
    witness.mkdir(parents=True, exist_ok=True)
    shim = shim or build_shim(work)
    mesh = bytes(range(16))
    seed_bytes = hashlib.blake2b(f"peer-{seed}".encode(), digest_size=32).digest()
    peer = SimPeer(mesh, hashlib.blake2b(f"site-{seed}".encode(), digest_size=16).digest(),
                   nacl.signing.SigningKey(seed_bytes))
    old = os.environ.get("SSP_AGENT_WITNESS_DIR")
    os.environ["SSP_AGENT_WITNESS_DIR"] = str(witness)
    try:
        node, _ = Node.init(home, manifest_text(mesh, readings_table(retention="telemetry"), [peer]),
                            {"kind": "software"})
        site_id = node.site_id
        sealer = node.log_seal.sealer
        node.close()
    finally:
        if old is None:
            os.environ.pop("SSP_AGENT_WITNESS_DIR", None)
        else:
            os.environ["SSP_AGENT_WITNESS_DIR"] = old
    extra = setup(work, home) if setup else {}
    os.sync()
    base_state = read_tree([home, witness])
    cfg = {**extra, "home": str(home), "mark": str(mark), "seed": seed, "events": events, "mesh_id": mesh.hex(),
           "peer_site_id": peer.site_id.hex(), "peer_seed": seed_bytes.hex(), "mailbox_dir": str(work / "mbox")}
    (work / "workload.json").write_text(json.dumps(cfg))
    trace = work / "trace.bin"
    env = agent_env({"LD_PRELOAD": str(shim), "SSP_POWERCUT_LOG": str(trace),
                     "SSP_POWERCUT_ROOTS": f"{home}:{witness}", "SSP_POWERCUT_MARK": str(mark),
                     "SSP_AGENT_WITNESS_DIR": str(witness), "SSP_AGENT_CLOCK_TRUSTED": "1",
                     "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    if drop_sync:
        env["SSP_POWERCUT_DROP_SYNC"] = drop_sync
    start = now_ms()
    p = subprocess.run([sys.executable, "-m", workload, str(work / "workload.json")],
                       env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"workload failed ({p.returncode}): {p.stderr[-3000:]}")
    ops = parse_log(trace)
    final = read_tree([home, witness])
    write_tree([home, witness], base_state)
    rec = Recording(work, home, witness, ops, None, site_id, start, drop_sync)  # type: ignore[arg-type]
    rec._base_state = base_state
    rec.sealer = sealer
    # The shim saw everything: replaying every operation gives the files the run left.
    m = rec.model()
    for o in ops:
        m.step(o)
    if m.unsupported:
        raise RuntimeError(f"the trace holds operations the model does not cover: {m.unsupported[:5]}")
    got = m.everything()
    if got != final:
        diff = sorted(set(got) ^ set(final)) or [k for k in got if got[k] != final.get(k)]
        raise RuntimeError(f"the model's replay differs from the files the run left: {diff[:5]}")
    return rec


# ---------------------------------------------------------------- checking reconstructions
@dataclasses.dataclass
class Finding:
    kind: str
    cut: int
    choice: str
    detail: str


@dataclasses.dataclass
class Report:
    ops: int = 0
    sync_points: int = 0
    cut_points: int = 0          # reconstructions examined (sync points + random points)
    states_verified: int = 0     # distinct (state, expectations) reopened by the agent
    opened: int = 0
    refused: int = 0             # failed with one clear line (counted, and each is a finding)
    findings: list[Finding] = dataclasses.field(default_factory=list)
    acked_events: int = 0
    released_outputs: int = 0

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.findings:
            out[f.kind] = out.get(f.kind, 0) + 1
        return out

    def summary(self) -> dict:
        return {"ops": self.ops, "sync_points": self.sync_points, "cut_points": self.cut_points,
                "states_verified": self.states_verified, "opened": self.opened, "refused": self.refused,
                "acked_events": self.acked_events, "released_outputs": self.released_outputs,
                "findings": self.kinds(),
                "examples": [dataclasses.asdict(f) for f in self.findings[:8]]}


COMBO_LIMIT = 64


def cut_points(rec: Recording, *, sample_syncs: int | None = None, random_points: int = 0,
               torn_points: int = 0, all_combos: bool = False, seed: int = 0) -> list[tuple[int, str]]:
    """(cut index, choice): just after every fsync / fdatasync the code issued, keeping no unsynced
    write ("synced"); with `all_combos`, there too every combination of prefixes of the unsynced
    operations of each file and directory ("all": up to COMBO_LIMIT of them, else a random sample
    of that many); random indices with a random prefix of each file's and directory's unsynced
    operations kept ("random:N"), and the same with the next write of each file torn at a sector
    boundary ("torn:N"). `sample_syncs` takes an evenly spread sample of the sync points."""
    syncs = sorted({o.i + 1 for o in rec.ops if o.op == OP_SYNC})
    if sample_syncs is not None and sample_syncs < len(syncs):
        step = len(syncs) / sample_syncs
        syncs = sorted({syncs[int(k * step)] for k in range(sample_syncs)} | {syncs[-1]})
    rng = random.Random(seed)
    cuts = [(s, "synced") for s in syncs]
    if all_combos:
        cuts += [(s, "all") for s in syncs]
    cuts += [(rng.randrange(1, len(rec.ops) + 1), f"random:{rng.randrange(1 << 30)}") for _ in range(random_points)]
    cuts += [(rng.randrange(1, len(rec.ops) + 1), f"torn:{rng.randrange(1 << 30)}") for _ in range(torn_points)]
    return sorted(cuts)


def check(rec: Recording, cuts: list[tuple[int, str]], progress=None) -> Report:
    rep = Report(ops=len(rec.ops), sync_points=sum(1 for o in rec.ops if o.op == OP_SYNC))
    marks = markers(rec.ops)
    m = rec.model()
    done = 0
    cache: dict[tuple, list[Finding]] = {}
    for cut, choice in sorted(cuts):
        while done < cut:
            m.step(rec.ops[done])
            done += 1
        acked = [mk for i, mk in marks if i < cut and mk["k"] == "ack"]
        released = list(m.released)
        for label, state in _states(m, choice):
            key = (state_hash(state), len(acked), len(released))
            rep.cut_points += 1
            if key not in cache:
                cache[key] = _verify(rec, state, acked, released, cut, label, rep)
                rep.states_verified += 1
            for f in cache[key]:
                rep.findings.append(dataclasses.replace(f, cut=cut, choice=label))
        if progress:
            progress(rep)
    rep.acked_events = sum(len(mk["ids"]) for _, mk in marks if mk["k"] == "ack")
    while done < len(rec.ops):
        m.step(rec.ops[done])
        done += 1
    rep.released_outputs = len(m.released)
    write_tree(rec.roots, rec._base_state)
    return rep


def _states(m: Model, choice: str):
    """The reconstructions a cut point stands for (label, state)."""
    files, dirs = m.pending_counts()
    if choice == "synced":
        yield choice, m.reconstruct()
        return
    if choice == "all":
        import itertools
        axes = [("f", i, n) for i, n in sorted(files.items())] + [("d", d, n) for d, n in sorted(dirs.items())]
        total = 1
        for _, _, n in axes:
            total *= n + 1
        if total <= 1:
            return
        combos = itertools.product(*[range(n + 1) for _, _, n in axes])
        if total > COMBO_LIMIT:
            r = random.Random(total)
            combos = ([r.randint(0, n) for _, _, n in axes] for _ in range(COMBO_LIMIT))
        for ks in combos:
            if not any(ks):
                continue   # that one is "synced"
            kf = {a[1]: k for a, k in zip(axes, ks) if a[0] == "f"}
            kd = {a[1]: k for a, k in zip(axes, ks) if a[0] == "d"}
            yield "all:" + ",".join(map(str, ks)), m.reconstruct(kf, kd)
        return
    kind, _, n = choice.partition(":")
    r = random.Random(int(n))
    kf = {i: r.randint(0, c) for i, c in files.items()}
    kd = {d: r.randint(0, c) for d, c in dirs.items()}
    torn = {i: r.randrange(1, 1 << 16) for i in files} if kind == "torn" else None
    yield choice, m.reconstruct(kf, kd, torn)


def _verify(rec: Recording, state: dict, acked: list[dict], released: list[Released], cut: int, choice: str,
            rep: Report) -> list[Finding]:
    """Write the reconstruction back at the original paths and open it with the real agent, through
    the CLI's fault boundary (agent.cli.dispatch): one clear line or success, never a traceback."""
    import argparse

    from agent import cli
    from agent.core import cose, events as ev
    from agent.core.merge import below
    from agent import apply, produce
    from agent.node import Node
    write_tree(rec.roots, state)
    found: list[Finding] = []

    def finding(kind: str, detail: str) -> None:
        found.append(Finding(kind, cut, choice, detail))

    hlc_of: dict[str, tuple[int, int]] = {}
    for r in released:
        if cose.content_type(r.raw) == ev.EVENT_CONTENT_TYPE:
            hlc_of[ev.event_id(r.raw).hex()] = r.hlc
    observed = []
    for mk in acked:
        for eid, h in zip(mk["ids"], mk.get("hlcs", [])):
            hlc_of[eid] = tuple(h)
            observed.append(tuple(h))
    behind = rec.start_ms - 600_000      # the wall clock after the cut: behind the run (no RTC)

    def verb(args) -> int:
        node = Node.open(rec.home)
        try:
            horizon = node.tables[T].horizon

            def held(eid_hex: str) -> bool:
                if apply.known(node.state, bytes.fromhex(eid_hex)) == "log":
                    return True
                h = hlc_of.get(eid_hex)
                return h is not None and below(h, horizon)
            for mk in acked:
                for eid in mk["ids"]:
                    if not held(eid):
                        finding("lost_ack", f"{mk['how']} event {eid} acknowledged, missing after the cut "
                                            f"(horizon {horizon})")
            for r in released:
                if cose.content_type(r.raw) == ev.EVENT_CONTENT_TYPE:
                    if not held(ev.event_id(r.raw).hex()):
                        finding("released_missing", f"event at HLC {r.hlc} released (journal fsync at op {r.at}), "
                                                    "not in the store after recovery")
                elif not produce.record_held(node.state, r.raw):
                    finding("released_missing", f"record at HLC {r.hlc} released (op {r.at}), not stored")
            floors = node.own_history_floors()
            restored = node.conn.execute("SELECT count(*) FROM surfaced WHERE kind='restored_home'").fetchone()[0]
            if "*" in floors or restored:
                finding("false_restore", f"a power cut taken for a restored home (floors {floors}, "
                                         f"restored_home rows {restored})")
            dup = node.conn.execute("SELECT hlc_p, hlc_l, count(*) FROM events WHERE site_id=? GROUP BY 1, 2 "
                                    "HAVING count(*) > 1", (node.site_id,)).fetchall()
            if dup:
                finding("hlc_reused", f"own events share HLCs: {dup[:3]}")
            eid = node.write(T, {"device": "verify", "seq": cut}, {"temp": 0.5}, now=behind)
            new = tuple(node.conn.execute("SELECT hlc_p, hlc_l FROM events WHERE event_id=?", (eid,)).fetchone())
            top = max((r.hlc for r in released), default=None)
            if top is not None and new <= top:
                same = [r.hlc for r in released if r.hlc == new]
                finding("hlc_reused", f"new local event at {new} is not above the highest HLC released before "
                                      f"the cut {top}" + (" (the same HLC was released)" if same else ""))
            top_obs = max(observed, default=None)
            if top_obs is not None and new <= top_obs:
                finding("observed_undercut", f"new local event at {new} is not above applied HLC {top_obs}")
        finally:
            node.close()
        return 0

    err = io.StringIO()
    old = os.environ.get("SSP_AGENT_WITNESS_DIR")
    os.environ["SSP_AGENT_WITNESS_DIR"] = str(rec.witness)
    try:
        # First a read verb (`status`: a read-only open, which recovers nothing and writes nothing,
        # so it sees the cut as it is), then the writing open that recovers.
        out = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = cli.main(["--home", str(rec.home), "status"])
        if rc != 0:
            finding("read_refused", err.getvalue().strip()[-300:])
        elif json.loads(out.getvalue())["site_id"] != rec.site_id.hex():
            finding("read_refused", "status shows another site")
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = cli.dispatch(argparse.Namespace(fn=verb, home=str(rec.home)))
    except BaseException as e:  # noqa: BLE001 - what escapes the CLI boundary is a traceback
        import traceback
        finding("traceback", "".join(traceback.format_exception_only(type(e), e)).strip())
        return found
    finally:
        if old is None:
            os.environ.pop("SSP_AGENT_WITNESS_DIR", None)
        else:
            os.environ["SSP_AGENT_WITNESS_DIR"] = old
    if rc == 0:
        rep.opened += 1
    else:
        rep.refused += 1
        lines = [x for x in err.getvalue().strip().splitlines() if x.startswith("ssp-agent:")]
        finding("refused", (lines[-1] if lines else err.getvalue().strip()[-300:]))
    return found


# ---------------------------------------------------------------- tools/powercut.sh
def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile
    import time
    ap = argparse.ArgumentParser(description="power cuts at every sync point of a recorded workload "
                                             "(docs/reliability.md)")
    ap.add_argument("--work", help="working directory (default: a new temporary one, removed afterwards)")
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sample-syncs", type=int, default=None, help="check only this many sync points (default: all)")
    ap.add_argument("--random", type=int, default=1000, help="random cut points between sync points")
    ap.add_argument("--torn", type=int, default=1000, help="random cut points with torn writes")
    ap.add_argument("--no-combos", action="store_true", help="at sync points, only the all-unsynced-lost case")
    ap.add_argument("--drop-sync", help="negative control: skip fsyncs of paths containing this")
    ap.add_argument("--controls", action="store_true",
                    help="also run the negative controls (store WAL and signing-journal fsyncs skipped)")
    args = ap.parse_args(argv)
    os.environ.setdefault("SSP_AGENT_CLOCK_TRUSTED", "1")
    status = 0
    runs = [(args.drop_sync, args.events)]
    if args.controls:
        runs += [("store.sqlite-wal", 60), ("sign-journal", 60)]
    for drop, events in runs:
        with contextlib.ExitStack() as stack:
            work = Path(args.work) / (drop or "real") if args.work else \
                Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="powercut-")))
            work.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            rec = record(work, events=events, seed=args.seed, drop_sync=drop)
            t1 = time.monotonic()
            cuts = cut_points(rec, sample_syncs=args.sample_syncs, random_points=args.random, torn_points=args.torn,
                              all_combos=not args.no_combos, seed=args.seed)
            rep = check(rec, cuts)
            out = {"run": f"negative control: fsyncs of *{drop}* skipped" if drop else "the agent as it is",
                   "events": events, "record_s": round(t1 - t0, 1), "check_s": round(time.monotonic() - t1, 1),
                   **rep.summary()}
            print(json.dumps(out, indent=1), flush=True)
            if drop is None and rep.findings:
                status = 1
            if drop is not None and not rep.findings:
                print(f"powercut: the negative control ({drop}) was NOT caught", file=sys.stderr)
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
