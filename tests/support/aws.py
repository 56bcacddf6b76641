"""AWS sink test helpers: moto's standalone server on a loopback port (HTTP, like any AWS endpoint), a
fault-injecting proxy in front of it, fake credentials, and readers of what reached SQS and Kinesis.

The proxy forwards every request to moto and can (a) fail chosen batch entries the way AWS reports
a per-entry failure (``SendMessageBatch`` / ``PublishBatch`` ``Failed`` entries, ``PutRecords``
records with an ``ErrorCode``; ``PutRecord`` answered with an error): the entries whose message or
record data contains a marker are not forwarded, the others are, so entries after a failed one are
really written, as AWS may do; (b) answer every request 503 (an outage of the service)."""

from __future__ import annotations

import base64
import http.client
import json
import re
import subprocess
import sys
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import boto3

from pgstream_dagster.devdb import free_port

from .sinks import stop_process, wait_listening

REGION = "us-east-1"
ACCOUNT = "123456789012"  # moto's default account


class MotoServer:
    """moto's standalone server (``python -m moto.server``) on 127.0.0.1; its state lives in memory:
    a restart starts empty."""

    def __init__(self, log: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> MotoServer:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_listening(self.proc, self.port, self.log, timeout=60)
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        stop_process(proc)


@dataclass
class FakeCredentials:
    """What the ``aws_env`` fixture put in the environment: values no message or log may show."""

    access_key_id: str
    secret_access_key: str
    session_token: str

    @property
    def secrets(self) -> list[str]:
        return [self.secret_access_key, self.session_token]


def client(service: str, endpoint: str) -> Any:
    """A boto3 client of the test itself (explicit fake credentials: it does not depend on the environment)."""
    return boto3.client(service, endpoint_url=endpoint, region_name=REGION, aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def unique_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def create_queue(endpoint: str, *, fifo: bool, name: str | None = None, **attributes: str) -> str:
    """A new queue (a unique name unless ``name`` is given); its URL."""
    name = name or unique_name("pgstream") + (".fifo" if fifo else "")
    if fifo:
        attributes["FifoQueue"] = "true"
    return str(client("sqs", endpoint).create_queue(QueueName=name, Attributes=attributes)["QueueUrl"])


def queue_arn(endpoint: str, queue_url: str) -> str:
    answer = client("sqs", endpoint).get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])
    return str(answer["Attributes"]["QueueArn"])


