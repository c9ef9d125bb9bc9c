"""A KV event publisher speaking vLLM's ZmqEventPublisher protocol, driven
by the Go tests over stdin (libzmq through pyzmq, msgpack through
python-msgpack: independent of the Go side).

PUB frames: (topic, 8-byte big-endian seq, payload). Replay ROUTER: a
request (id, b"", 8-byte start) is answered with (id, b"", topic, seq,
payload) for every buffered batch from start on, then (id, b"", b"",
seq -1, b"").

stdin, one JSON command a line:
  {"op": "publish", "batch": B, "hide": false}   hide: buffer, do not send
  {"op": "raw", "size": N}                       a payload of N bytes
  {"op": "restart"}                              sockets closed and bound again on the
                                                 same ports, new sequence from 0, empty buffer
  {"op": "quit"}
In B, {"bytes": "hex"} stands for a bytes value. Prints "ready PUB REPLAY"
then "ok SEQ" after each command.

KVTEST_HEARTBEAT_MS=N in the environment sets ZMQ_HEARTBEAT_IVL to N ms
and ZMQ_HEARTBEAT_TIMEOUT to 3N on the PUB socket: libzmq then sends
PINGs and drops a subscriber that sends nothing back within the timeout.
"""
import json
import os
import sys
import time

import msgpack
import zmq


def conv(v):
    if isinstance(v, dict):
        if set(v) == {"bytes"}:
            return bytes.fromhex(v["bytes"])
        return {k: conv(x) for k, x in v.items()}
    if isinstance(v, list):
        return [conv(x) for x in v]
    return v


def rebind(ctx, kind, port):
    """A new socket on a port just released (libzmq closes asynchronously)."""
    deadline = time.time() + 10
    while True:
        sock = ctx.socket(kind)
        if kind == zmq.PUB:
            heartbeat(sock)
        try:
            sock.bind("tcp://127.0.0.1:%d" % port)
            return sock
        except zmq.ZMQError:
            sock.close(linger=0)
            if time.time() > deadline:
                raise
            time.sleep(0.02)


def heartbeat(sock):
    ms = int(os.environ.get("KVTEST_HEARTBEAT_MS", "0"))
    if ms > 0:
        sock.setsockopt(zmq.HEARTBEAT_IVL, ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ms)
    return sock


def main():
    topic = sys.argv[1].encode() if len(sys.argv) > 1 else b""
    ctx = zmq.Context.instance()
    pub = heartbeat(ctx.socket(zmq.PUB))
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    rep = ctx.socket(zmq.ROUTER)
    rep_port = rep.bind_to_random_port("tcp://127.0.0.1")
    poller = zmq.Poller()
    poller.register(rep, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)
    seq = 0
    buf = []
    print("ready", pub_port, rep_port, flush=True)
    while True:
        for sock, _ in poller.poll(1000):
            if sock is rep:
                frames = rep.recv_multipart()
                if len(frames) != 3:
                    continue
                cid, _, start = frames
                start = int.from_bytes(start, "big")
                for s, payload in buf:
                    if s >= start:
                        rep.send_multipart([cid, b"", topic, s.to_bytes(8, "big"), payload])
                rep.send_multipart([cid, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
                continue
            line = sys.stdin.readline()
            if not line:
                return
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "quit":
                return
            if op == "restart":
                poller.unregister(rep)
                pub.close(linger=0)
                rep.close(linger=0)
                pub = rebind(ctx, zmq.PUB, pub_port)
                rep = rebind(ctx, zmq.ROUTER, rep_port)
                poller.register(rep, zmq.POLLIN)
                seq, buf = 0, []
                print("ok", seq, flush=True)
                continue
            if op == "raw":
                payload = b"\x00" * cmd["size"]
            else:
                payload = msgpack.packb(conv(cmd["batch"]), use_bin_type=True)
            buf.append((seq, payload))
            if not cmd.get("hide"):
                pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
            print("ok", seq, flush=True)
            seq += 1


if __name__ == "__main__":
    main()
