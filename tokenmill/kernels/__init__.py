"""Every kernel of tokenmill, in one home: ``cpu/`` (the C++ extension and its build),
``triton/`` (the GPU's Triton kernels), ``tuning/`` (launch settings per GPU model). Kernels
are typed ops over tensors; no model family is named here: the models above choose them.
"""
