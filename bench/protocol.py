"""Reply chunks per second through the real socket, and how long a chunk waits in the handler.

A driver process plays the daemon: it creates the socketpair exactly as the daemon does, spawns this
file in `--serve` mode as the handler (pinned to one CPU core when possible), sends S concurrent
streaming requests at once and reads every reply chunk. The handler's `stream` yields N chunks shaped
like chat chunks, each stamped with time.monotonic_ns() at yield; the driver subtracts that from the
time it decoded the chunk (same clock, both processes), so the latency covers the handler's buffer,
the socket and the driver's read.

chunks/s is wall-clock throughput; chunks/cpu-s divides by the handler's own CPU time (from /proc),
which stays meaningful when other processes share the core. Each scenario runs --repeat times and
the fastest run is shown.

Scenarios: tight (the handler never awaits between chunks: raw protocol throughput), step (each
chunk awaits one loop iteration, like a stream woken per engine step), paced (a chunk every 10 ms
per stream: latency at a realistic load, far below saturation).

    python bench/protocol.py [--streams 256] [--chunks 2000] [--core 1]
"""
import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

import msgpack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SOCKET_BUFFER = 1 << 20


def serve(core: int | None) -> None:
    import daemon_protocol

    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})

    @daemon_protocol.handler("stream")
    async def stream(data):
        n, mode = data["n"], data["mode"]
        now = time.monotonic_ns
        for _ in range(n - 1):
            yield {"content": "tok", "finish_reason": None, "t": now()}
            if mode == "step":
                await asyncio.sleep(0)
            elif mode == "paced":
                await asyncio.sleep(0.01)
        yield {"content": "", "finish_reason": "stop", "t": now()}

    daemon_protocol.serve()


def spawn_handler(core: int | None):
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for sock in (parent, child):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    child.set_inheritable(True)
    args = [sys.executable, os.path.abspath(__file__), "--serve"] + ([] if core is None else ["--core", str(core)])
    proc = subprocess.Popen(args, env={**os.environ, "HFENDPOINT_FD": str(child.fileno())},
                            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
    child.close()
    return proc, parent


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux), to rate the handler per CPU-second even
    when other processes share its core."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_scenario(sock: socket.socket, pid: int, mode: str, streams: int, chunks: int, first_id: int):
    ids = range(first_id, first_id + streams)
    requests = b"".join(msgpack.packb({"id": i, "name": "stream", "data": {"n": chunks, "mode": mode}}) for i in ids)
    unpacker = msgpack.Unpacker(raw=False)
    remaining = streams
    received = 0
    latencies = []
    now = time.monotonic_ns
    cpu_start = cpu_seconds(pid)
    start = time.perf_counter()
    sock.sendall(requests)
    while remaining:
        data = sock.recv(1 << 20)
        if not data:
            raise RuntimeError("the handler closed the socket early")
        unpacker.feed(data)
        t = now()
        for reply in unpacker:
            payload = reply["data"]
            received += 1
            latencies.append(t - payload["t"])
            if payload["finish_reason"] is not None:
                remaining -= 1
    elapsed = time.perf_counter() - start
    cpu = cpu_seconds(pid)
    assert received == streams * chunks, (received, streams * chunks)
    latencies.sort()

    def pick(q):
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] / 1e6

    per_cpu_second = received / (cpu - cpu_start) if cpu is not None and cpu > cpu_start else float("nan")
    cpu_used = cpu - cpu_start if cpu is not None else float("nan")
    return received / elapsed, per_cpu_second, cpu_used, pick(0.5), pick(0.99)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=2000, help="chunks per stream (tight and step)")
    parser.add_argument("--paced-chunks", type=int, default=200, help="chunks per stream in the paced run")
    parser.add_argument("--core", type=int, default=None, help="CPU core for the handler (default: the last one)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per scenario; the best is shown")
    args = parser.parse_args()
    core = args.core
    if core is None and hasattr(os, "sched_getaffinity"):
        core = max(os.sched_getaffinity(0))
    if args.serve:
        serve(core)
        return
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {core})  # keep the driver off the handler's core
    proc, sock = spawn_handler(core)
    try:
        print(f"handler pinned to core {core}; {args.streams} concurrent streams")
        print(f"{'scenario':<8} {'chunks':>9} {'chunks/s':>11} {'chunks/cpu-s':>13} {'cpu s':>6} {'p50 ms':>8} "
              f"{'p99 ms':>8}")
        next_id = 1
        for mode, chunks in (("tight", args.chunks), ("step", args.chunks), ("paced", args.paced_chunks)):
            results = []
            for _ in range(args.repeat if mode != "paced" else 1):
                results.append(run_scenario(sock, proc.pid, mode, args.streams, chunks, next_id))
                next_id += args.streams
            rate, per_cpu, cpu, p50, p99 = max(results)
            print(f"{mode:<8} {args.streams * chunks:>9} {rate:>11,.0f} {per_cpu:>13,.0f} {cpu:>6.2f} {p50:>8.2f} "
                  f"{p99:>8.2f}")
    finally:
        sock.close()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
