"""Without a GPU the Triton kernels run under Triton's interpreter. The flag must be set before anything
imports triton (transformers and sentence-transformers do), so it is set here, before any test module loads."""
import os
import shutil

if shutil.which("nvidia-smi") is None and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("HFENDPOINT_GPU_FEATURES"):
    # On a GPU the kernel tests then run the paths the variable leaves (portable: the pre-Hopper ones on Hopper),
    # as the engine applies it at start (engine.LLM takes its own gpu_features, auto unless told).
    from kernels import gpu_features

    gpu_features.configure(gpu_features.parse(os.environ["HFENDPOINT_GPU_FEATURES"]))
