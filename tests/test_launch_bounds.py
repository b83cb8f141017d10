"""schedules/launch_bounds.py: a kernel's minimum-blocks request becomes its launch bounds."""

import pytest

from schedules.launch_bounds import apply_min_blocks, min_blocks_per_sm

SRC = '''extern "C" __global__ void __launch_bounds__(128) a_kernel(int* x);
extern "C" __global__ void __launch_bounds__(256) b_kernel(int* x);
__forceinline__ __device__ void k3_min_blocks_5() {}
extern "C" __global__ void __launch_bounds__(128) a_kernel(int* x) {
  k3_min_blocks_5();
  x[0] = 1;
}

extern "C" __global__ void __launch_bounds__(256) b_kernel(int* x) {
  x[0] = 2;
}
'''


def test_request_applies_to_its_kernel_only():
    out = apply_min_blocks(SRC)
    assert out.count("__launch_bounds__(128, 5) a_kernel(") == 2  # declaration and definition
    assert out.count("__launch_bounds__(256) b_kernel(") == 2
    assert apply_min_blocks(SRC.replace("k3_min_blocks_5();", "")) == SRC.replace("k3_min_blocks_5();", "")


def test_bad_request_rejected():
    with pytest.raises(ValueError, match="1..32"):
        min_blocks_per_sm(0)
