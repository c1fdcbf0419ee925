"""Reads the served handler's trace (bench/serve.py --trace FILE, written by bench/handler_trace/sitecustomize.py)
and prints where each group of chat requests spent its time to the first token, when the requests of the group
reached each stage, the engine's steps by kind (and the time before each, from the previous one's end: host work,
or idle), and what stalled it: garbage collections longer than STALL_S, Triton compilations, each thread's CPU
time per step in the busiest seconds, and (with serve.py --trace-stacks) where the engine thread was in the
slowest steps.

    PYTHONPATH=. python3 bench/serve_trace.py FILE [--groups warm-up:1,c1:16,c16:64]   # requests as they came
"""
import argparse
import bisect
import json
import statistics
from collections import Counter, defaultdict

from daemon_protocol.writer import data_prefix
from step_trace import kind_of, sort_key

STALL_S = 0.002  # a garbage collection is listed when it holds the GIL longer than this: a visible share of a step
STAGES = (("dispatch", "submit"), ("submit", "add"), ("add", "first"), ("first", "sent"), ("dispatch", "sent"))


def chat_requests(events: list) -> tuple[list[dict], list[float]]:
    """Each chat request's stage times, in the order the daemon sent them, and every encoding's duration. The
    handler numbers its requests in the order they are dispatched (chat-N, its choices chat-N/i) and encodes them in
    parallel, so the n-th smallest N is the n-th dispatch, whatever order the submissions came in."""
    requests, by_engine_id, by_reply_prefix, encoding, encodings, submits = [], {}, {}, {}, [], []
    for t, kind, key in events:
        if kind == "dispatch":
            requests.append({"dispatch": t})
            by_reply_prefix[data_prefix(key).hex()] = requests[-1]
        elif kind == "encode_start":
            encoding[key] = t
        elif kind == "encode_end":
            encodings.append(t - encoding.pop(key))
        elif kind == "submit":
            number, _, choice = key.partition("/")
            if choice in ("", "0"):  # a request's first choice; the others share its stages
                submits.append((int(number.removeprefix("chat-")), t, key))
        elif kind == "sent":
            request = by_reply_prefix.get(key)
            if request is not None:
                request.setdefault("sent", t)
    for request, (_, t, key) in zip(requests, sorted(submits)):
        request["submit"] = t
        by_engine_id[key] = request
    for t, kind, key in events:
        if kind in ("add", "first") and key in by_engine_id:
            by_engine_id[key].setdefault(kind, t)
    return [r for r in requests if "first" in r and "sent" in r], encodings


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f}"


def print_group(name: str, requests: list[dict]) -> None:
    medians = "  ".join(f"{a}->{b} {ms(statistics.median(r[b] - r[a] for r in requests))}" for a, b in STAGES)
    print(f"{name}: {len(requests)} requests; median ms: {medians}")
    start = requests[0]["dispatch"]
    for stage in ("dispatch", "submit", "add", "first"):
        times = sorted(r[stage] - start for r in requests)
        quartiles = [ms(times[round(q * (len(times) - 1))]) for q in (0, 0.25, 0.5, 0.75, 1)]
        print(f"  {stage:8} reached at ms (min, quartiles, max) {', '.join(quartiles)}")


def print_steps(steps: list) -> None:
    rows = defaultdict(lambda: [0, 0.0, 0.0])
    for previous, (start, end, launches) in zip([None, *steps], steps):
        row = rows[kind_of([tuple(launch) for launch in launches])]
        row[0] += 1
        row[1] += end - start
        row[2] += start - previous[1] if previous else 0.0
    print(f"{'step kind':24} {'steps':>6} {'seconds':>8} {'ms/step':>8} {'ms before':>9}")
    for kind in sorted(rows, key=sort_key):
        count, seconds, between = rows[kind]
        print(f"{kind:24} {count:6d} {seconds:8.3f} {1e3 * seconds / count:8.3f} {1e3 * between / count:9.3f}")


def print_stalls(trace: dict, serving_from: float) -> None:
    gcs = [(t - serving_from, seconds, generation) for t, seconds, generation in trace["gcs"]
           if seconds > STALL_S and t >= serving_from]
    print(f"garbage collections over {1e3 * STALL_S:g} ms while serving (s from the first request, ms, generation):",
          [(round(t, 2), round(1e3 * seconds, 1), generation) for t, seconds, generation in gcs] or "none")
    compiles = [(round(t - serving_from, 2), name) for t, name in trace["compiles"] if t >= serving_from]
    print("Triton compilations while serving:", compiles or "none")
    samples = trace["cpu"]
    busy = sorted(zip(samples, samples[1:]), key=lambda pair: pair[1][1] - pair[0][1], reverse=True)[:3]
    for (t0, steps0, cpu0), (t1, steps1, cpu1) in sorted(busy):
        if steps1 > steps0:
            per_step = {name: ms((cpu1[name] - cpu0.get(name, 0.0)) / (steps1 - steps0)) for name in cpu1
                        if cpu1[name] > cpu0.get(name, 0.0)}
            print(f"  {t0 - serving_from:6.1f}-{t1 - serving_from:.1f} s: {steps1 - steps0} steps, "
                  f"{ms((t1 - t0) / (steps1 - steps0))} ms each; CPU ms per step by thread {per_step}")


def print_slowest_steps(trace: dict, count: int) -> None:
    """Where the engine thread was in the `count` slowest steps (with --trace-stacks): its three most sampled
    stacks in each, innermost frame first."""
    stacks = trace["stacks"]
    if not stacks["samples"]:
        return
    times = [t for t, _ in stacks["samples"]]
    print(f"the engine thread in the {count} slowest steps (samples of each stack, innermost frame first):")
    for start, end, launches in sorted(trace["steps"], key=lambda step: step[1] - step[0], reverse=True)[:count]:
        sampled = stacks["samples"][bisect.bisect_left(times, start):bisect.bisect_right(times, end)]
        print(f"  {ms(end - start)} ms, launches {launches}:")
        for index, samples in Counter(index for _, index in sampled).most_common(3):
            print(f"    {samples:4d} x {stacks['table'][index]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--groups", default="", help="NAME:COUNT,... consecutive groups of requests (default: one)")
    args = ap.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)
    requests, encodings = chat_requests(trace["events"])
    if not requests:
        raise SystemExit(f"{args.trace} holds no finished chat request")
    print(f"{len(requests)} chat requests, {len(trace['steps'])} steps; encoding ms median "
          f"{ms(statistics.median(encodings))}, max {ms(max(encodings))}")
    groups = [(name, int(count)) for name, count in (g.split(":") for g in args.groups.split(",") if g)]
    start = 0
    for name, count in groups or [("all", len(requests))]:
        if requests[start:start + count]:
            print_group(name, requests[start:start + count])
        start += count
    print_steps(trace["steps"])
    print_stalls(trace, requests[0]["dispatch"])
    print_slowest_steps(trace, 5)


if __name__ == "__main__":
    main()
