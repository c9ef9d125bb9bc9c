#!/usr/bin/python3
"""Register with a Switchyard ZMQ discovery listener exactly as vLLM does.

Used by interop_test.go with Debian's python3-zmq (libzmq) and python3-msgpack.

  moriio-new: MoRI-IO heartbeat subprocess (moriio_heartbeat.py): DEALER, no
              identity, LINGER=0, SNDTIMEO=1000, msgpack of the new payload.
  moriio-old: early MoRI-IO connector: the old "register" payload, "index"
              counting heartbeats.
  p2pnccl:    P2pNcclEngine.ping(): DEALER with IDENTITY = zmq_address.

--identity overrides the identity choice; --heartbeat-ivl/--heartbeat-timeout
set ZMTP heartbeats (vLLM sets none). A socket monitor counts connects and
disconnects. Prints "ready" once set up and waits for a line on stdin before
connecting; prints "first <unix ns>" right after the first send, then one
JSON line of statistics at the end.
"""

import argparse
import json
import sys
import time

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message


def payload(fmt, role, http, zmq_addr, mode, index):
    host, port = http.rsplit(":", 1)
    host = host.strip("[]")
    if fmt == "moriio-new":
        return {"type": role, "http_address": http, "zmq_address": zmq_addr,
                "dp_size": 1, "tp_size": 1, "transfer_mode": mode}
    if fmt == "moriio-old":
        url_host = "[%s]" % host if ":" in host else host
        return {"type": "register", "role": role, "index": str(index),
                "request_address": "http://%s:%s/v1/completions" % (url_host, port),
                "handshake_port": 6301, "notify_port": 61005,
                "dp_size": 1, "tp_size": 1, "transfer_mode": mode}
    return {"type": role, "http_address": http, "zmq_address": zmq_addr}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--format", default="moriio-new", choices=["moriio-new", "moriio-old", "p2pnccl"])
    ap.add_argument("--role", default="P")
    ap.add_argument("--http-address", required=True)
    ap.add_argument("--zmq-address", default="")
    ap.add_argument("--mode", default="WRITE")
    ap.add_argument("--identity", choices=["default", "none", "zmq"], default="default")
    ap.add_argument("--heartbeat-ivl", type=int, default=0, help="ms")
    ap.add_argument("--heartbeat-timeout", type=int, default=0, help="ms")
    ap.add_argument("--count", type=int, default=10)
    ap.add_argument("--interval", type=float, default=0.1, help="s")
    args = ap.parse_args()

    host = args.http_address.rsplit(":", 1)[0].strip("[]")
    zmq_addr = args.zmq_address
    if not zmq_addr:
        zmq_addr = ("%s:21001" % host) if args.format == "p2pnccl" else \
            "host:%s,handshake:6301,notify:61005" % host

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    identity = args.identity
    if identity == "default":
        identity = "zmq" if args.format == "p2pnccl" else "none"
    if identity == "zmq":
        sock.setsockopt(zmq.IDENTITY, zmq_addr.encode())
    if args.format != "p2pnccl":
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 1000)
    if args.heartbeat_ivl:
        sock.setsockopt(zmq.HEARTBEAT_IVL, args.heartbeat_ivl)
    if args.heartbeat_timeout:
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, args.heartbeat_timeout)

    events = {"connects": 0, "disconnects": 0}
    mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)

    def drain_events(timeout_ms):
        # The monitor is read from this thread only: libzmq sockets are not
        # thread-safe.
        deadline = time.monotonic() + timeout_ms / 1000.0
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            if not mon.poll(left):
                return
            ev = recv_monitor_message(mon)
            if ev["event"] == zmq.EVENT_CONNECTED:
                events["connects"] += 1
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                events["disconnects"] += 1

    # Start together when the test says so: Python start-up is CPU-heavy,
    # and several interpreters importing at once on a small machine would
    # otherwise delay the first registrations.
    print("ready", flush=True)
    sys.stdin.readline()
    sock.connect(args.endpoint)

    sent = 0
    for i in range(args.count):
        data = payload(args.format, args.role, args.http_address, zmq_addr, args.mode, i)
        try:
            sock.send(msgpack.dumps(data))
            sent += 1
        except zmq.Again:
            pass
        if i == 0:
            print("first %d" % time.time_ns(), flush=True)
        drain_events(args.interval * 1000)

    drain_events(50)
    sock.disable_monitor()
    mon.close(linger=0)
    sock.close(linger=0)
    ctx.term()
    print(json.dumps({"sent": sent, **events}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
