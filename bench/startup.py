"""Start-up time: from a fresh process to a ready engine and its first token, with an empty and a warm Triton cache.

    PYTHONPATH=. python3 bench/startup.py                                   # Qwen3-0.6B and -8B shapes, both entries
    PYTHONPATH=. python3 bench/startup.py --models qwen3-0.6b --entries engine --no-warm
    PYTHONPATH=. python3 bench/startup.py --front-cmd "python3 -m daemon_protocol.mock_daemon"
    PYTHONPATH=. python3 bench/startup.py --models qwen3-8b --entries engine --env HFENDPOINT_GPU_FEATURES=portable
    PYTHONPATH=. python3 bench/startup.py --models qwen3-0.6b --entries engine --no-warm --importtime
    PYTHONPATH=. python3 bench/startup.py --models qwen3-0.6b --entries engine --profile

For each model shape (random weights on local disk, bench/random_model.py, served with bench/serve.py's word-level
tokenizer) and each entry, every case runs in a fresh process:

- entry `engine`: `from engine import LLM`, `LLM(path)`, then one greedy token of a 16-token prompt. Times: imports
  done, engine ready, first token (the script prints a marker at each; this process clocks it on arrival).
- entry `front`: the front with the handler behind it, as the container runs them (`FRONT --host 127.0.0.1 --port 0
  -- python -m handler`, MODEL_ID the model); FRONT is `python -m front` where that package exists, else the older
  `python -m daemon_protocol.mock_daemon`, or --front-cmd. Times: the handler's "engine ready" start-up line, the
  first /health 200 (polled every HEALTH_POLL_S), and the first content chunk of a streamed chat completion sent
  right after.

Cache `empty` points TRITON_CACHE_DIR at a new folder; `warm` then reuses the folder the empty case of the same
model and entry filled. Every time is in seconds from the moment the process was started.
Each case also shows the engine's start-up lines (engine/startup_log.py): where its seconds went. --env adds
variables to every case's environment (HFENDPOINT_GPU_FEATURES=portable: the pre-Hopper paths).
--importtime runs the engine entry under `python -X importtime` (which slows imports a little) and lists, for the
imports before "imports done" and for those after it, the packages whose modules took longest (their own time,
nested imports excluded) and the slowest modules.
--profile runs the engine entry's start and first token (after its imports) under cProfile, which sees the main
thread only and slows Python code, and lists the functions that took longest on it, their own time and with what
they called: a wait for the GIL that another start-up thread holds counts as the waiting call's own time.
"""
import argparse
import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from serve import chat_body, client_session, served_model_dir, stop_process, stream_chat

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODELS = ("qwen3-0.6b", "qwen3-8b")
ENTRIES = ("engine", "front")
CACHES = ("empty", "warm")
PROMPT_IDS = list(range(1, 17))
HEALTH_POLL_S = 0.02
CASE_TIMEOUT_S = 900.0
STARTUP_LOGGER = "engine.startup: "

ENGINE_SCRIPT = """
import cProfile, io, logging, os, pathlib, pstats, sys
sys.stdout = sys.stderr  # the marks in order with the log and -X importtime lines
profiler = cProfile.Profile() if len(sys.argv) > 3 else None  # argv[3]: the rows to list
print("started", flush=True)
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
logging.getLogger("engine").setLevel(logging.INFO)
from engine import LLM, SamplingParams
print("imports done", flush=True)
if profiler:
    profiler.enable()
llm = LLM(sys.argv[1])
print("engine ready", flush=True)
if profiler:
    profiler.disable()
print("kernels at ready", sum(1 for _ in pathlib.Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin")), flush=True)
if profiler:
    profiler.enable()
llm.generate([list(map(int, sys.argv[2].split(",")))], SamplingParams(max_tokens=1, temperature=0))
print("first token", flush=True)
if profiler:
    profiler.disable()
    for order in ("tottime", "cumtime"):
        report = io.StringIO()
        pstats.Stats(profiler, stream=report).sort_stats(order).print_stats(int(sys.argv[3]))
        for line in report.getvalue().splitlines():
            print("profile:", line, flush=True)
    print("profile done", flush=True)
"""

VERSIONS_SCRIPT = """
import importlib.metadata, sys
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "missing"
names = ("torch", "triton", "transformers", "tokenizers", "huggingface_hub", "xgrammar")
print(f"python {sys.version.split()[0]}, " + ", ".join(f"{name} {version(name)}" for name in names))
"""


@dataclass
class Case:
    model: str
    entry: str
    cache: str
    marks: dict[str, float] = field(default_factory=dict)  # event -> seconds since the process was started
    lines: list[str] = field(default_factory=list)  # the start-up lines, as logged
    kernels: int = 0  # compiled kernels in the Triton cache after the case
    kernels_at_ready: int | None = None  # of those, compiled before the engine was ready (entry engine only)

    @property
    def label(self) -> str:
        return f"{self.model} {self.entry} {self.cache} cache"


