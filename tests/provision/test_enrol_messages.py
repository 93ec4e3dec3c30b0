"""What enrolment says while it waits (docs/operations.md "Fleet workflow"): a device with no RTC
waits for a synchronised clock, up to the bundle's `wait_clock_s`, and says so every few seconds on
stderr (the journal and the console), naming what it waits for."""
from __future__ import annotations

import subprocess

from tests.cli_cmd import agent_cmd, agent_env

from .test_hostile_bundle import base_bundle, bundle_with  # noqa: F401  (a fixture)


def test_enrol_says_what_it_waits_for_while_it_waits(tmp_path, base_bundle):  # noqa: F811
    b = bundle_with(tmp_path, base_bundle, lambda m: m.update(wait_clock_s=12, clock_trusted=False))
    env = agent_env({"SSP_AGENT_CLOCK_SYNC": f"timesyncd:{tmp_path / 'no-such-flag'}"})
    env.pop("SSP_AGENT_CLOCK_TRUSTED", None)
    root, boot = tmp_path / "root", tmp_path / "boot"
    p = subprocess.run([*agent_cmd(), "provision", "device-setup", "--bundle", str(b), "--root", str(root),
                        "--boot", str(boot)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([*agent_cmd(), "provision", "enrol", "--bundle", str(b), "--root", str(root),
                        "--boot", str(boot)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and "clock_untrusted" in p.stderr, p.stderr   # never synchronised: refused
    waits = [ln for ln in p.stderr.splitlines() if "waits for a synchronised wall clock" in ln]
    # at the start and every 5 s of the 12 s wait: three lines, whatever the machine's speed
    assert len(waits) >= 2, p.stderr
    assert all("s left" in ln and "init" in ln for ln in waits), waits
