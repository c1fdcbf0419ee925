"""Decode attention compiled for a Hopper GPU (sm_90) on any machine, no GPU needed: its registers, spilled bytes
and shared memory, and its main loop's instructions by kind, read from the SASS of Triton's bundled ptxas and
cuobjdump. A compile takes seconds and no device time, so a change to the kernel's loop can be read here before it
is timed on the GPU (bench/RESULTS.md, 2026-11-25, says what the loop held then). The launch is the engine's for
the Qwen3-0.6B shape (16 query and 8 KV heads of 128, blocks of 16), with the specializations Triton's JIT gives
it (16-byte aligned pointers and strides). The GPU image has Triton 3.6 and other versions compile differently:
for faithful output install that one beside torch in a virtualenv of its own.

--gluon WARPS[,MAX_REGISTERS] reads the Gluon kernel that takes large FP8 batches instead (kernels/gluon_decode.py,
WARPS warps per program), whose loop folds a page of 16 keys per warp.

Run without TRITON_INTERPRET: PYTHONPATH=. python bench/sass_report.py [--cache-dtype bf16] [--tiles N,WARPS,STAGES,
MIN_SPLIT,MAX_REGISTERS] [--split] [--gluon WARPS[,MAX_REGISTERS]]"""
import argparse
import inspect
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import gluon_decode, triton_attention

POINTERS = {"q_ptr": "*bf16", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "seq_order_ptr": "*i32",
            "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "arrivals_ptr": "*i32",
            "sinks_ptr": "*bf16", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "cos_sin_ptr": "*fp32",
            "q_norm_ptr": "*bf16", "k_norm_ptr": "*bf16", "slot_mapping_ptr": "*i64", "positions_ptr": "*i64"}
ALIGNED_INTS = {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_bt", "stride_slot", "stride_cs"}
FLOATS = {"qk_scale", "eps"}
TOOLS = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")


def compile_decode(fp8: bool, tiles: triton_attention.DecodeTiles, split: bool):
    """The fused decode kernel (prologue, keys and values by the block table, bf16 queries) as the engine launches
    it for a Qwen3-0.6B step, compiled for sm_90."""
    cache = "*fp8e4nv" if fp8 else "*bf16"
    constants = dict(GROUP=2, GROUP_BLOCK=16, HEAD_DIM=128, BLOCK_N=tiles.block_n, BLOCK_SIZE=16, SPLIT=split,
                     DOT_PRECISION="tf32", LENS_BLOCK=256, BALANCE=split, SPLITS_BLOCK=2 if split else 1,
                     ORDERED=True, PROLOGUE=True, HAS_NORM=True, NUM_Q_HEADS=16, WINDOW=False, HAS_SINKS=False,
                     FP8=fp8, PTX=fp8, HAS_POSITIONS=False, USE_PDL=True)
    names = list(inspect.signature(triton_attention._decode_kernel.fn).parameters)
    signature, attrs = {}, {}
    for index, name in enumerate(names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = cache if name in ("k_cache_ptr", "v_cache_ptr") else POINTERS[name]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
        if name.endswith("_ptr") or name in ALIGNED_INTS:
            attrs[(index,)] = [["tt.divisibility", 16]]
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    if registers := tiles.registers(split):
        options["maxnreg"] = registers
    source = ASTSource(fn=triton_attention._decode_kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_gluon_decode(warps: int, max_registers: int):
    """kernels/gluon_decode.py's kernel as decode_attention launches it for a Qwen3-0.6B step, compiled for sm_90."""
    from triton.experimental.gluon._runtime import GluonASTSource

    pointers = {**POINTERS, "k_cache_ptr": "*i32", "v_cache_ptr": "*i32"}  # the cache is read as int32 words
    constants = {"GROUP": 2, "BLOCK_SIZE": 16, "ORDERED": True, "W": warps, "USE_PDL": True}
    names = list(inspect.signature(gluon_decode._decode_kernel.fn).parameters)
    signature = {name: "constexpr" if name in constants else pointers.get(name, "fp32" if name in FLOATS else "i32")
                 for name in names}
    attrs = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(names)
             if name.endswith("_ptr") or name in ALIGNED_INTS}
    source = GluonASTSource(fn=gluon_decode._decode_kernel, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": warps, **({"maxnreg": max_registers} if max_registers else {})}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([os.path.join(TOOLS, "cuobjdump"), flag, file.name], check=True, capture_output=True,
                              text=True).stdout


def main_loop(sass: str) -> list[str]:
    """The opcodes of the loop (a backward branch's span) that holds the most matrix instructions."""
    code = [(int(address, 16), op) for address, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z]\w*)",
                                                                     sass)]
    loops = [(int(target, 16), int(address, 16))
             for address, target in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`\()?0x([0-9a-f]+)",
                                               sass) if int(target, 16) < int(address, 16)]
    bodies = [[op for address, op in code if start <= address <= end] for start, end in loops]
    return max(bodies, key=lambda ops: (ops.count("HMMA"), len(ops)), default=[])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--tiles", metavar="N,WARPS,STAGES,MIN_SPLIT,MAX_REGISTERS",
                    help="decode tiles (default: the engine's for the cache dtype)")
    ap.add_argument("--split", action="store_true", help="the split launch (small batches) instead of the unsplit")
    ap.add_argument("--gluon", metavar="WARPS[,MAX_REGISTERS]",
                    help="the Gluon FP8 kernel with WARPS warps per program (registers capped at MAX_REGISTERS)")
    args = ap.parse_args()
    fp8 = args.cache_dtype == "fp8"
    tiles = (triton_attention.DecodeTiles(*map(int, args.tiles.split(","))) if args.tiles
             else triton_attention.FP8_DECODE_TILES if fp8 else triton_attention.DECODE_TILES)
    if args.gluon:
        warps, max_registers = ([*map(int, args.gluon.split(",")), 0])[:2]
        kernel = compile_gluon_decode(warps, max_registers)
    else:
        kernel = compile_decode(fp8, tiles, args.split)
    usage = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(kernel.asm["cubin"], "--dump-resource-usage"))
    loop = main_loop(cuobjdump(kernel.asm["cubin"], "--dump-sass"))
    if args.gluon:
        print(f"triton {triton.__version__}, Gluon FP8 decode, {warps} warps per program, registers capped at "
              f"{max_registers or 'none'}")
    else:
        print(f"triton {triton.__version__}, {args.cache_dtype} cache, {tiles}, {'split' if args.split else 'unsplit'}")
    print(f"registers {usage[1]}, stack (spills) {usage[2]} bytes, shared memory {kernel.metadata.shared} bytes")
    step = f"page of {gluon_decode.PAGE.value} keys per warp" if args.gluon else f"tile of {tiles.block_n} keys"
    print(f"main loop: {len(loop)} instructions per thread per {step}")
    for op, count in Counter(loop).most_common(24):
        print(f"  {op:10} {count:4d}")


if __name__ == "__main__":
    main()
