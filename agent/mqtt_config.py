"""The MQTT loop's settings (`RunConfig`, over the exchange's own `ExchangeConfig`), its fixed
bounds, and the broker settings `run` and `sync --once` read from a URL and the environment
(TLS files, credentials: docs/mqtt.md), so secrets need not appear on a command line."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .core.exchange import ExchangeConfig
from .transport.mqtt_settings import MqttSettings


@dataclass
class RunConfig(ExchangeConfig):
    """The loop's settings; those of the exchange itself (cadence_s, realtime, coalesce_s,
    flush_cadence_s, window, answer_timeout_s, secure, limit_probe_s, limit_probe_max_s) are
    `core.exchange.ExchangeConfig`'s, read live by it."""
    max_events: int | None = None  # events per body (default: the link settings' max_events)
    eviction_interval_s: float | None = None  # run node.run_eviction() this often (None: never)
    others_per_step: int = 256  # inbound messages per step from sites not in the keyring (flood bound, pump)
    # Signed acknowledgements (docs/protocol.md §5): the answers taken in one pump are grouped per
    # sender; a slow keystore groups more by itself (bodies queue while it signs). Above 0: at most
    # one signature per sender this often (answers wait for it; bench/bench_acks.py: 25 ms halved
    # answers/s on a software keystore, so the default is 0).
    ack_interval_s: float = 0.0

    @classmethod
    def from_profile(cls, profile, **overrides) -> "RunConfig":
        """The device profile's defaults (cadence, events per body, eviction interval); explicit
        overrides that are not None win."""
        base = dict(cadence_s=float(profile.cadence_s), max_events=int(profile.batch_limit),
                    eviction_interval_s=float(profile.eviction_interval_s))
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)




PUMP_BUDGET_S = 0.25  # a pump call returns after about this long of handling (Runner.pump)
# How long a pull waits in a sleeping peer's broker session before the broker drops it
# (docs/mqtt.md "A waking device"): pulls do not pile up for a peer that sleeps for days.
PULL_EXPIRY_S = 600


def settings_from_env(url: str, **kw) -> MqttSettings:
    """Broker settings from a URL plus SSP_MQTT_* variables (TLS files, credentials) so that
    secrets need not appear on a command line."""
    env = os.environ
    return MqttSettings.from_url(
        url,
        ca_file=kw.get("ca_file") or env.get("SSP_MQTT_CA_FILE"),
        cert_file=kw.get("cert_file") or env.get("SSP_MQTT_CERT_FILE"),
        key_file=kw.get("key_file") or env.get("SSP_MQTT_KEY_FILE"),
        username=kw.get("username") or env.get("SSP_MQTT_USERNAME"),
        password=kw.get("password") or env.get("SSP_MQTT_PASSWORD"),
        prefix=kw.get("prefix") or env.get("SSP_MQTT_PREFIX"),
    )


def dumps_summary(d: dict) -> str:
    return json.dumps(d, sort_keys=True)