class Process:
    """A started process whose output lines are read as they come, each stamped with its arrival time."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.started = time.perf_counter()
        self.process = subprocess.Popen(command, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(stream,), daemon=True)
                         for stream in (self.process.stdout, self.process.stderr)]
        for reader in self._readers:
            reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self.lines.append((time.perf_counter() - self.started, line.rstrip("\n")))
                self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = CASE_TIMEOUT_S) -> tuple[float, re.Match]:
        """(seconds since the start, match) of the first line matching pattern; RuntimeError if the process
        exits or the timeout passes first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for at, line in self.lines:
                    if found := re.search(pattern, line):
                        return at, found
                if self.process.poll() is not None or time.monotonic() > deadline:
                    tail = "\n".join(line for _, line in self.lines[-30:])
                    raise RuntimeError(f"no line matching {pattern!r} (exit code {self.process.poll()}):\n{tail}")
                self._changed.wait(0.1)

    def now(self) -> float:
        return time.perf_counter() - self.started

    def stop(self) -> None:
        stop_process(self.process)
        for reader in self._readers:
            reader.join(5)


def default_front() -> list[str]:
    module = "front" if (ROOT / "front" / "__main__.py").is_file() else "daemon_protocol.mock_daemon"
    return [sys.executable, "-m", module]


def run_engine(case: Case, model_dir: Path, env: dict[str, str], importtime: bool = False,
               profile: bool = False) -> Process:
    python = [sys.executable, "-X", "importtime"] if importtime else [sys.executable]
    process = Process([*python, "-c", ENGINE_SCRIPT, str(model_dir), ",".join(map(str, PROMPT_IDS)),
                       *([str(PROFILE_ROWS)] if profile else [])], env)
    for mark in ("imports done", "engine ready", "first token"):
        case.marks[mark] = process.wait_for(f"^{mark}$")[0]
    case.kernels_at_ready = int(process.wait_for(r"^kernels at ready (\d+)$")[1].group(1))
    if profile:
        process.wait_for("^profile done$")
    return process


IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)$")
TOP_IMPORTS = 12
PROFILE_ROWS = 30  # functions listed by --profile, in each order


def import_report(lines: list[tuple[float, str]], imports_done: float) -> str:
    """The `-X importtime` lines of a process, before and after its "imports done" mark: the packages whose
    modules took longest (microseconds of each module's own work, summed per top-level package) and the slowest
    modules."""
    parts = {"before imports done": [], "after": []}
    for at, line in lines:
        if found := IMPORT_LINE.match(line):
            parts["before imports done" if at <= imports_done else "after"].append(
                (int(found.group(1)) / 1e6, found.group(2)))
    report = []
    for part, modules in parts.items():
        packages: dict[str, float] = {}
        for seconds, module in modules:
            packages[module.split(".")[0]] = packages.get(module.split(".")[0], 0.0) + seconds
        slowest = sorted(packages.items(), key=lambda item: -item[1])[:TOP_IMPORTS]
        report.append(f"imports {part}: {sum(packages.values()):.2f} s in {len(modules)} modules; by package: "
                      + ", ".join(f"{name} {seconds:.2f}" for name, seconds in slowest))
        report.append("  slowest modules: " + ", ".join(
            f"{module} {seconds:.3f}" for seconds, module in sorted(modules, reverse=True)[:TOP_IMPORTS]))
    return "\n".join(report)


def run_front(case: Case, model_dir: Path, env: dict[str, str], front: list[str]) -> Process:
    env = {**env, "MODEL_ID": str(model_dir), "HFENDPOINT_REPOSITORY_DIR": "/nonexistent"}
    process = Process([*front, "--host", "127.0.0.1", "--port", "0", "--", sys.executable, "-m", "handler"], env)
    case.marks["front listening"], found = process.wait_for(r"listening on (http://\S+)", 120)
    url = found.group(1)
    asyncio.run(first_token_through(case, process, url))
    case.marks["engine ready"] = process.wait_for(STARTUP_LOGGER + "engine ready at")[0]
    return process


async def first_token_through(case: Case, process: Process, url: str) -> None:
    """Polls /health until 200, then streams one chat completion of one token."""
    async with client_session() as session:
        deadline = time.monotonic() + CASE_TIMEOUT_S
        while True:
            if process.process.poll() is not None:
                process.wait_for(r"^(?!)")  # raises with the output's tail
            try:
                async with session.get(f"{url}/health") as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"/health is not 200 after {CASE_TIMEOUT_S:.0f} s")
            await asyncio.sleep(HEALTH_POLL_S)
        case.marks["health 200"] = process.now()
        result = await stream_chat(session, url, chat_body(PROMPT_IDS, 1, 0.0), 1)
        case.marks["first token"] = result.chunk_times[0] - process.started


