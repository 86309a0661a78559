"""The Triton kernels of the CUDA path (attention, fused norms and rotary, matmuls, fp8, greedy
sampling, L2 prefetch, programmatic dependent launch). Import a module only where Triton
is installed (``tokenmill.utils.triton_module``).
"""
