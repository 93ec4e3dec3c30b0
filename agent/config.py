"""The agent's configuration file: /etc/ssp-agent/agent.toml, so a service's
broker URL and credentials are not on every command line. Where it is: $SSP_AGENT_CONFIG, else
$CONFIGURATION_DIRECTORY/agent.toml (systemd's ConfigurationDirectory=), else
/etc/ssp-agent/agent.toml. A missing file is an empty configuration.

Precedence for each setting: the command-line flag, then the environment (SSP_AGENT_HOME,
SSP_MQTT_*), then this file. The broker password is never in this file: `password_file` names
a file, and under systemd the unit hands it over as the credential `mqtt-password`
($CREDENTIALS_DIRECTORY/mqtt-password)."""
from __future__ import annotations

import os
import tomllib
from pathlib import Path

from .infile import InputRefused, read_text

DEFAULT_PATH = Path("/etc/ssp-agent/agent.toml")
CREDENTIAL = "mqtt-password"
_MQTT_KEYS = {"broker": str, "username": str, "ca_file": str, "cert_file": str, "key_file": str,
              "password_file": str, "prefix": str, "secure_binding": bool}


class ConfigError(ValueError):
    """A configuration file that cannot be used (a refusal: exit 2, nothing done)."""


# agent.toml holds a home and a broker's settings: a megabyte is far more than any real one
CONFIG_LIMIT = 1 << 20

def config_path() -> Path:
    if os.environ.get("SSP_AGENT_CONFIG"):
        return Path(os.environ["SSP_AGENT_CONFIG"])
    if os.environ.get("CONFIGURATION_DIRECTORY"):
        return Path(os.environ["CONFIGURATION_DIRECTORY"].split(":")[0]) / "agent.toml"
    return DEFAULT_PATH


def load(path: Path | None = None) -> dict:
    """{"home": str|None, "mqtt": {...}} from the file (checked: unknown keys and wrong types refused)."""
    path = config_path() if path is None else path
    try:
        data = tomllib.loads(read_text(path, CONFIG_LIMIT, "configuration"))
    except FileNotFoundError:
        return {"home": None, "mqtt": {}, "path": None}
    except InputRefused as e:        # a FIFO, a device, too large, not UTF-8 (agent/infile.py)
        raise ConfigError(str(e)) from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"configuration {path}: {e}") from None
    except RecursionError:
        raise ConfigError(f"configuration {path}: nested too deeply") from None
    unknown = set(data) - {"home", "mqtt"}
    mqtt = data.get("mqtt", {})
    if not isinstance(mqtt, dict):
        raise ConfigError(f"configuration {path}: [mqtt] must be a table")
    unknown |= {f"mqtt.{k}" for k in set(mqtt) - set(_MQTT_KEYS)}
    if "password" in mqtt:
        raise ConfigError(f"configuration {path}: no password in the configuration file; put it in a file named by "
                          "mqtt.password_file (mode 0600), or /etc/ssp-agent/mqtt-password for the systemd units")
    if unknown:
        raise ConfigError(f"configuration {path}: unknown key(s) {', '.join(sorted(unknown))}")
    for k, typ in _MQTT_KEYS.items():
        if k in mqtt and not isinstance(mqtt[k], typ):
            raise ConfigError(f"configuration {path}: mqtt.{k} must be a {typ.__name__}")
    home = data.get("home")
    if home is not None and (not isinstance(home, str) or len(home) > 4096):
        raise ConfigError(f"configuration {path}: home must be a path (a string of at most 4096 characters)")
    return {"home": home, "mqtt": mqtt, "path": str(path)}


def credential_password() -> str | None:
    """The broker password systemd handed over (LoadCredential=mqtt-password:...); empty: none."""
    d = os.environ.get("CREDENTIALS_DIRECTORY")
    if not d:
        return None
    try:
        v = (Path(d) / CREDENTIAL).read_text().strip()
    except OSError:
        return None
    return v or None
