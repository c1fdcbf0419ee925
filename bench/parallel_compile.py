"""Whether Triton compiles the engine's kernels faster in parallel on this host: an empty-cache start compiles its
kernels one after another (the profile step's, then the first request's), so this measures what compiling them at
once would save before the engine does so.

    PYTHONPATH=. python3 bench/parallel_compile.py                      # serial, then 4 and 8 threads, sm_90
    PYTHONPATH=. python3 bench/parallel_compile.py --threads 1 16 --capability 89

Each case runs in a fresh process with an empty Triton cache and compiles, for the target, every kernel a bf16
dense decoder launches (tests/kernels/compile_for_target.py's launches: a layer's norms, projections, activations
and sampling, attention without a cache and over a paged cache), without running any. 1 thread: Triton's own
compile, one kernel at a time; N threads: the same launches inside triton.AsyncCompileMode (Triton 3.4 and later)
with a pool of N threads, which compiles them concurrently. No GPU is used: the target is given.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compile_all(threads: int, capability: int) -> dict:
    """Compiles the launches in this process; returns the seconds, the launches and the kernels compiled."""
    sys.path.insert(0, str(ROOT / "tests" / "kernels"))
    import compile_for_target as target
    import torch
    import triton

    from kernels import gpu_features

    compiled = []
    target.pretend(target.GPUS[capability], gpu_features.parse("auto"), compiled)
    dtype = torch.bfloat16

    def launch() -> None:
        target.launch_layers(dtype)
        target.launch_without_cache(dtype)
        target.launch_attention(dtype, dtype)

    started = time.perf_counter()
    if threads == 1:
        launch()
    else:
        with ThreadPoolExecutor(threads) as pool, triton.AsyncCompileMode(pool):
            launch()
        for _, kernel in compiled:
            kernel.result()  # raises what a compile raised
    seconds = time.perf_counter() - started
    cubins = sum(1 for _ in Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin"))
    return {"threads": threads, "seconds": round(seconds, 2), "launches": len(compiled), "kernels": cubins,
            "triton": triton.__version__}


def run_case(threads: int, capability: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="parallel-compile-") as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        env.pop("TRITON_INTERPRET", None)  # the interpreter compiles nothing
        out = subprocess.run([sys.executable, __file__, "--child", str(threads), "--capability", str(capability)],
                             env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{threads} threads failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8], help="1: serial; N: AsyncCompileMode")
    ap.add_argument("--capability", type=int, default=90, help="the target, as tests/kernels/compile_for_target.py")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(compile_all(args.child, args.capability)), flush=True)
        os._exit(0)  # no interpreter teardown: Triton's bindings report their objects as leaked there
    import triton
    if max(args.threads) > 1 and not hasattr(triton, "AsyncCompileMode"):
        print(f"triton {triton.__version__} has no AsyncCompileMode: serial only")
        args.threads = [1]
    print(f"{'threads':>7} {'seconds':>8} {'launches':>8} {'kernels':>7}  "
          f"(sm_{args.capability}, {os.cpu_count()} CPUs)")
    for threads in args.threads:
        result = run_case(threads, args.capability)
        print(f"{threads:>7} {result['seconds']:>8.2f} {result['launches']:>8} {result['kernels']:>7}  "
              f"triton {result['triton']}", flush=True)


if __name__ == "__main__":
    main()