def receive_all(endpoint: str, queue_url: str, expected: int, timeout: float = 20) -> list[dict[str, Any]]:
    """Every message of the queue, in the order SQS hands them out (each deleted once received), waiting
    until ``expected`` arrived, then once more for anything beyond (a duplicate)."""
    sqs = client("sqs", endpoint)
    messages: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        batch = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, AttributeNames=["All"],
                                    MessageAttributeNames=["All"], WaitTimeSeconds=0).get("Messages", [])
        if batch:
            sqs.delete_message_batch(QueueUrl=queue_url, Entries=[
                {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(batch)])
            messages += batch
            quiet = 0
        elif len(messages) >= expected:
            quiet += 1
        else:
            time.sleep(0.1)
    return messages


def message_event_id(message: dict[str, Any]) -> int:
    return int(message["MessageAttributes"]["pgstream-event-id"]["StringValue"])


def create_stream(endpoint: str, shards: int) -> str:
    name = unique_name("pgstream")
    kinesis = client("kinesis", endpoint)
    kinesis.create_stream(StreamName=name, ShardCount=shards)
    kinesis.get_waiter("stream_exists").wait(StreamName=name, WaiterConfig={"Delay": 0.2, "MaxAttempts": 50})
    return name


def read_stream(endpoint: str, name: str) -> dict[str, list[dict[str, Any]]]:
    """Every record of every shard, in shard order: ``{shard id: [record, ...]}``."""
    kinesis = client("kinesis", endpoint)
    found: dict[str, list[dict[str, Any]]] = {}
    for shard in kinesis.list_shards(StreamName=name)["Shards"]:
        shard_id = shard["ShardId"]
        iterator = kinesis.get_shard_iterator(StreamName=name, ShardId=shard_id,
                                              ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
        records: list[dict[str, Any]] = []
        while iterator:
            answer = kinesis.get_records(ShardIterator=iterator, Limit=10000)
            records += answer["Records"]
            if not answer["Records"]:
                break
            iterator = answer.get("NextShardIterator")
        found[shard_id] = records
    return found


@dataclass
class Fault:
    """Fail the entries carrying a marker with ``code``, ``times`` times (``None``: always)."""

    code: str
    sender_fault: bool = False
    times: int | None = None
    message: str = "injected by the test proxy"
    hits: int = 0

    def take(self) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        self.hits += 1
        return True


@dataclass
class Recorded:
    """A request the proxy saw: the API action and its entries as sent by the client."""

    action: str
    entries: list[Any] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)


_SNS_MEMBER = re.compile(r"^PublishBatchRequestEntries\.member\.(\d+)\.(.+)$")


class FaultProxy:
    """An HTTP proxy in front of moto that injects per-entry failures and outages (module docstring)."""

    def __init__(self, target: str) -> None:
        self.target = urlsplit(target)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.faults: dict[str, Fault] = {}  # marker in a message body / record data -> fault
        self.outage = False
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, headers, answer = proxy._handle(self.path, dict(self.headers.items()), body)
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def fail(self, marker: str, code: str, *, sender_fault: bool = False, times: int | None = None,
             message: str = "injected by the test proxy") -> Fault:
        fault = Fault(code, sender_fault, times, message)
        self.faults[marker] = fault
        return fault

    def actions(self, action: str) -> list[Recorded]:
        return [r for r in self.requests if r.action == action]

    # -- the proxy ---------------------------------------------------------------------------------------

    def _fault_for(self, text: str) -> Fault | None:
        with self._lock:
            for marker, fault in self.faults.items():
                if marker in text and fault.take():
                    return fault
        return None

    def _forward(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        connection = http.client.HTTPConnection(self.target.hostname or "127.0.0.1", self.target.port, timeout=30)
        try:
            sent = {k: v for k, v in headers.items() if k.lower() not in ("content-length", "host", "connection")}
            connection.request("POST", path, body, {**sent, "Host": self.target.netloc,
                                                   "Content-Length": str(len(body))})
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def _handle(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        target = next((v for k, v in headers.items() if k.lower() == "x-amz-target"), "")
        action = target.rsplit(".", 1)[-1] if target else dict(parse_qsl(body.decode())).get("Action", "")
        if self.outage:
            self.requests.append(Recorded(action))
            return 503, [], b""
        if action == "SendMessageBatch":
            return self._sqs_batch(path, headers, body)
        if action == "PutRecords":
            return self._put_records(path, headers, body)
        if action == "PutRecord":
            data = json.loads(body)
            self.requests.append(Recorded(action, [data], data))
            fault = self._fault_for(base64.b64decode(data["Data"]).decode())
            if fault is not None:
                error = json.dumps({"__type": fault.code, "message": fault.message}).encode()
                return 400, [("Content-Type", "application/x-amz-json-1.1")], error
        elif action == "PublishBatch":
            return self._sns_batch(path, headers, body)
        elif action:
            self.requests.append(Recorded(action))
        return self._forward(path, headers, body)

    def _sqs_batch(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        data = json.loads(body)
        entries = data["Entries"]
        self.requests.append(Recorded("SendMessageBatch", entries, data))
        failing = {e["Id"]: fault for e in entries if (fault := self._fault_for(e["MessageBody"])) is not None}
        data["Entries"] = [e for e in entries if e["Id"] not in failing]
        status, out_headers, answer = 200, [("Content-Type", "application/x-amz-json-1.0")], b'{"Successful": []}'
        if data["Entries"]:
            status, out_headers, answer = self._forward(path, headers, json.dumps(data).encode())
        if status != 200:
            return status, out_headers, answer
        result = json.loads(answer)
        result["Failed"] = (result.get("Failed") or []) + [
            {"Id": entry_id, "SenderFault": f.sender_fault, "Code": f.code, "Message": f.message}
            for entry_id, f in failing.items()]
        return status, out_headers, json.dumps(result).encode()

    def _put_records(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        data = json.loads(body)
        records = data["Records"]
        self.requests.append(Recorded("PutRecords", records, data))
        failing = {i: fault for i, r in enumerate(records)
                   if (fault := self._fault_for(base64.b64decode(r["Data"]).decode())) is not None}
        data["Records"] = [r for i, r in enumerate(records) if i not in failing]
        status, out_headers, answer = 200, [("Content-Type", "application/x-amz-json-1.1")], b'{"Records": []}'
        if data["Records"]:
            status, out_headers, answer = self._forward(path, headers, json.dumps(data).encode())
        if status != 200:
            return status, out_headers, answer
        written = iter(json.loads(answer)["Records"])
        merged = [{"ErrorCode": failing[i].code, "ErrorMessage": failing[i].message} if i in failing else next(written)
                  for i in range(len(records))]
        result = {"FailedRecordCount": len(failing), "Records": merged}
        return status, out_headers, json.dumps(result).encode()

    def _sns_batch(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        params = parse_qsl(body.decode(), keep_blank_values=True)
        members: dict[int, list[tuple[str, str]]] = {}
        rest: list[tuple[str, str]] = []
        for key, value in params:
            match = _SNS_MEMBER.match(key)
            if match:
                members.setdefault(int(match.group(1)), []).append((match.group(2), value))
            else:
                rest.append((key, value))
        entries = [dict(members[n]) for n in sorted(members)]
        self.requests.append(Recorded("PublishBatch", entries))
        failing = {e["Id"]: fault for e in entries if (fault := self._fault_for(e["Message"])) is not None}
        kept = [n for n in sorted(members) if dict(members[n])["Id"] not in failing]
        forwarded = rest + [(f"PublishBatchRequestEntries.member.{i}.{k}", v)
                            for i, n in enumerate(kept, 1) for k, v in members[n]]
        namespace = "http://sns.amazonaws.com/doc/2010-03-31/"
        status, out_headers = 200, [("Content-Type", "text/xml")]
        answer = (f'<PublishBatchResponse xmlns="{namespace}"><PublishBatchResult><Successful/><Failed/>'
                  '</PublishBatchResult><ResponseMetadata><RequestId>injected</RequestId></ResponseMetadata>'
                  '</PublishBatchResponse>').encode()
        if kept:
            status, out_headers, answer = self._forward(path, headers, urlencode(forwarded).encode())
        if status != 200 or not failing:
            return status, out_headers, answer
        root = ET.fromstring(answer)
        ns = root.tag[1:root.tag.index("}")] if root.tag.startswith("{") else ""
        q = (lambda tag: f"{{{ns}}}{tag}") if ns else (lambda tag: tag)
        result = root.find(q("PublishBatchResult"))
        assert result is not None
        failed = result.find(q("Failed"))
        if failed is None:
            failed = ET.SubElement(result, q("Failed"))
        for entry_id, f in failing.items():
            member = ET.SubElement(failed, q("member"))
            for tag, text in (("Id", entry_id), ("Code", f.code), ("Message", f.message),
                              ("SenderFault", "true" if f.sender_fault else "false")):
                ET.SubElement(member, q(tag)).text = text
        ET.register_namespace("", ns)
        return status, out_headers, ET.tostring(root)
