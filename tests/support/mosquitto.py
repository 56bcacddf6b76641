"""MQTT test helpers: a Mosquitto broker of the test's own (a free port, its own users, ACL, size
limit and TLS, stopped, paused and restarted at will) and a subscriber that records every message
it receives, reconnecting and subscribing again when its broker comes back."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from pgstream_dagster.devdb import free_port

from .sinks import stop_process

MQTT_HOST = "127.0.0.1"
MQTT_PORT = 1883  # the shared Mosquitto (anonymous; .ci/run starts it when it is down)


def _up(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((MQTT_HOST, port)) == 0


@dataclass
class Tls:
    """A CA, and a server certificate it signed for 127.0.0.1 (openssl)."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def make(cls, where: Path) -> Tls:
        where.mkdir(parents=True, exist_ok=True)
        ca, ca_key = where / "ca.pem", where / "ca.key"
        cert, key, csr = where / "server.pem", where / "server.key", where / "server.csr"
        ext = where / "san.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1\n")

        def run(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
            "-days", "2", "-subj", "/CN=pgstream test CA")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
        run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
            "-out", str(cert), "-days", "2", "-extfile", str(ext))
        return cls(ca, cert, key)


@dataclass
class Mosquitto:
    """``mosquitto`` on 127.0.0.1:``port`` with the given users (name -> password; none: anonymous),
    ACL lines (``user NAME`` / ``topic write PATTERN``), ``message_size_limit`` and TLS."""

    workdir: Path
    users: dict[str, str] = field(default_factory=dict)
    acl: list[str] = field(default_factory=list)
    message_size_limit: int | None = None
    tls: Tls | None = None
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    def _config(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        lines = [f"listener {self.port} {MQTT_HOST}", "persistence false", "log_dest stderr",
                 "log_type error", "log_type warning"]
        if os.geteuid() == 0:
            lines.append("user root")  # else it drops to the user mosquitto, who cannot read the files below
        if self.users:
            passwords = self.workdir / "passwords"
            passwords.write_text("")
            for name, password in self.users.items():
                subprocess.run(["mosquitto_passwd", "-b", str(passwords), name, password], check=True,
                               capture_output=True, timeout=30)
            lines += ["allow_anonymous false", f"password_file {passwords}"]
        else:
            lines.append("allow_anonymous true")
        if self.acl:
            acl = self.workdir / "acl"
            acl.write_text("\n".join(self.acl) + "\n")
            lines.append(f"acl_file {acl}")
        if self.message_size_limit is not None:
            lines.append(f"message_size_limit {self.message_size_limit}")
        if self.tls is not None:
            lines += [f"cafile {self.tls.ca}", f"certfile {self.tls.cert}", f"keyfile {self.tls.key}"]
        config = self.workdir / "mosquitto.conf"
        config.write_text("\n".join(lines) + "\n")
        return config

    def start(self) -> Mosquitto:
        config = self._config()
        log = (self.workdir / "mosquitto.log").open("ab")
        self.process = subprocess.Popen(["mosquitto", "-c", str(config)], stdout=log, stderr=log)
        deadline = time.monotonic() + 15
        while not _up(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mosquitto did not start: {(self.workdir / 'mosquitto.log').read_text()}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            self.resume(process)  # a frozen broker would not see the SIGTERM
        stop_process(process)

    def pause(self) -> None:
        """Freeze the broker (SIGSTOP): connections stay open, nothing is answered."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self, process: subprocess.Popen[bytes] | None = None) -> None:
        target = process or self.process
        assert target is not None
        target.send_signal(signal.SIGCONT)


class Subscriber:
    """Subscribes to ``topic`` (QoS 1, MQTT 5) and records every message in arrival order; after a
    broker restart it reconnects and subscribes again (``ready`` tells when it is subscribed)."""

    def __init__(self, topic: str, port: int = MQTT_PORT, protocol: int = mqtt.MQTTv5,
                 username: str | None = None, password: str | None = None) -> None:
        self.topic = topic
        self.messages: list[mqtt.MQTTMessage] = []
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=MQTTProtocolVersion(protocol))
        if username is not None:
            self.client.username_pw_set(username, password)
        self.client.reconnect_delay_set(min_delay=1, max_delay=1)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.connect(MQTT_HOST, port)
        self.client.loop_start()
        assert self.ready.wait(15), "the subscriber did not subscribe"

    def _on_connect(self, client: mqtt.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if not reason.is_failure:
            client.subscribe(self.topic, qos=1)

    def _on_subscribe(self, _c: Any, _u: Any, _mid: Any, _reasons: Any, _p: Any) -> None:
        self.ready.set()

    def _on_disconnect(self, _c: Any, _u: Any, _f: Any, _r: Any, _p: Any) -> None:
        self.ready.clear()

    def _on_message(self, _c: Any, _u: Any, message: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.messages.append(message)

    def received(self) -> list[mqtt.MQTTMessage]:
        with self._lock:
            return list(self.messages)

    def wait_for(self, n: int, timeout: float = 15) -> list[mqtt.MQTTMessage]:
        """The messages once at least ``n`` arrived (and a short quiet spell showed no more come)."""
        deadline = time.monotonic() + timeout
        while len(self.received()) < n:
            assert time.monotonic() < deadline, f"received {len(self.received())} of {n} messages"
            time.sleep(0.02)
        time.sleep(0.2)
        return self.received()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def event_id(message: mqtt.MQTTMessage) -> int:
    """The ``pgstream-event-id`` user property of an MQTT 5 message."""
    return int(dict(message.properties.UserProperty)["pgstream-event-id"])  # type: ignore[union-attr]


def shared_broker_up() -> bool:
    return _up(MQTT_PORT)
