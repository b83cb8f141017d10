"""Profile the MoE decode GEMVs (schedules/moe_mxfp4_cuda.py or moe_mxfp4_decode_tc.py) at
K3 shapes.

GPU machine, runtime-only TVM: ``ncu --kernel-name regex:moe_mxfp4 --launch-skip 2
--launch-count 2 --set full python3 tests/gpu/profile_moe_decode.py dist/moe 1`` (a folder
holding ``moe_mxfp4.so`` from ``python benchmarks/moe.py build dist/moe``; the second
argument is the number of decode tokens T). Runs chain + gate_up + down twice over T tokens,
each routed to 16 distinct random experts of 896 resident MXFP4 experts (random codes).
Timing only: the random codes are not permuted into the tc layout the tensor-core kernels
read (schedules/mxfp4_tc_layout.py), so their outputs are not the reference's.
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
T = int(sys.argv[2]) if len(sys.argv) > 2 else 1
chain_f, gu_f, down_f = (lib[n] for n in FUNCS)
dev = torch.device("cuda")
W = random_experts(E, L, I, dev)
tw = {k: [tvm.runtime.from_dlpack(t) for t in v] for k, v in W.items()}
z = torch.randn(T, L, device=dev).to(torch.bfloat16)
ids = torch.stack([torch.randperm(E, device=dev)[:TOPK] for _ in range(T)]).int()
chain = torch.empty(T, TOPK, 2, dtype=torch.int32, device=dev)
a = torch.empty(T, TOPK, I, dtype=torch.bfloat16, device=dev)
o = torch.empty(T, TOPK, L, dtype=torch.bfloat16, device=dev)
tz, tids, tc, ta, to = (tvm.runtime.from_dlpack(x) for x in (z, ids, chain, a, o))
for _ in range(2):
    chain_f(tids, tc)
    gu_f(tz, *tw["w1"], *tw["w3"], tc, tids, ta)
    down_f(ta, *tw["w2"], tc, tids, to)
torch.cuda.synchronize()
print("ok")