def case_env(cache_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, **(extra or {}), "TRITON_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_case(case: Case, model_dir: Path, cache_dir: Path, front: list[str], extra_env: dict[str, str],
             importtime: bool, profile: bool) -> None:
    env = case_env(cache_dir, extra_env)
    print(f"--- {case.label}", flush=True)
    process = None
    try:
        process = (run_engine(case, model_dir, env, importtime, profile) if case.entry == "engine"
                   else run_front(case, model_dir, env, front))
    finally:
        if process:
            process.stop()
            case.lines = [line[line.index(STARTUP_LOGGER):] for _, line in process.lines if STARTUP_LOGGER in line]
    case.kernels = sum(1 for path in cache_dir.rglob("*.cubin"))
    for line in case.lines:
        print(f"    {line}")
    print("    " + ", ".join(f"{mark} {seconds:.2f}" for mark, seconds in case.marks.items()), flush=True)
    if importtime and case.entry == "engine":
        print("    " + import_report(process.lines, case.marks["imports done"]).replace("\n", "\n    "), flush=True)
    for _, line in process.lines:
        if line.startswith("profile: "):
            print(f"    {line}")


def random_model(name: str) -> Path:
    """Random bf16 weights of the shape, written once (bench/random_model.py) in a process of their own, which
    frees the GPU when it ends."""
    out = subprocess.run([sys.executable, str(HERE / "random_model.py"), name], check=True, cwd=ROOT,
                         capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def table(cases: list[Case]) -> str:
    marks = ("imports done", "engine ready", "health 200", "first token")
    rows = [f"{'model':<11} {'entry':<7} {'cache':<6} " + " ".join(f"{mark:>13}" for mark in marks)
            + "  kernels (at ready)"]
    for case in cases:
        cells = " ".join(f"{case.marks[mark]:>13.2f}" if mark in case.marks else f"{'-':>13}" for mark in marks)
        at_ready = "-" if case.kernels_at_ready is None else case.kernels_at_ready
        rows.append(f"{case.model:<11} {case.entry:<7} {case.cache:<6} {cells}  {case.kernels:>7} ({at_ready})")
    return "\n".join(rows)


def versions() -> str:
    """The versions of the libraries a start imports, as the cases' processes find them (PYTHONPATH included)."""
    return subprocess.run([sys.executable, "-c", VERSIONS_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          env=case_env(Path(tempfile.gettempdir()))).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="configs under bench/models")
    ap.add_argument("--entries", nargs="+", default=list(ENTRIES), choices=ENTRIES)
    ap.add_argument("--no-warm", dest="warm", action="store_false", help="only the empty-cache cases")
    ap.add_argument("--front-cmd", help="the front's command before its arguments (default: python -m front where "
                                        "it exists, else python -m daemon_protocol.mock_daemon)")
    ap.add_argument("--cache-root", default=None, help="where the Triton cache folders go (default: a new temp dir)")
    ap.add_argument("--json", help="write every case's marks and start-up lines here")
    ap.add_argument("--env", nargs="+", default=[], metavar="NAME=VALUE", help="variables for every case")
    ap.add_argument("--importtime", action="store_true",
                    help="the engine entry under python -X importtime, with where its imports' seconds went")
    ap.add_argument("--profile", action="store_true",
                    help="the engine entry's start and first token under cProfile, with its slowest functions")
    args = ap.parse_args()
    if bad := [item for item in args.env if "=" not in item]:
        ap.error(f"--env takes NAME=VALUE, not {bad[0]!r}")
    extra_env = dict(item.split("=", 1) for item in args.env)
    front = shlex.split(args.front_cmd) if args.front_cmd else default_front()
    cache_root = Path(args.cache_root or tempfile.mkdtemp(prefix="startup-triton-"))
    cases = []
    print(versions() + "".join(f", {name}={value}" for name, value in extra_env.items()), flush=True)
    with tempfile.TemporaryDirectory() as served_root:
        for model in args.models:
            model_dir = served_model_dir(random_model(model), Path(served_root))
            for entry in args.entries:
                cache_dir = cache_root / f"{model}-{entry}-{time.time_ns()}"
                cache_dir.mkdir(parents=True)
                for cache in CACHES[:1 + args.warm]:  # empty first: warm reuses what it filled
                    cases.append(Case(model, entry, cache))
                    run_case(cases[-1], model_dir, cache_dir, front, extra_env, args.importtime, args.profile)
    print(table(cases))
    if args.json:
        Path(args.json).write_text(json.dumps([case.__dict__ for case in cases], indent=1))


if __name__ == "__main__":
    main()
