"""Small real ext4 filesystems on loop images (docs/reliability.md "Full disk"), for the full-disk
tests and tools/full_disk.py: `-m 0` (no blocks kept for root) and the block size given (1 KiB is
mke2fs's default below 512 MiB: a small partition)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.cli_cmd import agent_cmd, agent_env


def unavailable() -> str | None:
    """Why loop images cannot be mounted here (None: they can)."""
    if os.geteuid() != 0:
        return "mounting a loop image needs root"
    if not Path("/dev/loop-control").exists():
        return "no loop device (/dev/loop-control)"
    if shutil.which("mkfs.ext4") is None:
        return "mkfs.ext4 is not installed (apt-get install e2fsprogs)"
    return None


@contextlib.contextmanager
def ext4(where: Path, size: str, block: int, inodes: int | None = None):
    """A mounted ext4 image of `size` (truncate's syntax) with `block`-byte blocks; unmounted after."""
    where.mkdir(parents=True, exist_ok=True)
    img, mnt = where / f"ext4-{block}.img", where / f"ext4-{block}"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", size, str(img)], check=True)
    extra = ["-N", str(inodes)] if inodes else []
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-b", str(block), *extra, str(img)], check=True,
                   capture_output=True)
    p = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        raise OSError(f"cannot mount a loop image here: {p.stderr.strip()}")
    try:
        yield mnt
    finally:
        for _ in range(30):     # a child that outlived its test may still hold a file there
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0:
                break
            time.sleep(1)
        else:
            subprocess.run(["umount", "-l", str(mnt)], check=True)
        img.unlink()


def leave_free(fs: Path, free: int) -> Path:
    """Fill `fs` with a file until it refuses, then give back `free` bytes of it: `free` bytes (to
    the block) are left. The file, for `unlink` when space is to come back."""
    f = fs / "filler"
    f.unlink(missing_ok=True)
    fd = os.open(str(f), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (1 << 20, 65536, 1024):
            try:
                while True:
                    os.write(fd, bytes(chunk))
            except OSError as e:
                assert e.errno == 28, e
        os.fsync(fd)
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - free))
        os.fsync(fd)
    finally:
        os.close(fd)
    return f


def exhaust_inodes(fs: Path) -> Path:
    """Create empty files until the filesystem has no inode left: their directory, to remove."""
    d = fs / "inodes"
    d.mkdir()
    i = 0
    try:
        while True:
            (d / str(i)).touch()
            i += 1
    except OSError as e:
        assert e.errno == 28, e
    assert os.statvfs(fs).f_favail == 0
    return d


def cli(home: Path, *args, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*agent_cmd(), "--home", str(home), *map(str, args)], capture_output=True, text=True,
                          env=agent_env(env), timeout=timeout)


def verdict(p: subprocess.CompletedProcess) -> str | None:
    """None when `p` succeeded or failed as a local fault should (exit 1, one line on stderr, no
    traceback); else what went wrong (a signal above all: exit -7 is SIGBUS)."""
    if p.returncode == 0:
        return None
    lines = p.stderr.strip().splitlines()
    if p.returncode < 0:
        return f"killed by signal {-p.returncode}: {p.stderr.strip()[-300:]!r}"
    if p.returncode != 1 or len(lines) != 1 or "Traceback" in p.stderr:
        return f"exit {p.returncode}: {p.stderr.strip()[-600:]!r}"
    return None


def verbs_at(fs: Path, home: Path, free: int, body_file: Path, seq: int) -> dict[str, str | None]:
    """With `free` bytes left on `fs`: every verb's verdict (write, mailbox import, status, dump, events)."""
    filler = leave_free(fs, free)
    try:
        out = {}
        key = json.dumps({"device": "d", "seq": seq})
        out["write"] = verdict(cli(home, "write", "app.readings", "--key", key, "--set", '{"temp": 1.5}'))
        out["mailbox import"] = verdict(cli(home, "mailbox", "import", body_file))
        for verb in ("status", "dump", "events"):
            out[verb] = verdict(cli(home, verb))
        return out
    finally:
        filler.unlink()


def seq_verbs_at(fs: Path, home: Path, free: int, work: Path, n: int, broker_url: str) -> dict[str, str | None]:
    """With `free` bytes left on `fs`: the verdict of each `sequencer` verb on a sequencer home
    there (register, submit, receipt, status, run). A submit refused `disk_full` (exit 2, its JSON
    answer) is the designated refusal; `run` must serve and stop on SIGTERM, or exit 1 with one line."""
    import signal
    from agent.sequencer.framing import encode_private_message
    msg = work / f"commit-{n}"
    msg.write_bytes(encode_private_message(bytes([n % 256]) * 8 + bytes(8), 0))
    filler = leave_free(fs, free)
    try:
        out = {}
        out["register"] = verdict(cli(home, "sequencer", "register", "--group", f"{n:032x}", "--epoch", "5"))
        p = cli(home, "sequencer", "submit", msg)
        out["submit"] = None if p.returncode == 2 and '"disk_full"' in p.stdout else verdict(p)
        out["receipt"] = verdict(cli(home, "sequencer", "receipt", "--group", "ab" * 16, "--epoch", "0"))
        out["status"] = verdict(cli(home, "sequencer", "status"))
        proc = subprocess.Popen([*agent_cmd(), "--home", str(home), "sequencer", "run", "--broker", broker_url,
                                 "--heads-wait", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=agent_env())
        first = proc.stdout.readline()            # {"serving": ...}, or nothing when it exits
        if first:
            proc.send_signal(signal.SIGTERM)
        so, se = proc.communicate(timeout=600)
        out["run"] = verdict(subprocess.CompletedProcess(proc.args, proc.returncode, first + so, se))
        return out
    finally:
        filler.unlink()
