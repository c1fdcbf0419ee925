"""The served handler's trace (bench/serve.py --trace FILE). Python imports this module in every process that has
this folder on its PYTHONPATH; it acts only inside `python -m handler` with HANDLER_TRACE_OUT set, where it wraps
a few of the handler's and the engine's functions to record, with time.perf_counter():
- each chat request's stages: dispatched (read from the daemon), encoding (its start and end, per thread),
  submitted, added to the engine, its first token delivered by the engine thread, its first chunk written;
- each engine step (start, end, and what it launched: sequences, tokens, context), as bench/step_trace.py does;
- every Triton compilation, every garbage collection (with its generation), and each thread's CPU time once a
  second;
- with HANDLER_TRACE_STACKS set, the engine thread's innermost frames every millisecond from the first request on
  (what a step spends its host time on: an eager forward's launches, a sampler plan, a wait).
It writes them as JSON to HANDLER_TRACE_OUT when the handler has been quiet for a second and at exit;
bench/serve_trace.py reads that file."""
import atexit
import gc
import json
import os
import sys
import threading
import time

OUT = os.environ.get("HANDLER_TRACE_OUT")
now = time.perf_counter
TRACE = {"events": [], "steps": [], "compiles": [], "gcs": [], "cpu": [], "stacks": {"table": [], "samples": []}}
STACK_PERIOD_S = 0.001
STACK_DEPTH = 6


def wrap(owner, name: str, make):
    setattr(owner, name, make(getattr(owner, name)))


def install() -> None:
    import triton.knobs

    import daemon_protocol.session as session
    import daemon_protocol.writer as writer
    import engine.engine_core as engine_core
    import engine.worker as worker
    import handler.service as service

    events, first_sent = TRACE["events"], set()

    def dispatch(original):
        def traced(self, obj):
            if type(obj) is dict and obj.get("name") == "chat_completions":
                events.append((now(), "dispatch", obj.get("id")))
            return original(self, obj)
        return traced

    def send_data(original):
        def traced(self, prefix, payload):
            original(self, prefix, payload)
            if prefix not in first_sent:
                first_sent.add(prefix)
                events.append((now(), "sent", prefix.hex()))
        return traced

    def encode(original):
        def traced(data, model, *args):
            events.append((now(), "encode_start", threading.get_ident()))
            try:
                return original(data, model, *args)
            finally:
                events.append((now(), "encode_end", threading.get_ident()))
        return traced

    def submit(original):
        def traced(self, request_id, *args, **kwargs):
            events.append((now(), "submit", request_id))
            return original(self, request_id, *args, **kwargs)
        return traced

    def add(original):
        def traced(self, seq):
            events.append((now(), "add", seq.request_id))
            return original(self, seq)
        return traced

    def deliver(original):
        def traced(self, results):
            events.extend((now(), "first", seq.request_id) for seq, token in results
                          if token is not None and seq.num_output_tokens == 1)
            return original(self, results)
        return traced

    def step(original):
        def traced(self):
            launches, launch = [], self.runner.launch

            def recorded(seqs, num_tokens, *rest):
                launches.append((len(seqs), sum(num_tokens), sum(len(seq) for seq in seqs)))
                return launch(seqs, num_tokens, *rest)
            self.runner.launch, start = recorded, now()
            try:
                return original(self)
            finally:
                self.runner.launch = launch
                TRACE["steps"].append((start, now(), launches))
        return traced

    wrap(session.Session, "_dispatch", dispatch)
    wrap(writer.ReplyWriter, "send_data", send_data)
    wrap(service, "parse_chat_request", encode)
    wrap(worker.Worker, "submit", submit)
    wrap(engine_core.EngineCore, "add", add)
    wrap(worker.Worker, "_deliver", deliver)
    wrap(engine_core.EngineCore, "step", step)

    def on_compile(*, repr, **_):
        TRACE["compiles"].append((now(), repr.split("[")[0]))
        return False
    triton.knobs.runtime.jit_cache_hook = on_compile
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = now()
        else:
            TRACE["gcs"].append((started[0], now() - started[0], info["generation"]))
    gc.callbacks.append(on_gc)


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds of each named thread of this process (the others summed as "other"), from /proc."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    seconds: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        name = names.get(int(tid), "other")
        seconds[name] = seconds.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def sample_engine_stacks() -> None:
    """The engine thread's innermost STACK_DEPTH frames every STACK_PERIOD_S, from the first request on, each
    distinct stack stored once in TRACE["stacks"]["table"] and sampled as (time, its index)."""
    table, stacks = {}, TRACE["stacks"]
    while not TRACE["events"]:
        time.sleep(STACK_PERIOD_S)
    engine = next(thread.ident for thread in threading.enumerate() if thread.name == "engine")
    while (frame := sys._current_frames().get(engine)) is not None:
        frames = []
        while frame is not None and len(frames) < STACK_DEPTH:
            frames.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}:{frame.f_lineno}")
            frame = frame.f_back
        stack = " < ".join(frames)
        if stack not in table:
            table[stack] = len(stacks["table"])
            stacks["table"].append(stack)
        stacks["samples"].append((now(), table[stack]))
        time.sleep(STACK_PERIOD_S)


def write() -> None:
    with open(OUT + ".partial", "w") as f:
        json.dump(TRACE, f)
    os.replace(OUT + ".partial", OUT)


def sample_and_write_when_quiet() -> None:
    last = written = None
    while True:
        time.sleep(1.0)
        TRACE["cpu"].append((now(), len(TRACE["steps"]), thread_cpu_seconds()))
        size = (len(TRACE["events"]), len(TRACE["steps"]))
        if size == last and size != written:
            write()
            written = size
        last = size


if OUT and sys.orig_argv[1:3] == ["-m", "handler"]:
    install()
    atexit.register(write)
    threading.Thread(target=sample_and_write_when_quiet, name="trace", daemon=True).start()
    if os.environ.get("HANDLER_TRACE_STACKS"):
        threading.Thread(target=sample_engine_stacks, name="trace-stacks", daemon=True).start()
