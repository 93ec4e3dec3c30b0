"""Provisioning field devices (docs/operations.md "Fleet workflow"), below the CLI that calls it:

- bundle.py: a device's bundle (manifest, profile, keystore choice, broker settings, units,
  wheelhouse, first-boot script) and the one check of a bundle before anything reads it;
- image.py: writing a bundle onto a Raspberry Pi OS image file (mtools, debugfs; no mount);
- enrolment.py: on the device, /etc/ssp-agent and the enrolment unit, then `init` inside the
  keystore and the enrolment file on the boot partition;
- files.py: the two errors (ProvisionRefused, ProvisionFault) and the bounded reads and the writes
  under a root they share.

Nothing here imports the CLI: a step that needs a verb (enrolment installs the service units) is
handed it by its caller."""
