"""The worker's C kernels (csrc/: a file per op, compiled as one unit through csrc/kernels.c), built
for this CPU on first use and loaded with ctypes: build.py builds and loads one library per
instruction set (why C, and why at run time: there), bindings.py wraps its functions for tensors,
packing.py lays weights out as they read them, and choice.py measures where PyTorch's own path wins.
Callers use the names below.
"""

from inferplane.worker.ops.native.bindings import (
    FLOAT32_BITS,
    KERNEL_NAMES,
    DecodeInputs,
    DecodeTail,
    LayerWeights,
    LinearOperands,
    MoeWeights,
    NativeKernels,
    decode_views_read,
    float32_rows,
    kernel_isas,
)
from inferplane.worker.ops.native.build import (
    EMULATED_BUILDS,
    ISA_BUILDS,
    chosen_isa,
    cpu_flags,
    emulated_isas,
    kernels,
    kernels_for,
    supported_isas,
)
from inferplane.worker.ops.native.packing import (
    BLOCK,
    BLOCK_KINDS,
    Q8_MIN,
    block_group_bytes,
    block_shape_supported,
    int8_shape_supported,
    pack_blocks,
    pack_int8_weight,
    unpack_blocks,
    unpack_int8_weight,
)

__all__ = ["BLOCK", "BLOCK_KINDS", "EMULATED_BUILDS", "FLOAT32_BITS", "ISA_BUILDS", "KERNEL_NAMES", "Q8_MIN",
           "DecodeInputs", "DecodeTail", "LayerWeights", "LinearOperands", "MoeWeights", "NativeKernels",
           "block_group_bytes", "block_shape_supported", "chosen_isa", "cpu_flags", "decode_views_read",
           "emulated_isas", "float32_rows", "int8_shape_supported", "kernel_isas", "kernels", "kernels_for",
           "pack_blocks", "pack_int8_weight", "supported_isas", "unpack_blocks", "unpack_int8_weight"]
