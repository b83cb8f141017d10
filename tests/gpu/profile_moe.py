"""Profile the MXFP4 MoE decode kernels (schedules/moe_mxfp4_cuda.py) at K3 shapes, 1 token.

GPU machine, runtime-only TVM: ``ncu --section SpeedOfLight ... python3 tests/gpu/profile_moe.py dist/moe``
(the library from ``python benchmarks/moe.py build dist/moe``). Runs each kernel a few times
on random MXFP4 experts (896 × K3 sizes, resident) for T = 1 token × top-16.
"""

import sys
from pathlib import Path

import torch
import tvm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from k3_compile.device_code import load_cuda_runtime  # noqa: E402
from moe import E, FUNCS, I, L, TOPK, random_experts  # noqa: E402

load_cuda_runtime()
lib = tvm.runtime.load_module(str(Path(sys.argv[1]) / "moe_mxfp4.so"))
chain_f, gu_f, down_f = (lib[n] for n in FUNCS)
dev = torch.device("cuda")
W = random_experts(E, L, I, dev)
tw = {k: [tvm.runtime.from_dlpack(t) for t in v] for k, v in W.items()}
T = 1
z = torch.randn(T, L, device=dev).to(torch.bfloat16)
ids = torch.randperm(E, device=dev)[:TOPK].view(T, TOPK).int()
chain = torch.empty(T, TOPK, 2, dtype=torch.int32, device=dev)
a = torch.empty(T, TOPK, I, dtype=torch.bfloat16, device=dev)
o = torch.empty(T, TOPK, L, dtype=torch.bfloat16, device=dev)
tv = [tvm.runtime.from_dlpack(t) for t in (z, ids, chain, a, o)]
for _ in range(3):
    chain_f(tv[1], tv[2])
    gu_f(tv[0], *tw["w1"], *tw["w3"], tv[2], tv[1], tv[3])
    down_f(tv[3], *tw["w2"], tv[2], tv[1], tv[4])
torch.cuda.synchronize()
print("ok")
