"""Where an engine's time goes, step by step: wraps an LLM's EngineCore.step and ModelRunner.launch to time
each step and record what it launched, and counts Triton compilations (a JIT compile mid-run stalls the
engine). report() prints, per kind of step (prefill or mixed; decode by batch size), the steps, their
seconds and the seconds a bandwidth-bound step would need (weights plus the KV cache of every launched
sequence, read once at --bandwidth), then the compilations and the slowest steps. Times are host wall
clock between step returns: with overlap on, a step's time is the device time of the step it finished."""
import math
import time
from collections import defaultdict

import triton.knobs

DECODE_BUCKETS = (1, 8, 32, 64, 128, 192, 256)


class StepTrace:
    def __init__(self, llm, bandwidth: float = 3.0e12):
        runner = llm.core.runner
        self.weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        self.kv_bytes_per_token = kv_bytes_per_token(runner)
        self.bandwidth, self.steps, self.compiles, self.launches = bandwidth, [], [], []
        self._wrap(llm.core, runner)
        triton.knobs.runtime.jit_cache_hook = self._on_compile

    def _wrap(self, core, runner):
        step, launch = core.step, runner.launch

        def timed_step():
            self.launches.clear()
            start = time.perf_counter()
            result = step()
            self.steps.append((time.perf_counter() - start, list(self.launches)))
            return result

        def recorded_launch(seqs, num_tokens, *ahead_and_follows):
            self.launches.append((len(seqs), sum(num_tokens), sum(len(seq) for seq in seqs)))
            return launch(seqs, num_tokens, *ahead_and_follows)

        core.step, runner.launch = timed_step, recorded_launch

    def _on_compile(self, *, repr, **_):
        self.compiles.append((len(self.steps), repr.split("[")[0]))
        return False

    def floor_seconds(self, launches) -> float:
        return sum(self.weight_bytes + context * self.kv_bytes_per_token for _, _, context in launches) / self.bandwidth

    def report(self) -> None:
        rows = defaultdict(lambda: [0, 0.0, 0.0])
        for seconds, launches in self.steps:
            row = rows[kind_of(launches)]
            row[0] += 1
            row[1] += seconds
            row[2] += self.floor_seconds(launches)
        print(f"{'step kind':24} {'steps':>6} {'seconds':>8} {'floor s':>8} {'ms/step':>8}")
        for kind in sorted(rows, key=sort_key):
            count, seconds, floor = rows[kind]
            print(f"{kind:24} {count:6d} {seconds:8.3f} {floor:8.3f} {1e3 * seconds / count:8.3f}")
        total = [sum(r[i] for r in rows.values()) for i in range(3)]
        print(f"{'all':24} {total[0]:6d} {total[1]:8.3f} {total[2]:8.3f}")
        print(f"triton compilations: {len(self.compiles)}", *(f"  step {i}: {name}" for i, name in self.compiles),
              sep="\n")
        slowest = sorted(range(len(self.steps)), key=lambda i: -self.steps[i][0])[:8]
        print("slowest steps (index, ms, launches as (seqs, tokens, context)):",
              *(f"  {i}: {1e3 * self.steps[i][0]:.2f} {self.steps[i][1]}" for i in slowest), sep="\n")
        self.steps.clear()
        self.compiles.clear()


def kind_of(launches) -> str:
    if not launches:
        return "nothing launched"
    if any(tokens > seqs for seqs, tokens, _ in launches):
        return "prefill or mixed"
    batch = max(seqs for seqs, _, _ in launches)
    upper = next(b for b in DECODE_BUCKETS if b >= batch) if batch <= DECODE_BUCKETS[-1] else batch
    return f"decode batch <= {upper}"


def sort_key(kind: str):
    return (0, 0) if kind.startswith("prefill") else (1, int(kind.split()[-1])) if "<=" in kind else (2, 0)


def kv_bytes_per_token(runner) -> int:
    """Keys and values of one token in every layer."""
    shape = runner.model.kv_cache_shape(1, runner.block_size)
    return 2 * math.prod(shape) // runner.block_size * runner.config.kv_cache_torch_dtype.itemsize
