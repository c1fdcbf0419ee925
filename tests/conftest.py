"""Without a GPU the Triton kernels run under Triton's interpreter. The flag must be set before anything
imports triton (transformers and sentence-transformers do), so it is set here, before any test module loads."""
import os
import shutil

if shutil.which("nvidia-smi") is None and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
