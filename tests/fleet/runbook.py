"""A document's runbook section as steps a test executes: each `### Step N. title` heading under
the section's `# ` heading and the ```sh block under it, run with bash as written (the variables
given, `ssp-agent` the command under test through tests/cli_cmd.py). docs/operations.md "Fleet
rehearsal" by default; docs/getting-started.md "Three nodes through one broker" too."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

from tests.cli_cmd import agent_cmd, agent_env

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
SECTION = "# Fleet rehearsal"
_STEP = re.compile(r"^### Step (\d+)\. (.+)$")


def doc_steps(text: str | None = None, docs: Path = DOCS, section: str = SECTION) -> list[tuple[int, str, str]]:
    """[(number, title, the step's one sh block)] in the order the section gives them (headings
    are read outside fences only: a block's comment lines start with `#` too)."""
    lines = (docs.read_text() if text is None else text).splitlines()
    steps: list[list] = []
    inside, fence, block = False, None, []
    for ln in lines:
        if fence is not None:
            if ln.startswith("```"):
                if fence == "sh" and steps:
                    steps[-1][2].append("\n".join(block) + "\n")
                fence = None
            else:
                block.append(ln)
            continue
        if ln.startswith("```"):
            fence, block = ln[3:].strip(), []
            continue
        if ln.startswith("# "):
            inside = ln.startswith(section)
            continue
        m = _STEP.match(ln)
        if inside and m:
            steps.append([int(m.group(1)), m.group(2).strip(), []])
    for num, _title, blocks in steps:
        assert len(blocks) == 1, f"step {num} should hold exactly one ```sh block, it holds {len(blocks)}"
    return [(n, t, b[0]) for n, t, b in steps]


class Runbook:
    """Runs the doc's steps by number; `ssp-agent` on PATH is a wrapper for agent_cmd()."""

    def __init__(self, tmp: Path, docs: Path = DOCS, section: str = SECTION) -> None:
        self.steps = {n: (t, b) for n, t, b in doc_steps(docs=docs, section=section)}
        self.bin = tmp / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        wrapper = self.bin / "ssp-agent"
        wrapper.write_text("#!/bin/sh\nexec " + " ".join(map(shlex.quote, agent_cmd())) + ' "$@"\n')
        wrapper.chmod(0o755)
        self.ran: list[int] = []

    def env(self, variables: dict) -> dict:
        env = agent_env({k: str(v) for k, v in variables.items()})
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        return env

    def argv(self, n: int) -> list[str]:
        return ["bash", "-euo", "pipefail", "-c", self.steps[n][1]]

    def run(self, n: int, check: bool = True, **variables) -> subprocess.CompletedProcess:
        """Step `n` in a fresh bash; a generous ceiling only catches a hang."""
        self.ran.append(n)
        p = subprocess.run(self.argv(n), capture_output=True, text=True, env=self.env(variables), timeout=600)
        if check:
            assert p.returncode == 0, (n, self.steps[n][0], p.returncode, p.stdout[-2000:], p.stderr[-2000:])
        return p

    def start(self, n: int, **variables) -> subprocess.Popen:
        """Step `n` as a service: a process of its own session, stopped by the test."""
        self.ran.append(n)
        return subprocess.Popen(self.argv(n), env=self.env(variables), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)


def stop_group(proc: subprocess.Popen) -> str:
    """SIGTERM a step's process group (a service started by a runbook step), then its stderr."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.communicate(timeout=120)[1]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()[1]
