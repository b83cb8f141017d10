"""Profile the MoE prefill grouped GEMMs (schedules/moe_mxfp4_prefill_cuda.py) at K3 shapes.

GPU machine, runtime-only TVM: ``ncu --kernel-name regex:grouped --section SpeedOfLight ...
python3 tests/gpu/profile_moe_prefill.py dist/moe/moe_prefill.so 8192`` (the library from
``python benchmarks/moe.py build dist/moe``). One sort + gate_up + down pass over T tokens
routed uniformly at random to top-16 of 896 MXFP4 experts (random codes, resident).
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
from moe import E, I, L, PREFILL_FUNCS, TOPK, random_experts  # noqa: E402
from schedules.moe_plan import max_tiles  # noqa: E402

load_cuda_runtime()
lib = tvm.runtime.load_module(sys.argv[1])
T = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
sort_f, gu_f, down_f = (lib[n] for n in PREFILL_FUNCS)
dev = torch.device("cuda")
W = random_experts(E, L, I, dev)
tw = {k: [tvm.runtime.from_dlpack(t) for t in v] for k, v in W.items()}
P = T * TOPK
z = torch.randn(T, L, device=dev).to(torch.bfloat16)
ids = torch.rand(T, E, device=dev).topk(TOPK, dim=1).indices.int()
bufs = [torch.empty(P, dtype=torch.int32, device=dev),
        torch.empty(max_tiles(P, E, 32), 3, dtype=torch.int32, device=dev),
        torch.empty(1, dtype=torch.int32, device=dev), torch.empty(E, dtype=torch.int32, device=dev)]
a = torch.empty(P, I, dtype=torch.bfloat16, device=dev)
o = torch.empty(T, TOPK, L, dtype=torch.bfloat16, device=dev)
s, tiles, nt, cnt = (tvm.runtime.from_dlpack(b) for b in bufs)
ta, to, tz, tids = (tvm.runtime.from_dlpack(x) for x in (a, o, z, ids))
sort_f(tids, s, tiles, nt, cnt)
gu_f(tz, *tw["w1"], *tw["w3"], s, tiles, nt, ta)
down_f(ta, *tw["w2"], *tw["w2"], s, tiles, nt, to)
torch.cuda.synchronize()
print("ok")
