import os
import sys
from pathlib import Path

import torch

# Dense references live next to the tests.
sys.path.insert(0, str(Path(__file__).parent))

# Without a GPU the fused Triton kernels run in Triton's CPU interpreter (tests only ask for them with
# kernel="fused"; "auto" never sends CPU tensors there). Must be set before the kernels are first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
